"""`--kv-cache-dtype fp8`: an e4m3 paged KV cache holding K / k_scale and V / v_scale (a layer's
scales: 1.0, or a checkpoint's calibrated ones). The Triton KV writes (write_kv, the fused rope
+ write) against kernels.attention_ref's bytes, and the Triton attention over an e4m3 cache
against the reference over the same cache, with scales 1.0 and others, under TRITON_INTERPRET=1
in one child process; the reference's rounding and scales; the flag; the KV blocks a budget
holds.
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

from kernels.attention_ref import (FP8, kv_stored, paged_attention_ref,  # noqa: E402
                                   write_kv_ref)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}

# around e4m3's rounding boundaries (ties to even, carries into the exponent: 31.9 -> 32, not
# 16 as the interpreter's own conversion gives), its subnormals, beyond +-448, signed zeros
EDGE = [0.0, -0.0, 448.0, 449.0, 464.0, 480.0, 500.0, -1.0e4, -449.0, 31.9, -31.9, 15.99,
        1.0625, 1.1875, -1.0625, 0.3, 1e-5, -1e-5, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10,
        2.0 ** -7 * 1.0625, 240.0, 232.0, 248.0, 416.0, 432.0, 0.0078125, 0.001953125, -2.75]


def _edge_rows(t: int, n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """[t, n]: the EDGE values then random ones of several scales (some beyond +-448)."""
    x = torch.randn(t * n, generator=gen) * torch.tensor([0.01, 1.0, 30.0, 300.0]).repeat(
        t * n // 4 + 1)[:t * n]
    x[:len(EDGE)] = torch.tensor(EDGE)
    return x.view(t, n).to(dtype)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.cpu().view(torch.uint8)


# a layer's (k_scale, v_scale) in the scaled cases: not powers of two, so x / scale rounds
KV_SCALE = (0.37, 5.3)


def check_write_kv() -> list[dict]:
    """write_kv_triton into e4m3 caches: the reference's bytes, for bf16, fp16 and fp32 rows,
    rows of the engine's qkv layout (strided), a padding slot; with scales 1.0, and KV_SCALE
    for bf16 ("scaled")."""
    from kernels.kv_write_triton import write_kv_triton
    out = []
    for name, dtype, kv_scale in [*((n, d, (1.0, 1.0)) for n, d in DTYPES.items()),
                                  ("scaled_bf16", torch.bfloat16, KV_SCALE)]:
        gen = torch.Generator().manual_seed(1)
        t, h_kv, d = 7, 2, 32
        qkv = _edge_rows(t, 3 * h_kv * d, dtype, gen)
        k, v = (qkv[:, i * h_kv * d:(i + 1) * h_kv * d].view(t, h_kv, d) for i in (1, 2))
        k[0, 0] = torch.tensor(EDGE + [0.5] * (d - len(EDGE))).to(dtype)
        slots = torch.tensor([3, 17, -1, 0, 31, 8, 22])
        caches = [torch.full((4, 8, h_kv, d), 0x55, dtype=torch.uint8).view(FP8)
                  for _ in range(4)]
        write_kv_ref(caches[0], caches[1], k, v, slots, kv_scale)
        write_kv_triton(caches[2], caches[3], k, v, slots, kv_scale)
        same = all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(caches[:2], caches[2:]))
        out.append({"case": f"write_kv_{name}", "ok": same})
    return out


def check_rope_write_kv() -> list[dict]:
    """rope_write_kv_ (one launch) into e4m3 caches: the rotated k (left in place in qkv) and v
    stored as write_kv_ref stores them; the rotation as rope_ref's. With folded norms (rms: v
    scaled on its way to the cache only), v's bytes as write_kv_ref stores scale_rows_ref(v)
    (its factor computed in fp32 both ways: within one e4m3 step, and the same bytes for
    nearly all)."""
    from kernels import fused
    out = []
    for name, dtype in [*DTYPES.items(), ("rms_bf16", torch.bfloat16),
                        ("scaled_bf16", torch.bfloat16)]:
        kv_scale = KV_SCALE if "scaled" in name else (1.0, 1.0)
        gen = torch.Generator().manual_seed(2)
        t, hq, hk, d = 5, 4, 2, 16
        qkv = _edge_rows(t, (hq + 2 * hk) * d, dtype, gen)
        pos = torch.tensor([0, 3, 9, 2, 30])
        slots = torch.tensor([5, -1, 0, 13, 7])
        cos = torch.randn(64, d // 2, generator=gen).to(dtype)
        sin = torch.randn(64, d // 2, generator=gen).to(dtype)
        x, ref = qkv.clone(), qkv.clone()
        q, k, v = (x[:, a * d:b * d].view(t, b - a, d)
                   for a, b in ((0, hq), (hq, hq + hk), (hq + hk, hq + 2 * hk)))
        kc, vc, rk, rv = (torch.zeros(4, 4, hk, d, dtype=FP8) for _ in range(4))
        rms = ((torch.randn(t, 40, generator=gen) * 3).to(dtype), 1e-5) if "rms" in name else None
        fused.rope_write_kv_(q, k, v, cos, sin, pos, kc, vc, slots, impl="triton", rms=rms,
                             kv_scale=kv_scale)
        v_in = v if rms is None else fused.scale_rows_ref(v, rms)
        write_kv_ref(rk, rv, k, v_in, slots, kv_scale)   # the bytes of the k it rotated, and v
        same = torch.equal(_bytes(kc), _bytes(rk)) and (
            torch.equal(_bytes(vc), _bytes(rv)) if rms is None else _one_step(vc, rv))
        rq, rkk = ref[:, :hq * d].view(t, hq, d), ref[:, hq * d:(hq + hk) * d].view(t, hk, d)
        if rms is not None:
            ref[:, :(hq + hk) * d] = fused.scale_rows_ref(ref[:, :(hq + hk) * d], rms)
        fused.rope_ref(rq, rkk, cos, sin, pos)
        close = torch.allclose(x.float(), ref.float(), rtol=2e-2, atol=1e-2 * 300)
        out.append({"case": f"rope_write_kv_{name}", "ok": same and close})
    return out


def _one_step(got: torch.Tensor, want: torch.Tensor) -> bool:
    """e4m3 values within one e4m3 step of each other, the bytes equal for 98% of them."""
    a, b = got.float(), want.float()
    step = torch.exp2(torch.floor(torch.log2(b.abs().clamp(min=2.0 ** -6))) - 3)
    equal = (_bytes(got) == _bytes(want)).float().mean()
    return bool(((a - b).abs() <= step).all()) and float(equal) >= 0.98


# name: (test_attention case, splits, window, split_kinds)
ATTN = {"decode_step_bf16": ("step_mha_bf16", None, 0, False),
        "decode_step_gqa4_fp16_split2": ("step_gqa4_fp16_bs4", 2, 0, False),
        "decode_one_block_bf16_split4": ("step_mha_bf16_one_block_tiles", 4, 0, False),
        "mixed_gqa2_bf16_kinds": ("mixed_gqa2_bf16", None, 0, True),
        "prefill_runs_bf16_window7": ("prefill_runs_bf16", 1, 7, False),
        "mixed_gqa3_fp32_window5": ("mixed_gqa3_fp32_d24", 1, 5, False),
        "decode_gqa8_fp16_split8": ("decode_gqa8_fp16", 8, 0, False)}
# the same cases over caches stored with KV_SCALE
ATTN_SCALED = ("decode_step_bf16", "decode_one_block_bf16_split4", "mixed_gqa2_bf16_kinds",
               "prefill_runs_bf16_window7")


SCALE = 40.0       # the cases' K and V times this: e4m3 steps of 8-16 near |values| ~ 100


def fp8_case(base: str, device: str = "cpu", kv_scale=(1.0, 1.0)) -> dict:
    """test_attention's case with its caches stored in e4m3 (K and V times SCALE, over
    kv_scale, the softmax scale over SCALE, so e4m3's rounding is coarse; clamping: the write
    cases)."""
    from test_attention import CASES, build_case
    c = build_case(CASES[base], seed=len(base), device=device)
    for name, s in (("k_cache", kv_scale[0]), ("v_cache", kv_scale[1])):
        c[name] = kv_stored(c[name].float() * SCALE, FP8, s)
    c["scale"] = c["scale"] / SCALE
    return c


def check_attention(name: str, device: str = "cpu", kv_scale=(1.0, 1.0)) -> dict:
    from test_attention import CASES, _args, max_err
    from kernels.attention_triton import paged_attention_triton
    base, splits, window, kinds = ATTN[name]
    spec = CASES[base]
    c = fp8_case(base, device, kv_scale)
    out = paged_attention_triton(*_args(c), rows_per_program=spec[5], block_n=spec[6],
                                 splits=splits, split_kinds=kinds, window=window,
                                 kv_scale=kv_scale)
    ref = paged_attention_ref(*_args(c), window=window, kv_scale=kv_scale)
    err, tol = max_err(out, ref.float().cpu()) / SCALE, TOL[c["dtype"]]   # relative to V's
    label = name if kv_scale == (1.0, 1.0) else f"{name}_scaled"
    return {"case": label, "err": err, "tol": tol, "ok": err <= tol}


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["case"]: r for r in map(json.loads, proc.stdout.splitlines())}


@pytest.mark.parametrize("name", [*(f"write_kv_{n}" for n in [*DTYPES, "scaled_bf16"]),
                                  *(f"rope_write_kv_{n}" for n in [*DTYPES, "rms_bf16",
                                                                   "scaled_bf16"]),
                                  *ATTN, *(f"{n}_scaled" for n in ATTN_SCALED)])
def test_interpreted_kernels_match_reference(interpreted, name):
    assert interpreted[name]["ok"], interpreted[name]


def test_reference_rounds_clamps_and_reads_back():
    """write_kv_ref into e4m3: clamped to +-448, rounded to nearest even (torch's
    conversion), signed zeros kept; paged_attention_ref reads it back exactly."""
    k = torch.tensor(EDGE[:16]).view(1, 4, 4)
    kc, vc = (torch.zeros(2, 2, 4, 4, dtype=FP8) for _ in range(2))
    write_kv_ref(kc, vc, k, k, torch.tensor([1]))
    got = kc.view(-1, 4, 4)[1].float().flatten()
    want = torch.tensor([0.0, -0.0, 448, 448, 448, 448, 448, -448, -448, 32, -32, 16,
                         1.0, 1.25, -1.0, 0.3125])
    assert torch.equal(got, want) and torch.signbit(got[1])
    q = torch.randn(1, 4, 4)
    out = paged_attention_ref(q, kc, vc, torch.tensor([[0]], dtype=torch.int32),
                              torch.tensor([0], dtype=torch.int32),
                              torch.tensor([1], dtype=torch.int32), 0.5, 2)
    ref = paged_attention_ref(q, kc.float(), vc.float(), torch.tensor([[0]], dtype=torch.int32),
                              torch.tensor([0], dtype=torch.int32),
                              torch.tensor([1], dtype=torch.int32), 0.5, 2)
    assert torch.equal(out, ref)


def test_scales_carry_values_past_e4m3s_range():
    """Keys and values of ~1,000 (past e4m3's 448): a cache with scale 1.0 clamps them and its
    attention is far off; with scales that bring them in range (a checkpoint's calibrated
    ones) it is within e4m3's rounding of the exact attention. A bf16 cache ignores scales."""
    gen = torch.Generator().manual_seed(3)
    t, h, d, bs = 6, 2, 16, 8
    k = torch.randn(t, h, d, generator=gen) * 600
    v = torch.randn(t, h, d, generator=gen) * 900
    q = torch.randn(t, h, d, generator=gen) / 600
    tables = torch.tensor([[0]], dtype=torch.int32)
    seq, pos = torch.zeros(t, dtype=torch.int32), torch.arange(t, dtype=torch.int32)
    slots = torch.arange(t)

    def attend(dtype, kv_scale):
        kc, vc = (torch.zeros(1, bs, h, d, dtype=dtype) for _ in range(2))
        write_kv_ref(kc, vc, k, v, slots, kv_scale)
        return paged_attention_ref(q, kc, vc, tables, seq, pos, 0.25, t, kv_scale=kv_scale)
    exact = attend(torch.float32, (1.0, 1.0))
    assert torch.equal(attend(torch.float32, (7.0, 9.0)), exact)
    fit = (float(k.abs().max()) / 448, float(v.abs().max()) / 448)
    clamped = (attend(FP8, (1.0, 1.0)) - exact).abs().max() / 900
    scaled = (attend(FP8, fit) - exact).abs().max() / 900
    assert scaled < 0.2 < clamped, (scaled, clamped)


def test_scales_must_be_positive_and_finite():
    from kernels.fp8_tiles import kv_scale_args
    assert kv_scale_args((0.5, 2)) == (0.5, 2.0)
    assert kv_scale_args((0.0, 1.0), torch.zeros(1, dtype=torch.bfloat16)) == (1.0, 1.0)
    for bad in ((0.0, 1.0), (1.0, -2.0), (float("inf"), 1.0), (1.0, float("nan"))):
        with pytest.raises(ValueError, match="KV scales"):
            kv_scale_args(bad)


def test_attention_checks_accept_e4m3_only():
    from kernels.attention_triton import _check
    from test_attention import CASES, _args, build_case
    c = fp8_case("step_mha_bf16")
    _check(*_args(c)[:6])
    with pytest.raises(TypeError):
        _check(*_args(dict(c, v_cache=c["v_cache"].to(torch.bfloat16)))[:6])
    with pytest.raises(TypeError):
        _check(*_args(dict(c, k_cache=c["k_cache"].to(torch.float16),
                           v_cache=c["v_cache"].to(torch.float16)))[:6])
    assert build_case(CASES["step_mha_bf16"])["k_cache"].dtype == torch.bfloat16


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_fp8_kernels_compile_for_hopper():
    """The e4m3-cache variants compile for sm_90 (attention, its split, the KV writes)."""
    from test_sgmv import compile_for_sm90
    from test_attention import ATTN_TYPES
    from kernels.attention_triton import _paged_attn_kernel
    from kernels.kv_write_triton import _write_kv_kernel
    types = ["*bf16", "*bf16", "*fp8e4nv", "*fp8e4nv"] + ATTN_TYPES[4:]
    consts = dict(GROUP=4, GROUP_PAD=4, ROWS=4, D=128, D_PAD=128, BLOCK_N=16,
                  DOT_PREC="tf32", UPCAST=False, ALIGNED=True, SPLITS=1, USE_PDL=True,
                  ROW_KIND=0, SOFTCAP=0.0, KV_FP8=True)
    for splits in (1, 4):
        assert compile_for_sm90(_paged_attn_kernel, types, dict(consts, SPLITS=splits),
                                num_warps=1).asm["cubin"]
    types = ["*fp8e4nv"] * 2 + ["*bf16"] * 2 + ["*i64"] + ["i32"] * 3 + ["fp32"] * 2
    assert compile_for_sm90(_write_kv_kernel, types,
                            dict(BLOCK=1024, USE_PDL=False, KV_FP8=True)).asm["cubin"]


if __name__ == "__main__":
    for row in [*check_write_kv(), *check_rope_write_kv(), *(check_attention(n) for n in ATTN),
                *(check_attention(n, kv_scale=KV_SCALE) for n in ATTN_SCALED)]:
        print(json.dumps(row))
