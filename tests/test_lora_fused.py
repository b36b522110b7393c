"""The LoRA expands fused into the residual norm and into rope + KV write (kernels.lora_fused):
against the two launches they replace (split SGMV expand, then the plain op) and against fp32
references built from the dense adapter weights; and, in the engine, greedy tokens with the
fusion forced equal those without it.

Like tests/test_sgmv.py, the Triton checks run under TRITON_INTERPRET=1 in one child process
(`python tests/test_lora_fused.py CASE...`, one JSON line a case); the sm_90 compile checks
(registers, spills) run here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_sgmv import (TOL, build_case, compile_for_sm90, interpreter_unsupported,  # noqa: E402
                       lora_fp32, max_rel_err, _ptxas_usage)

# name: (op, dtype, K, heads (q, kv, head dim) or hidden, T, pattern, adapters, max rank,
#        extras, split config overrides). Ranks are mixed (1, 3, 8, 16) in every case with
# adapters; "gaps" = unaligned pool offsets (align 1; else 8), "pad" = padded segments.
CASES = {
    "norm_distinct_bf16": ("norm", "bf16", 64, 96, 9, "distinct", 9, 16, "", {}),
    "norm_zipf_fp16_kchunks": ("norm", "fp16", 96, 64, 20, "zipf", 5, 16, "gaps pad",
                               dict(k_chunk=32)),
    "norm_repeat_fp32_reduce": ("norm", "fp32", 64, 48, 20, "repeat", 3, 16, "",
                                dict(k_chunk=16, reduce=True)),
    "norm_base_only_bf16": ("norm", "bf16", 32, 64, 6, "base_only", 0, 16, "pad", {}),
    "rope_gqa_bf16_gaps": ("rope", "bf16", 64, (4, 2, 16), 7, "distinct", 7, 16, "gaps", {}),
    "rope_mha_fp16_kchunks": ("rope", "fp16", 64, (8, 8, 16), 12, "zipf", 4, 8, "pad",
                              dict(k_chunk=16)),
    "rope_gqa8_fp32_reduce": ("rope", "fp32", 48, (8, 2, 32), 10, "uniform", 3, 16, "",
                              dict(k_chunk=16, reduce=True)),
    "rope_single_bf16": ("rope", "bf16", 32, (4, 4, 8), 1, "single", 1, 16, "", {}),
    "rope_base_only_fp16": ("rope", "fp16", 32, (4, 2, 16), 5, "base_only", 0, 16, "", {}),
}
EPS = 1e-5


def _deferred_lora(c, overrides: dict, align: int):
    from kernels.lora_fused import DeferredLora
    from kernels.sgmv_split import pick_split_config, shrink
    import dataclasses
    t_rows, n_segs = c["x"].shape[0], c["seg_slot"].shape[0]
    cfg = dataclasses.replace(pick_split_config(t_rows, c["max_rank"], n_segs=n_segs),
                              **overrides)
    starts = c["slice_starts"]
    shrunk = shrink(c["x"], c["pool"], c["a_off"], c["ranks"], c["seg_start"], c["seg_slot"],
                    len(starts) - 1, c["max_rank"], cfg, align=align)
    return DeferredLora(shrunk, c["pool"], c["b_off"], c["ranks"], c["scales"], starts,
                        c["seg_start"], c["seg_slot"], c["max_rank"], align, cfg)


def _norm_case(c, spec, lora, g) -> dict:
    from kernels.fused import add_rms_norm
    from kernels.lora_fused import add_rms_norm_lora
    dtype = c["dtype"]
    t, hid = c["y"].shape
    dev = c["y"].device
    h = torch.randn(t, hid, generator=g).to(dev, dtype)
    w = (torch.rand(hid, generator=g) + 0.5).to(dev, dtype)
    d0 = c["y"].clone()
    h1 = h.clone()
    out1 = add_rms_norm_lora(h1, c["y"], w, EPS, lora, impl="triton")
    untouched = bool(torch.equal(c["y"], d0))
    h2, d2 = h.clone(), d0.clone()
    out2 = add_rms_norm(h2, lora.expand_into(d2), w, EPS, impl="triton")
    h_ref = h.float().cpu() + lora_fp32(dict(c, y=d0))
    out_ref = w.float().cpu() * h_ref * torch.rsqrt(h_ref.pow(2).mean(-1, keepdim=True) + EPS)
    return dict(err=max(max_rel_err(h1, h_ref), max_rel_err(out1, out_ref)),
                err_unfused=max(max_rel_err(h1, h2.float().cpu()),
                                max_rel_err(out1, out2.float().cpu())),
                bit_equal=bool(torch.equal(h1, h2) and torch.equal(out1, out2)),
                delta_untouched=untouched)


def _views(qkv, hq, hk, d):
    t = qkv.shape[0]
    return (qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hk) * d].view(t, hk, d),
            qkv[:, (hq + hk) * d:].view(t, hk, d))


def _nan_err(got, ref) -> float:
    """max_rel_err where both are written; inf when they differ in which entries are NaN
    (unwritten cache slots are NaN-poisoned)."""
    got, ref = got.float().cpu(), ref.float().cpu()
    if not torch.equal(got.isnan(), ref.isnan()):
        return float("inf")
    return max_rel_err(got.nan_to_num(0.0), ref.nan_to_num(0.0))


def _rope_case(c, spec, lora, g) -> dict:
    from kernels.attention_ref import write_kv_ref
    from kernels.fused import rope_ref, rope_write_kv_
    from kernels.lora_fused import qkv_rope_write_kv_
    hq, hk, d = spec[3]
    dtype, t, dev = c["dtype"], c["y"].shape[0], c["y"].device
    pos = torch.randint(0, 60, (t,), generator=g)
    slots = torch.randperm(16, generator=g)[:t]
    slots[t // 2] = -1                                       # a row without a KV slot
    cos = torch.randn(64, d // 2, generator=g).to(dtype)
    sin = torch.randn(64, d // 2, generator=g).to(dtype)

    def caches(dt, on=dev):
        kc = torch.full((4, 4, hk, d), float("nan"), dtype=dt, device=on)
        return kc, kc.clone()

    qkv1, (kc1, vc1) = c["y"].clone(), caches(dtype)
    on = dict(cos=cos.to(dev), sin=sin.to(dev), positions=pos.to(dev),
              slot_mapping=slots.to(dev))
    q1 = qkv_rope_write_kv_(qkv1, hq, hk, k_cache=kc1, v_cache=vc1, lora=lora, impl="triton",
                            **on)
    qkv2, (kc2, vc2) = c["y"].clone(), caches(dtype)
    lora.expand_into(qkv2)
    rope_write_kv_(*_views(qkv2, hq, hk, d), k_cache=kc2, v_cache=vc2, impl="triton", **on)
    qkv3, (kc3, vc3) = lora_fp32(c), caches(torch.float32, "cpu")
    q3, k3, v3 = _views(qkv3, hq, hk, d)
    rope_ref(q3, k3, cos.float(), sin.float(), pos)
    write_kv_ref(kc3, vc3, k3, v3, slots)
    return dict(err=max(max_rel_err(qkv1, qkv3), _nan_err(kc1.float(), kc3),
                        _nan_err(vc1.float(), vc3)),
                err_unfused=max(max_rel_err(qkv1, qkv2.float().cpu()), _nan_err(kc1, kc2),
                                _nan_err(vc1, vc2)),
                bit_equal=bool(torch.equal(qkv1, qkv2) and torch.equal(kc1.nan_to_num(7),
                               kc2.nan_to_num(7)) and torch.equal(vc1.nan_to_num(7),
                                                                  vc2.nan_to_num(7))),
                q_view=bool(q1.data_ptr() == qkv1.data_ptr() and q1.shape == (t, hq, d)))


def engine_case() -> dict:
    """The engine (tiny random Llama, fp32, CPU) on a mixed batch of rank 1-16 adapters and
    base-only requests, with both fusions forced and with both off: greedy tokens, and how many
    projections each run deferred."""
    import tempfile
    from services.worker import model as model_mod
    from services.worker.adapter_layout import layout_from_peft_dir
    from services.worker.factory import EngineOptions, build_engine
    from services.worker.sequence import Sequence, Stopping
    from tests.hf_fixtures import make_adapter, make_base
    from tests.test_engine_parity import run_all
    names = ("r1-attn", "r8-rslora", "r16-layers")
    calls = {"deferred": 0}
    plain = model_mod.LlamaModel._project

    def counting(self, *args, **kw):
        y, lora = plain(self, *args, **kw)
        calls["deferred"] += lora is not None
        return y, lora

    model_mod.LlamaModel._project = counting
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = make_base(root / "base")
        for i, name in enumerate(names):
            make_adapter(base, root / "adapters", name, seed=i + 1)
        for mode in ("0", "force"):
            os.environ["LORAFLEET_LORA_NORM"] = os.environ["LORAFLEET_LORA_ROPE"] = mode
            built = build_engine(root / "base", EngineOptions(
                device="cpu", dtype="float32", kv_cache_bytes=4 << 20, block_size=4,
                max_batch_tokens=64))
            slots = {n: built.pool.place(n, layout_from_peft_dir(root / "adapters" / n,
                                                                 built.spec, built.dtype))
                     for n in names}
            g = torch.Generator().manual_seed(3)
            seqs = [Sequence(f"r{i}", torch.randint(2, 256, (3 + 4 * i,), generator=g).tolist(),
                             slot=slots[n] if n else -1,
                             stopping=Stopping(max_new_tokens=6, ignore_eos=True))
                    for i, n in enumerate((*names, None, *names))]
            calls["deferred"] = 0
            tokens, _ = run_all(built.engine, seqs)
            out[mode] = (tokens, calls["deferred"])
    return dict(case="engine", same=out["0"][0] == out["force"][0],
                deferred_off=out["0"][1], deferred_forced=out["force"][1],
                tokens=sum(len(t) for t in out["force"][0].values()))


def run_case(name: str, device: str = "cpu") -> dict:
    if name == "engine":
        return engine_case()
    op, dt, k, shape, t, pattern, n, max_rank, extras, over = CASES[name]
    if op == "norm":
        widths = (shape,)
    else:
        hq, hk, d = shape
        widths = (hq * d, hk * d, hk * d)
    c = build_case((dt, k, widths, t, pattern, n, max_rank, extras), seed=len(name),
                   device=device)
    g = torch.Generator().manual_seed(len(name) + 1)
    lora = _deferred_lora(c, over, 1 if "gaps" in extras else 8)
    delta = float((lora_fp32(c) - c["y"].float().cpu()).abs().max())  # > 0 unless no LoRA
    r = (_norm_case if op == "norm" else _rope_case)(c, CASES[name], lora, g)
    tol = TOL[c["dtype"]]
    return dict(r, case=name, delta=delta, tol=tol,
                ok=r["err"] <= tol and r["err_unfused"] <= tol)


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, *CASES, "engine"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if rows and "skip" in rows[0]:
        pytest.skip(rows[0]["skip"])
    return {r["case"]: r for r in rows}


@pytest.mark.parametrize("name", list(CASES))
def test_fused_expand_matches_fp32_reference_and_the_two_launches(interpreted, name):
    r = interpreted[name]
    assert r["ok"], r
    assert (r["delta"] > 0.1) == (CASES[name][5] != "base_only"), r
    if CASES[name][0] == "norm":
        assert r["delta_untouched"], r
    else:
        assert r["q_view"], r


def test_engine_greedy_tokens_with_the_fusion_forced_equal_those_without(interpreted):
    """Forced on CPU (under the interpreter), every LoRA'd q/k/v, o and down projection of a
    step defers its expand into rope or the norm; the tokens are those of the plain path."""
    r = interpreted["engine"]
    assert r["deferred_off"] == 0 and r["deferred_forced"] > 0, r
    assert r["tokens"] == 7 * 6 and r["same"], r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_fused_expand_on_gpu(name):
    r = run_case(name, device="cuda")
    assert r["ok"], r
    assert (r["delta"] > 0.1) == (CASES[name][5] != "base_only"), r


if __name__ == "__main__":                                      # child: interpreted cases
    if (why := interpreter_unsupported()) is not None:
        print(json.dumps({"skip": why}))
        sys.exit(0)
    for case_name in sys.argv[1:]:
        print(json.dumps(run_case(case_name)), flush=True)


# kernel -> (argument types, constexprs, warps): the engine's launches for a 7B-shaped model
# (hidden 4096, 32 heads of 128, rank tile 16, 16 K chunks)
PTR_BF16, PTR_F32, PTR_I32, PTR_I64 = "*bf16", "*fp32", "*i32", "*i64"
COMMON = dict(RANK_BLOCK=16, SEG_BLOCK=64, BLOCK_M=16, KS_MAX=16, REDUCE=False, ALIGN=8)
SM90 = {
    "_lora_norm_kernel": ([PTR_BF16] * 4 + [PTR_F32] * 2 + [PTR_BF16, PTR_I64, PTR_I32, PTR_F32,
                                                           PTR_I32, PTR_I32] + ["i32"] * 9
                          + ["fp32"], dict(COMMON, BLOCK=4096), 16),
    "_lora_rope_kv_kernel": ([PTR_BF16] * 5 + [PTR_I64] * 2 + [PTR_F32] * 2
                             + [PTR_BF16, PTR_I64, PTR_I32, PTR_F32, PTR_I32, PTR_I32]
                             + ["i32"] * 8, dict(COMMON, HALF=64, CH=4), 2),
}


def sm90_kernel(name: str, use_pdl: bool = True):
    import kernels.lora_fused as lf
    types, consts, warps = SM90[name]
    return compile_for_sm90(getattr(lf, name), types, dict(consts, USE_PDL=use_pdl),
                            num_stages=1, num_warps=warps)


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("name", list(SM90))
def test_fused_kernels_compile_for_hopper_without_spills(name):
    """A row's Bt tile sits in registers: at rank tile 16 it must not spill (at 32 the norm's
    would, which is why the model defers rank tile 16 only)."""
    from test_sgmv import _ptxas_regs_spills
    kernel = sm90_kernel(name)
    regs, spills = _ptxas_regs_spills(kernel)
    assert regs <= 255 and spills == 0, (regs, spills)
    ptx = kernel.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    assert "griddepcontrol" not in sm90_kernel(name, use_pdl=False).asm["ptx"]
