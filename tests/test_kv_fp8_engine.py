"""`--kv-cache-dtype fp8` in the engine: the tiny Llama on CPU with an e4m3 KV cache against
transformers + PEFT whose keys (after RoPE) and values are rounded through e4m3 the same way
(clamped to +-448, scale 1.0), in one mixed-adapter batch; the blocks a budget holds; the flag.
The GPU half (graphs against eager, no compile after the warm-up): tests/test_gpu.py."""
from __future__ import annotations

import contextlib

import pytest
import torch

from services.worker.config import EngineOptions, parse_args
from services.worker.engine.scheduler import Scheduled
from services.worker.engine.sequence import Sequence
from services.worker.executor.model_runner import kv_blocks_for_budget
from services.worker.perf_config import PerfConfig
from services.worker.startup.factory import build_engine
from tests.hf_fixtures import ADAPTER_SPECS
from tests.test_engine_parity import mixed_requests, run_all

FP8 = torch.float8_e4m3fn


def e4m3(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x as an e4m3 cache with this scale holds it (x / scale, clamped, rounded), read back
    times the scale in x's dtype."""
    return ((x.float() / scale).clamp(-448.0, 448.0).to(FP8).float() * scale).to(x.dtype)


@contextlib.contextmanager
def rounded_kv(models, scales=None):
    """transformers' Llama with its keys rounded through e4m3 after RoPE and its values after
    v_proj (its LoRA included), before its cache sees them: what the engine stores. scales:
    each layer's (k_scale, v_scale) (default 1.0)."""
    from transformers.models.llama import modeling_llama as ml
    real, layer = ml.apply_rotary_pos_emb, [0]

    def rope(q, k, *a, **kw):
        q, k = real(q, k, *a, **kw)
        return q, e4m3(k, scales[layer[0]][0] if scales else 1.0)

    def enter(i):
        def hook(module, args):
            layer[0] = i                    # the layer whose attention runs now
        return hook
    hooks = []
    for model in models:
        for i, block in enumerate(_layers(model)):
            v_scale = scales[i][1] if scales else 1.0
            hooks.append(block.self_attn.register_forward_pre_hook(enter(i)))
            hooks.append(block.self_attn.v_proj.register_forward_hook(
                lambda m, inp, out, s=v_scale: e4m3(out, s)))
    ml.apply_rotary_pos_emb = rope
    try:
        yield
    finally:
        ml.apply_rotary_pos_emb = real
        for h in hooks:
            h.remove()


def _layers(model):
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model.layers


def _engine(root, kv_cache_dtype: str, kv: int = 4 << 20):
    from services.worker.adapters.layout import staged_from_peft_dir
    opts = EngineOptions(device="cpu", dtype="float32", kv_cache_bytes=kv, block_size=4,
                         max_batch_tokens=64, kv_cache_dtype=kv_cache_dtype, perf=PerfConfig())
    built = build_engine(root / "base", opts)
    slots = {n: built.pool.place(n, staged_from_peft_dir(root / "adapters" / n, built.spec))
             for n in ADAPTER_SPECS}
    return built, slots


def test_fp8_cache_greedy_tokens_match_rounded_reference(hf_ckpt):
    """Every adapter and base rows in one batch: the fp8-cache engine's greedy tokens are those
    of PEFT with K and V rounded through e4m3 (and, for some requests, not those of plain
    PEFT: the rounding matters on this model)."""
    root, base, peft_models = hf_ckpt
    built, slots = _engine(root, "fp8")
    assert all(k.dtype == FP8 and v.dtype == FP8 for k, v in built.engine.runner.kv_cache)
    names = [*ADAPTER_SPECS, None, *ADAPTER_SPECS]
    with rounded_kv([base, *peft_models.values()]):
        seqs, expected = mixed_requests(names, slots, hf_ckpt, torch.Generator().manual_seed(7),
                                        prompt=(3, 5), new=8)
    got, _ = run_all(built.engine, seqs)
    assert got == expected
    _, plain = mixed_requests(names, slots, hf_ckpt, torch.Generator().manual_seed(7),
                              prompt=(3, 5), new=8)
    assert plain != expected


def _prefill_logits(built, slots, prompts):
    runner = built.engine.runner
    seqs = [Sequence(n, p, slot=slots[n]) for n, p in prompts.items()]
    for s in seqs:
        assert built.engine.scheduler.blocks.ensure(s, len(s.tokens))
    inputs = runner.steps.eager([Scheduled(s, len(s.tokens)) for s in seqs], runner.buffers)
    logits = runner.model.forward(inputs.input_ids, inputs.ctx, runner.kv_cache)
    return {e.seq.request_id: logits[row] for row, e in enumerate(inputs.sampled)}


def test_fp8_cache_prefill_logits_match_rounded_reference(hf_ckpt):
    """Prompt logits: to 1e-4 of the rounded reference, and measurably off the unrounded one
    (and the fp32-cache engine), so the rounding is really on the read path."""
    root, base, peft_models = hf_ckpt
    prompts = {n: list(range(5 + i, 17 + 2 * i)) for i, n in enumerate(ADAPTER_SPECS)}
    got = _prefill_logits(*_engine(root, "fp8"), prompts)
    plain = _prefill_logits(*_engine(root, "auto"), prompts)
    worst = 0.0
    for name, ids in prompts.items():
        with torch.no_grad():
            exact = peft_models[name](torch.tensor([ids])).logits[0, -1]
            with rounded_kv([peft_models[name]]):
                ref = peft_models[name](torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(got[name], ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(plain[name], exact, atol=1e-4, rtol=1e-4)
        worst = max(worst, float((got[name] - plain[name]).abs().max()))
    assert worst > 1e-3, worst


def test_fp8_cache_holds_twice_the_blocks(hf_ckpt):
    """A budget holds twice the bf16 blocks (four times the fp32 ones) in e4m3, and the engine
    (its cache and its block manager) gets them."""
    root = hf_ckpt[0]
    fp8, _ = _engine(root, "fp8", kv=1 << 20)
    fp32, _ = _engine(root, "auto", kv=1 << 20)
    spec = fp8.spec
    bf16 = kv_blocks_for_budget(spec, 1 << 20, 4, torch.bfloat16)
    assert kv_blocks_for_budget(spec, 1 << 20, 4, FP8) == 2 * bf16
    n8, n32 = (b.engine.runner.kv_cache[0][0].shape[0] for b in (fp8, fp32))
    assert n8 == 4 * n32 == kv_blocks_for_budget(spec, 1 << 20, 4, FP8)
    assert fp8.engine.scheduler.blocks.num_blocks == n8


def test_kv_cache_dtype_flag_is_validated_and_reaches_the_engine(capsys):
    assert parse_args([]).engine.kv_cache_dtype == "auto"
    assert parse_args(["--kv-cache-dtype", "fp8"]).engine.kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-dtype", "fp16"])
    assert "--kv-cache-dtype" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        EngineOptions(kv_cache_dtype="e5m2")
