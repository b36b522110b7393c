"""The decode step of the newer model families at full size on a GPU (issue 47): a Qwen3-8B-shaped
and a Gemma-3-12B-shaped checkpoint with random bf16 weights, built through the worker's own
config reader (load_spec of the published config.json's fields) and checkpoint fuser, the
worker's warm-up run first, then batch 64 (128-token prompts, 128 new tokens) with the base model
and with 32 distinct rank-16 q/k/v/o adapters. Each decode step is compared with its bytes floor:
the weights, the KV cache the step reads (its sliding layers at most their window) and the
adapters' A and B, over the card's measured copy bandwidth. Kernel compiles after the warm-up are
counted (the worker's "nothing compiles after SERVING").

    python -m bench.engine.families --out bench/results          # on an H100 / H200
    python -m bench.engine.families --quick --out /tmp/x          # tiny shapes, a smoke run

Writes families-<card>.{json,md}: {"header", "rows": [{"model", "batch", "distinct",
"decode_step_ms", "bytes_floor_ms", "ratio", "tokens_per_s", "compiles_after_warmup"}]}.
"""
from __future__ import annotations

import argparse
import gc
import json
import pathlib
import statistics
import sys
import tempfile

import torch

from bench.lib.header import base_header, card, card_slug
from bench.lib.model_configs import CONFIGS
from bench.lib.synthetic import TARGETS, NullTokenizer, adapter_tensors
from bench.lib.timing import copy_tbps
from services.worker.model.fp8 import Fp8Weight

FAMILIES = ("qwen3-8b", "gemma-3-12b")       # this module's default models
QUICK = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 32768,
         "bos_token_id": 1, "eos_token_id": 2}


def hf_tensors(spec, device, dtype, each=None) -> dict:
    """Random tensors under the checkpoint's Hugging Face names (std 0.02, norms near 1; Gemma's
    stored (1 + w) norms near 0), made on `device`; each(name, tensor), when given, converts
    every tensor as it is made (so a 70B FP8 build never holds its bf16 weights at once)."""
    g = torch.Generator(device=device).manual_seed(0)

    class Made(dict):
        def __setitem__(self, name, t):
            super().__setitem__(name, t if each is None else each(name, t))

    def rnd(*shape, std=0.02, mean=0.0):
        t = torch.empty(*shape, device=device, dtype=dtype)
        rows = max(1, (1 << 26) // (t[0].numel() if t.dim() > 1 else t.numel()))
        for part in t.split(rows):                 # 256 MiB of float32 at a time
            part.copy_(torch.randn(part.shape, generator=g, device=device,
                                   dtype=torch.float32) * std + mean)
        return t
    h, i, q, kv, d = (spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size,
                      spec.head_dim)
    norm = 0.0 if spec.gemma_norms else 1.0
    out = Made()
    out["model.embed_tokens.weight"] = rnd(spec.vocab_size, h)
    out["model.norm.weight"] = rnd(h, mean=norm)
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = rnd(spec.vocab_size, h)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if spec.gemma_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        for n in norms:
            out[f"{p}{n}.weight"] = rnd(h, mean=norm)
        for m, (k, n) in {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv),
                          "o_proj": (q, h)}.items():
            out[f"{p}self_attn.{m}.weight"] = rnd(n, k)
        for m, (k, n) in {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}.items():
            out[f"{p}mlp.{m}.weight"] = rnd(n, k)
        if spec.qk_norm:
            out[f"{p}self_attn.q_norm.weight"] = rnd(d, mean=norm)
            out[f"{p}self_attn.k_norm.weight"] = rnd(d, mean=norm)
    return dict(out)


def kv_read_bytes(spec, batch: int, context: int, itemsize: int) -> int:
    """The K and V bytes one decode step reads for `batch` rows of `context` tokens each (a
    sliding layer at most its window)."""
    total = 0
    for layer in range(spec.num_layers):
        window = spec.window(layer)
        tokens = min(context, window) if window else context
        total += 2 * batch * tokens * spec.kv_size * itemsize
    return total


def weight_nbytes(weights: dict) -> int:
    """Bytes of a checkpoint's tensors (an Fp8Weight: its values and scales)."""
    return sum(t.nbytes if isinstance(t, Fp8Weight) else t.numel() * t.element_size()
               for t in weights.values())


def run_model(name: str, cfg: dict, args, device, bw: float,
              quantization: str = "auto", kv_cache_dtype: str = "auto") -> list[dict]:
    """The model's rows, base then args.distinct adapters; quantization: the worker's
    --quantization (fp8, fp8-weight-only: its decoder linears quantized as the loader does);
    kv_cache_dtype: its --kv-cache-dtype (fp8: the KV read counts 1 byte an element)."""
    from kernels import compile_watch
    from services.worker.adapters.layout import staged_from_tensors
    from services.worker.config import EngineOptions
    from services.worker.model.checkpoint import fuse_layers
    from services.worker.model.spec import load_spec
    from services.worker.model.fp8 import convert
    from services.worker.startup.factory import assemble, resolve_quantization
    from services.worker.startup.warmup import Warmup
    from bench.engine.e2e import run_engine
    with tempfile.TemporaryDirectory() as tmp:
        (pathlib.Path(tmp) / "config.json").write_text(json.dumps(cfg))
        spec = load_spec(tmp)
    dtype = torch.bfloat16
    spec = resolve_quantization(quantization, spec)
    each = None
    if spec.quant is not None:                     # one tensor at a time, as the loader
        def each(key, t):
            return convert(key, t, spec.quant, dtype, device)
    raw = hf_tensors(spec, device, dtype, each)
    weight_bytes = weight_nbytes(raw)
    weights = fuse_layers(raw, spec)
    del raw
    opts = EngineOptions(device=device.type, dtype="bfloat16", kv_cache_bytes=args.kv_gib << 30,
                         block_size=16, max_batch_tokens=args.max_batch_tokens,
                         max_running=args.batch, pool_bytes=args.pool_gib << 30, pool_slots=48,
                         max_model_len=1024, graph_max_rank=16, kv_cache_dtype=kv_cache_dtype)
    built = assemble(spec, weights, NullTokenizer(), opts, device, dtype)
    print(f"{name}: {weight_bytes / 1e9:.1f} GB of weights; warm-up", flush=True)
    Warmup(built.engine, built.pool, built.spec, args.max_batch_tokens, max_rank=16,
           max_running=args.batch).run()
    late: list[str] = []
    watching = compile_watch.install(late.append)
    staged = [staged_from_tensors(adapter_tensors(spec, 16, i + 1, device=device, dtype=dtype),
                                  {"r": 16, "lora_alpha": 32}, spec) for i in range(args.distinct)]
    adapter_bytes = 16 * 2 * spec.num_layers * sum(sum(spec.in_out(m)) for m in TARGETS)
    slots = [built.pool.place(f"a{i}", s) for i, s in enumerate(staged)]
    rows = []
    for n in (0, args.distinct):
        use = slots[:n]
        run_engine(built, use, args.batch, args.prompt, 8, seed=99)          # warm
        r = run_engine(built, use, args.batch, args.prompt, args.new, seed=n)
        context = args.prompt + args.new // 2                               # a mean step's
        runner = getattr(built.engine.runner, "runner", built.engine.runner)  # (a GraphRunner's)
        kv_item = runner.kv_cache[0][0].element_size()   # as built: auto follows the checkpoint
        floor_bytes = (weight_bytes + kv_read_bytes(spec, args.batch, context, kv_item)
                       + n * adapter_bytes)
        floor_ms = 1e3 * floor_bytes / bw
        row = {"model": name, "dtype": "fp8" if spec.quant is not None else "bf16",
               "activations": spec.quant.activations if spec.quant is not None else "bf16",
               "kv_cache_dtype": kv_cache_dtype, "batch": args.batch, "distinct": n,
               "decode_step_ms": r["decode_step_ms"], "bytes_floor_ms": floor_ms,
               "ratio": r["decode_step_ms"] / floor_ms if r["decode_step_ms"] else None,
               "tokens_per_s": r["tokens_per_s"], "weight_gb": weight_bytes / 1e9,
               "compiles_after_warmup": len(late) if watching else None,
               "late_compiles": late[:5]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if getattr(args, "profile", False) and device.type == "cuda":
        form = "" if quantization == "auto" else f"-{quantization}"
        profile_steps(built, slots[:args.distinct], args,
                      name + form + ("-kv8" if kv_cache_dtype == "fp8" else ""))
    del built, weights, staged, slots
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def profile_steps(built, slots: list[int], args, name: str) -> None:
    """The GPU kernels of a short run's steps (graph replays included), by total time; the table
    goes to stdout and to <out>/profile-<name>.txt."""
    from bench.engine.e2e import run_engine
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        r = run_engine(built, slots, args.batch, args.prompt, 16, seed=7)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40,
                                      max_name_column_width=70)
    text = f"{name}: {r['steps']} steps (a prefill and {r['steps'] - 1} decode)\n{table}"
    print(text, flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile-{name}.txt").write_text(text)


def write(out: pathlib.Path, header: dict, rows: list[dict]) -> pathlib.Path:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"families-{header['card_slug']}"
    stem.with_suffix(".json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    lines = [f"# Model families at full size, {header['card']}, {header['date']}", "",
             f"Random bf16 weights, batch {rows[0]['batch']}, prompts of {header['prompt']} "
             f"tokens, {header['new']} new; rank-16 q/k/v/o adapters; the bytes floor is the "
             f"weights + the KV read (sliding layers at most their window) + the adapters over "
             f"{header['copy_tb_s']:.2f} TB/s. Target: <= 1.25x with 32 adapters, no compile "
             "after the warm-up.", "",
             "| model | adapters | decode step ms | bytes floor ms | step / floor | tok/s "
             "| compiles after warm-up |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['distinct'] or 'base'} | {r['decode_step_ms']:.2f} | "
                     f"{r['bytes_floor_ms']:.2f} | {r['ratio']:.2f} | {r['tokens_per_s']:.0f} "
                     f"| {r['compiles_after_warmup'] if r['compiles_after_warmup'] is not None else 'not watched'} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return stem


def settings(a) -> tuple[torch.device, float]:
    """The run's sizes on args a (--quick: tiny), its device and copy bandwidth (bytes/s)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    a.prompt, a.new = (16, 8) if a.quick else (128, 128)
    a.kv_gib, a.pool_gib = (1, 1) if a.quick else (16, 4)
    a.max_batch_tokens = 256 if a.quick else 2048
    if a.quick:
        a.batch, a.distinct = min(a.batch, 8), min(a.distinct, 4)
    bw = copy_tbps(device, 2.0, 25, 100) * 1e12 if device.type == "cuda" else 20e9
    return device, bw


def config(name: str, quick: bool) -> dict:
    return {**CONFIGS[name], **(QUICK if quick else {})}


def run_header(a, device: torch.device, bw: float) -> dict:
    c = card(device.type)
    return {**base_header(device.type, a.commit), "card": c,
            "card_slug": card_slug(c, device.type), "prompt": a.prompt, "new": a.new,
            "copy_tb_s": bw / 1e12, "quick": a.quick}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--models", default=",".join(FAMILIES), help="of " + ", ".join(CONFIGS))
    p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run, any device)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--distinct", type=int, default=32)
    p.add_argument("--commit", default=None)
    p.add_argument("--profile", action="store_true",
                   help="then the kernels of a short run with the adapters, by GPU time")
    a = p.parse_args(argv)
    device, bw = settings(a)
    rows = []
    for name in a.models.split(","):
        rows += run_model(name, config(name, a.quick), a, device, bw)
    stem = write(pathlib.Path(a.out), run_header(a, device, bw), rows)
    print(stem.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
