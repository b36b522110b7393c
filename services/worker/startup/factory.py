"""Assemble an engine from a checkpoint directory (used by the worker's main and by tests)."""
from __future__ import annotations

import dataclasses
import logging
import pathlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from services.worker.adapters.device_pool import DevicePool
from services.worker.config import EngineOptions
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.loop import Engine
from services.worker.engine.scheduler import Scheduler
from services.worker.executor.model_runner import ModelRunner, kv_blocks_for_budget
from services.worker.executor.token_mask import TokenMasks, mask_threads
from services.worker.model import transforms
from services.worker.model.checkpoint import DTYPES, load_weights
from services.worker.model.kv_scales import UNIT, checked
from services.worker.model.llama import LlamaModel
from services.worker.model.lora_columns import LoraColumns
from services.worker.model.norms import norms_for
from services.worker.model.quant_scheme import AT_LOAD, TOKEN_MODES
from services.worker.model.spec import ModelSpec, load_spec

log = logging.getLogger(__name__)
# --kv-cache-dtype's cache element types (auto: the checkpoint's, else the model dtype; model:
# the model dtype)
KV_DTYPES = {"fp8": torch.float8_e4m3fn}


@dataclass
class Built:
    engine: Engine
    pool: DevicePool
    spec: ModelSpec
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    masks: TokenMasks | None = None     # structured output's step side (the runners' TokenMasks)


def resolve_device(opt: str) -> str:
    """EngineOptions.device with "auto" made cuda when there is a GPU, else cpu."""
    if opt == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return opt


def resolve_quantization(opt: str, spec: ModelSpec) -> ModelSpec:
    """The spec with the weights' FP8 scheme (spec.quant): a published FP8 checkpoint's own in
    any mode, quantized at load (one scale per output channel) for any FP8 mode on a plain
    checkpoint, none otherwise. The activations: fp8 (fp8-dynamic) quantizes the linear inputs
    per token ("token", W8A8), fp8-weight-only does not ("bf16"), auto as the checkpoint
    declares (quant_scheme.read_scheme)."""
    quant = spec.quant
    if quant is None and opt != "auto":
        quant = AT_LOAD
    if quant is not None and opt != "auto":
        quant = dataclasses.replace(quant, activations="token" if opt in TOKEN_MODES else "bf16")
    return spec if quant is spec.quant else dataclasses.replace(spec, quant=quant)


def resolve_dtype(opt: str, spec: ModelSpec, device: torch.device) -> torch.dtype:
    if opt != "auto":
        return DTYPES[opt]
    if device.type == "cuda":
        return torch.bfloat16
    return torch.float32


def build_engine(model_dir: str | pathlib.Path, opts: EngineOptions, layers: int | None = None,
                 before_capture: Callable[[], None] | None = None) -> Built:
    """Load a checkpoint directory and assemble the engine around it (layers: its first layers
    only, for services.worker.startup.precompile; before_capture: called before the CUDA graphs are
    captured)."""
    start = time.monotonic()
    spec = resolve_quantization(opts.quantization, load_spec(model_dir))
    if layers is not None:
        spec = dataclasses.replace(spec, num_layers=layers)
    device = torch.device(resolve_device(opts.device))
    dtype = resolve_dtype(opts.dtype, spec, device)
    transforms.lora_forms(spec, opts.perf, device.type == "cuda")   # a conflict: before loading
    log.info("loading %s (%s, %d layers, hidden %d) as %s on %s%s", spec.name,
             spec.architecture, spec.num_layers, spec.hidden_size,
             str(dtype).replace("torch.", ""), device, _fp8_note(spec, device))
    weights = load_weights(model_dir, spec, dtype, device, first_layers=layers is not None)
    tok = Tokenizer.from_file(str(pathlib.Path(model_dir) / "tokenizer.json"))
    built = assemble(spec, weights, tok, opts, device, dtype, before_capture)
    log.info("engine ready in %.1fs", time.monotonic() - start)
    return built


def _fp8_note(spec: ModelSpec, device: torch.device) -> str:
    if spec.quant is None:
        return ""
    src = spec.quant.source
    how = "quantized at load" if src == "load" else f"{src} as published"
    if spec.quant.activations == "token":
        return (f", linear weights FP8 ({how}) and their inputs quantized to FP8 per token "
                f"(W8A8; LoRA in the model dtype)")
    gemm = ("; the FP8 GEMM kernel up to 256 rows, _scaled_mm or dequantize-then-GEMM above"
            if device.type == "cuda" else "; dequantize-then-GEMM")
    return f", linear weights FP8 ({how}; activations and LoRA in the model dtype{gemm})"


def kv_cache_form(opt: str, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                  found: list | None) -> tuple[torch.dtype, list[tuple[float, float]]]:
    """The KV cache's element type and each layer's (k_scale, v_scale). e4m3 for "fp8", and
    for "auto" where the checkpoint declares an FP8 KV cache (spec.kv_scales), with the
    checkpoint's scales (found: kv_scales.pop_kv_scales'), checked, else 1.0 (vLLM's default);
    otherwise ("model", or "auto" on a plain checkpoint) the model dtype, scales unused. A CUDA
    device before sm_89 has no e4m3 conversions: "fp8" is refused there, "auto" keeps the model
    dtype."""
    fp8 = opt == "fp8" or (opt == "auto" and spec.kv_scales)
    old_gpu = device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)
    if fp8 and old_gpu:
        if opt == "fp8":
            raise ValueError(f"--kv-cache-dtype fp8: {torch.cuda.get_device_name(device)} "
                             f"has no FP8 (e4m3) conversions (sm_89 or newer needed)")
        log.warning("the checkpoint declares an FP8 KV cache, but this GPU has no e4m3 "
                    "conversions (before sm_89): the KV cache is %s", dtype)
        fp8 = False
    if not fp8:
        if found is not None:
            log.info("the checkpoint's KV cache scales are unused: the KV cache is %s", dtype)
        return dtype, [UNIT] * spec.num_layers
    scales = checked(found, spec.num_layers, spec.kv_scales)
    if found is None:
        log.info("KV cache in FP8 (e4m3) with scale 1.0: the checkpoint has no KV scales")
    else:
        ks, vs = ([s[i] for s in scales] for i in (0, 1))
        log.info("KV cache in FP8 (e4m3) with the checkpoint's scales: k %.3g..%.3g, "
                 "v %.3g..%.3g", min(ks), max(ks), min(vs), max(vs))
    return KV_DTYPES["fp8"], scales


def assemble(spec: ModelSpec, weights: dict, tokenizer, opts: EngineOptions,
             device: torch.device, dtype: torch.dtype,
             before_capture: Callable[[], None] | None = None) -> Built:
    """Model, KV cache, scheduler, adapter pool and engine around already-loaded weights."""
    if device.type == "cuda":           # the kernels' process-wide launch choices
        from kernels import pdl, sgmv_split
        pdl.set_enabled(opts.perf.pdl)
        sgmv_split.set_overrides(opts.perf.sgmv_split)
    # one way: weights -> model; the pool -> its tables, which the step builder reads and
    # hands to the model with each step; the column blocks (extra rows of the q/k/v weights)
    # given to the model (its GEMMs) and to the pool (which writes them)
    kv_dtype, kv_scales = kv_cache_form(opts.kv_cache_dtype, spec, dtype, device,
                                        weights.pop("kv_scales", None))
    norm_fold = transforms.apply(weights, spec, device, opts.perf)
    n_cols, row_parts = transforms.lora_forms(spec, opts.perf, device.type == "cuda")
    columns = LoraColumns(weights, len(spec.slice_starts("qkv")) - 1, n_cols, device,
                          rows=row_parts > 0) if n_cols else None
    model = LlamaModel(spec, weights, device, dtype,
                       norms_for(norm_fold is not None, spec.rms_norm_eps), columns)
    model.split_attention = opts.perf.split_attention
    model.kv_scales = kv_scales
    model.row_parts = row_parts or model.row_parts
    pool = DevicePool(spec, device, dtype, opts.pool_bytes, opts.pool_slots,
                      columns=columns, norm_fold=norm_fold)
    max_len = min(opts.max_model_len or spec.max_position, spec.max_position)
    blocks = kv_blocks_for_budget(spec, opts.kv_cache_bytes, opts.block_size, kv_dtype)
    runner = ModelRunner(model, blocks, opts.block_size, opts.max_batch_tokens,
                         opts.max_running, max_len, lora=pool.tables, columns=columns,
                         kv_dtype=kv_dtype)
    masks = runner.masks = TokenMasks(spec.vocab_size, opts.max_running, device,
                                      mask_threads(opts.grammar_mask_threads, device))
    # dynamic NTK RoPE rotates a prompt's keys for the prompt's length: no sharing of them
    share = opts.share_prefixes and not any(model.dynamic)
    scheduler = Scheduler(BlockManager(blocks, opts.block_size, share),
                          opts.max_batch_tokens, opts.max_running, fair=opts.fair,
                          max_prefill_with_decode=opts.max_prefill_with_decode)
    if device.type == "cuda" and opts.cuda_graphs:
        from services.worker.executor.graph_runner import GraphRunner
        runner = GraphRunner(runner, mixed_tokens=opts.graph_mixed_tokens)
        if before_capture is not None:
            before_capture()
        runner.capture(opts.graph_max_rank)
    if opts.fault_inject_after_steps:
        from services.worker.executor.fault_inject import FaultyRunner
        runner = FaultyRunner(runner, opts.fault_inject_after_steps)
    engine = Engine(runner, scheduler, tokenizer, spec.eos_token_ids, max_len,
                    overlap=opts.overlap)
    return Built(engine, pool, spec, tokenizer, device, dtype, masks)
