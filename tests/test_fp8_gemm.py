"""The FP8 GEMM (kernels/fp8_gemm.py; its W8A16 and W8A8 forms) and its row quantizer against
their torch references.

The Triton cases run the kernel under TRITON_INTERPRET=1, which must be set before triton is
imported, so they run in one child process (`python tests/test_fp8_gemm.py CASE...`) that prints
one JSON line per case; the parent parametrises over the case names. Small tiles make the K
loop, the splits and the row and column tiles run more than once. The `gpu` tests run the same
at the 7B shapes on CUDA, inside a CUDA graph, and check that the warm-up's row counts leave
nothing to compile.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels.fp8_gemm_config import (BUCKETS, DECODE_MAX_ROWS, Fp8GemmConfig,  # noqa: E402
                                     bucket, grid, neighbours, pick_config)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
C = Fp8GemmConfig
# name: (M, N, K, group (0: one scale a row), config (None: picked), dtype, extras)
# extras: "bias", "res" (residual, added in place: out is the residual)
CASES = {
    **{f"channel_m{m}_split{s}": (m, 100, 160, 0, C(16, 32, 32, s), "bf16", "")
       for m in (1, 3, 16, 65) for s in (1, 3)},
    "group32_m1_split2": (1, 48, 80, 32, C(16, 16, 32, 2), "bf16", ""),     # a partial group
    "group32_m65_split2": (65, 48, 80, 32, C(16, 16, 32, 2), "bf16", ""),
    "group64_tile32_m3": (3, 40, 192, 64, C(16, 16, 32, 3), "bf16", ""),    # groups of 2 tiles
    "group32_picked_m16": (16, 64, 128, 32, None, "bf16", ""),
    "residual_bias_m16_split3": (16, 100, 160, 0, C(16, 32, 32, 3), "bf16", "bias res"),
    "residual_bias_m65": (65, 64, 96, 0, C(32, 64, 32, 1), "bf16", "bias res"),
    "bias_group_m3": (3, 48, 96, 32, C(16, 16, 32, 2), "bf16", "bias"),
    "fp32_m3_split2": (3, 64, 128, 0, C(16, 32, 32, 2), "fp32", "bias"),
    "fp16_m16": (16, 64, 128, 0, C(16, 32, 64, 2), "fp16", ""),
    **{f"picked_m{m}": (m, 96, 256, 0, None, "bf16", "") for m in (1, 16, 65)},
    # act_fp8: x quantized per K tile in the kernel, e4m3 MMAs (the reference quantizes alike)
    **{f"a8_channel_m{m}_split{s}": (m, 100, 160, 0, C(16, 32, 32, s, act_fp8=True), "bf16", "")
       for m in (1, 3, 16, 65) for s in (1, 3)},
    "a8_group32_m65_split2": (65, 48, 80, 32, C(16, 16, 32, 2, act_fp8=True), "bf16", ""),
    "a8_residual_bias_m16": (16, 100, 160, 0, C(16, 32, 64, 1, act_fp8=True), "bf16",
                             "bias res"),
    "a8_fp16_m16_split2": (16, 64, 128, 0, C(16, 32, 64, 2, act_fp8=True), "fp16", ""),
    # W's tile through Triton's conversion instead of the bit moves (kernels.fp8_tiles)
    "cvt_channel_m16_split3": (16, 100, 160, 0, C(16, 32, 32, 3, w_bits=False), "bf16", ""),
    "cvt_group32_m3": (3, 48, 96, 32, C(16, 16, 32, 2, w_bits=False), "bf16", "bias"),
    # x given as e4m3 with its row scales (quantize_rows): e4m3 x e4m3 MMAs, bf16 out
    **{f"xq_channel_m{m}_split{sp}": (m, 100, 160, 0, C(16, 32, 32, sp), "xq", "")
       for m in (1, 16, 65) for sp in (1, 3)},
    "xq_group32_m16_split2": (16, 48, 80, 32, C(16, 16, 32, 2), "xq", "bias"),
    "xq_residual_bias_picked_m65": (65, 64, 96, 0, None, "xq", "bias res"),
    # every finite e4m3 byte in W (subnormals, both zeros, +-448), through both forms
    "allbytes_m3": (3, 64, 256, 0, C(16, 32, 64, 2), "bf16", "allbytes"),
    "allbytes_group64_m16": (16, 64, 256, 64, C(16, 32, 64, 1), "bf16", "allbytes"),
    "allbytes_cvt_m3": (3, 64, 256, 0, C(16, 32, 64, 2, w_bits=False), "bf16", "allbytes"),
}


def all_bytes(n: int, k: int) -> torch.Tensor:
    """[n, k] e4m3 holding every finite byte pattern (0x7F and 0xFF are NaN), rows shifted."""
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    idx = (torch.arange(n)[:, None] * 7 + torch.arange(k)[None, :]) % len(finite)
    return finite[idx].view(torch.float8_e4m3fn)


def make_weight(n: int, k: int, group: int, gen: torch.Generator, device="cpu"):
    """(q, scale, group) with scales over `group` columns (0: one a row, group = K), values
    spread over e4m3's range and scales over two decades."""
    g = group or k
    on = gen.device
    q = (torch.randn(n, k, generator=gen, device=on) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, -(-k // g), generator=gen, device=on).mul(0.01).add(1e-4)
    return q.to(device), scale.to(device), g


def operands(case: tuple, device="cpu", seed: int = 0) -> dict:
    m, n, k, group, cfg, dtype, extras = case
    gen = torch.Generator().manual_seed(seed)
    q, scale, g = make_weight(n, k, group, gen, device)
    dt = DTYPES["bf16" if dtype == "xq" else dtype]
    if "allbytes" in extras:
        q = all_bytes(n, k).to(device)
    args = dict(x=torch.randn(m, k, generator=gen).to(device, dt), q=q, scale=scale, group=g)
    if "bias" in extras:
        args["bias"] = torch.randn(n, generator=gen).to(device, dt)
    if "res" in extras:
        args["residual"] = torch.randn(m, n, generator=gen).to(device, dt)
    if dtype == "xq":                           # x as the row quantizer gives it
        from kernels.fp8_gemm_ref import quantize_rows_ref
        args["x"], args["x_scale"] = quantize_rows_ref(args["x"])
    return args


def assert_matches(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Within the output dtype's rounding (fp32: accumulation order) of the fp32 reference."""
    eps = {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[ref.dtype]
    scale = ref.float().abs().max().clamp(min=1.0)
    torch.testing.assert_close(got.float(), ref.float(), rtol=eps, atol=eps * scale, msg=what)


# the row quantizer (x -> e4m3 and a scale a row, fp8_prefill's): name -> (M, K)
QUANT_CASES = {"quant_rows_m3_k5000": (3, 5000), "quant_rows_m17_k96": (17, 96)}


def run_quant_case(name: str, device: str = "cpu") -> None:
    """The kernel's e4m3 bytes and scales equal the torch reference's: rows of every scale, a
    zero row, values that round up into the next binade (31.9 -> 32 at scale 1), and -0.0 and
    a negative value that rounds to it (byte 0x80, not 0x00)."""
    from kernels.fp8_tiles import quantize_rows
    from kernels.fp8_gemm_ref import quantize_rows_ref
    m, k = QUANT_CASES[name]
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m)[:, None]
    x[m // 2] = 0.0
    x[0, :6] = torch.tensor([448.0, 31.95, -127.9, 0.0137, -0.0, -1e-4])  # row 0's scale is 1
    x = x.to(device, torch.bfloat16)
    got, s = quantize_rows(x, impl="triton")
    want, s_ref = quantize_rows_ref(x)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    assert got[0, 4:6].view(torch.uint8).tolist() == [0x80, 0x80]
    assert not got[m // 2].float().any()


def run_case(name: str, device: str = "cpu") -> None:
    from kernels.fp8_gemm import arrival_counters, fp8_gemm
    from kernels.fp8_gemm_ref import fp8_gemm_ref
    if name in QUANT_CASES:
        return run_quant_case(name, device)
    case = CASES[name]
    args = operands(case, device)
    cfg = case[4]
    ref = fp8_gemm_ref(**args, config=cfg)
    if "residual" in args:                      # in place: out is the residual
        res = args["residual"].clone()
        got = fp8_gemm(**{**args, "residual": res}, config=cfg, out=res)
        assert got.data_ptr() == res.data_ptr()
    else:
        got = fp8_gemm(**args, config=cfg)
        again = fp8_gemm(**args, config=cfg)
        assert torch.equal(got, again), "two calls differ (split-K must be deterministic)"
    assert_matches(got, ref, name)
    assert int(arrival_counters(torch.device(device)).abs().sum()) == 0, "counters left set"


def _child_results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, *CASES, *QUANT_CASES], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            out[rec["case"]] = rec
    assert out, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def interpreted():
    return _child_results()


@pytest.mark.parametrize("name", [*CASES, *QUANT_CASES])
def test_kernel_matches_the_reference_under_the_interpreter(interpreted, name):
    rec = interpreted.get(name)
    assert rec is not None, f"{name}: no result from the child"
    assert rec["ok"], rec["error"]


@pytest.mark.parametrize("dtype,shift,fold", [(torch.bfloat16, 4, 2.0 ** 120),
                                              (torch.float16, 7, 2.0 ** 8)])
def test_w_bit_moves_give_every_e4m3_value_times_a_power_of_two(dtype, shift, fold):
    """The bit moves kernels.fp8_tiles' PTX makes (sign to bit 15, exponent and mantissa up
    by 4 for bf16, 7 for fp16), done here with torch's integer ops on every finite byte: the
    16-bit float read from them times FOLD is the e4m3 value exactly, subnormals included."""
    from kernels.fp8_tiles import FOLD, W_BF16, W_F16
    assert FOLD[W_BF16 if dtype == torch.bfloat16 else W_F16] == fold
    q = all_bytes(1, 254)[0]
    b = q.view(torch.uint8).to(torch.int32)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << shift)
    got = bits.to(torch.int16).view(dtype).double() * fold
    assert torch.equal(got, q.double())
    assert (q.double().abs() < 2.0 ** -6).sum() == 16    # 14 subnormals and the two zeros


def test_the_row_quantizers_reference_leaves_its_input_as_it_was():
    """quantize_rows_ref on an fp32 x (x.float() is x itself) must not divide x in place: the
    CPU path of W8A8 quantizes the input the LoRA then reads."""
    from kernels.fp8_gemm_ref import qdq_rows, quantize_rows_ref
    x = torch.randn(5, 40)
    before = x.clone()
    quantize_rows_ref(x)
    qdq_rows(x)
    assert torch.equal(x, before)


def test_act_fp8_quantizes_each_k_tile_of_a_row_with_its_own_scale():
    """The act_fp8 reference: each row's K tiles on e4m3's grid times their own scale (a tile
    of large values does not coarsen a tile of small ones), zeros kept, and the GEMM over it
    within e4m3's rounding (3 mantissa bits: a few percent) of the exact one."""
    from kernels.fp8_gemm_ref import fp8_gemm_ref, quantize_x_tiles
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=gen)
    x[:, 32:64] *= 1e-3                       # the middle tile of every row is small
    x[2] = 0.0
    xq = quantize_x_tiles(x.bfloat16(), 32)
    assert torch.equal(xq[2], torch.zeros(96))
    rel = ((xq - x.bfloat16().float()).abs() / x.bfloat16().float().abs().clamp(min=1e-30))
    assert rel[[0, 1, 3, 4]].max() <= 2 ** -4 + 1e-6          # half an e4m3 step at most
    q, scale, g = make_weight(40, 96, 0, gen)
    cfg = Fp8GemmConfig(16, 16, 32, act_fp8=True)
    got = fp8_gemm_ref(x.bfloat16(), q, scale, g, config=cfg).float()
    exact = fp8_gemm_ref(x.bfloat16(), q, scale, g).float()
    assert 1e-3 < float((got - exact).norm() / exact.norm()) < 0.04


# ---------------------------------------------------------------- configs (no kernel runs)
SHAPES = {  # the decoder GEMMs (N, K): docs/sizing.md's 7B, Llama-3-8B and 70B
    "7b": {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096),
           "down": (4096, 11008)},
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
           "down": (4096, 14336)},
    "70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192),
            "down": (8192, 28672)},
}


@pytest.mark.parametrize("group", [0, 128, 64])
def test_every_shape_and_bucket_gets_a_config_that_fits(group):
    for model in SHAPES.values():
        for n, k in model.values():
            for b in BUCKETS:
                cfg = pick_config(b, n, k, group)
                assert cfg.smem_bytes() <= 227 * 1024
                assert not group or group % cfg.block_k == 0
                k_tiles = -(-k // cfg.block_k)
                assert cfg.split_k == 1 or k_tiles // cfg.split_k >= 8, (n, k, b, cfg)
                # the split is the bucket's, whatever m of the bucket: one compile a bucket
                assert all(pick_config(m, n, k, group) == cfg
                           for m in range(b // 2 + 1 if b > 16 else 1, b + 1))


def test_the_warm_up_meets_every_bucket_and_single_rows():
    """Each bucket's kernel is compiled by the worker's warm-up (its eager prompt lengths),
    never first while serving: some warm-up row count falls in every bucket."""
    from services.worker.startup.warmup import token_counts
    counts = token_counts(DECODE_MAX_ROWS)
    assert {bucket(t) for t in counts if t <= DECODE_MAX_ROWS} == set(BUCKETS)
    assert 1 in counts and DECODE_MAX_ROWS + 1 in token_counts(2 * DECODE_MAX_ROWS)


def test_sweep_neighbours_are_distinct_and_valid():
    for b in BUCKETS:
        cfg = pick_config(b, 12288, 4096)
        near = neighbours(cfg)
        assert near[0] == cfg and len(set(near)) == len(near) >= 6
        assert all(c.smem_bytes() <= 227 * 1024 for c in near)


def test_the_sweep_grid_holds_the_pick_and_fits_shared_memory():
    """--grid: the picked config first, then distinct configs at its BLOCK_M over both tile
    widths, K tiles and every split, each fitting shared memory for its x (e4m3: more fit)."""
    cfg = pick_config(64, 4096, 11008)
    for x_bytes in (1, 2):
        g = grid(cfg, x_bytes)
        assert g[0] == cfg and len(set(g)) == len(g)
        assert all(c.block_m == cfg.block_m and c.smem_bytes(x_bytes) <= 227 * 1024 for c in g)
        assert {(c.block_n, c.block_k, c.split_k) for c in g[1:]} >= {
            (n, k, s) for n in (64, 128) for k in (128,) for s in (1, 2, 4, 8)}
    assert len(grid(cfg, 1)) > len(grid(cfg, 2))


def test_the_prefill_path_off_a_gpu_is_dequantize_then_gemm():
    from kernels.fp8_tiles import quantize_rows
    from kernels.fp8_linear import fp8_linear, prefill_path
    from kernels.fp8_gemm_ref import fp8_gemm_ref
    args = operands((300, 64, 128, 32, None, "bf16", "bias"))
    assert prefill_path(args["x"], args["q"], args["scale"]) == "dequant"
    assert_matches(fp8_linear(**args), fp8_gemm_ref(**args), "prefill")
    xq, s = quantize_rows(args["x"])
    assert xq.dtype == torch.float8_e4m3fn and s.shape == (300, 1)
    back = xq.float() * s
    assert float((back - args["x"].float()).abs().max()) <= float(s.max()) * 16


# ---------------------------------------------------------------- on CUDA
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_gpu_matches_the_reference_at_7b_shapes():
    """Per channel at every bucket's edges, group-128 scales, split-K forced off and on (both
    forms), W's tile through Triton's conversion, x given quantized (W8A8), every e4m3 byte in
    W, and the residual + bias epilogue, on the 7B's four GEMMs."""
    from kernels.fp8_gemm import fp8_gemm
    from kernels.fp8_gemm_ref import fp8_gemm_ref, quantize_rows_ref
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES["7b"].items():
        for group in (0, 128):
            q, scale, g = make_weight(n, k, group, gen, "cuda")        # made on the device
            for m in (1, 16, 17, 64, 65, 128, 256):
                x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
                args = dict(x=x, q=q, scale=scale, group=g)
                ref = fp8_gemm_ref(**args)
                assert_matches(fp8_gemm(**args), ref, f"{name} m{m} g{group}")
                cfg = pick_config(m, n, k, group)
                a8 = replace(cfg, act_fp8=True)
                assert_matches(fp8_gemm(**args, config=a8), fp8_gemm_ref(**args, config=a8),
                               f"{name} m{m} g{group} act_fp8")
                cvt = replace(cfg, w_bits=False)         # Triton's e4m3 conversion
                assert_matches(fp8_gemm(**args, config=cvt), ref, f"{name} m{m} g{group} cvt")
                xq, sx = quantize_rows_ref(x)               # W8A8: x given as e4m3
                assert_matches(fp8_gemm(xq, q, scale, g, x_scale=sx),
                               fp8_gemm_ref(xq, q, scale, g, x_scale=sx),
                               f"{name} m{m} g{group} xq")
                for split in {1, 4} - {cfg.split_k}:
                    forced = Fp8GemmConfig(cfg.block_m, cfg.block_n, cfg.block_k, split,
                                           cfg.num_warps, cfg.num_stages)
                    assert_matches(fp8_gemm(**args, config=forced), ref,
                                   f"{name} m{m} g{group} split {split}")
                    # the xq sweep on an H100 saw down (K 11008) at M 64 split 1 differ
                    assert_matches(fp8_gemm(xq, q, scale, g, x_scale=sx, config=forced),
                                   fp8_gemm_ref(xq, q, scale, g, x_scale=sx),
                                   f"{name} m{m} g{group} xq split {split}")
        for dtype in ("fp16", "bf16"):                          # every byte, both forms
            args = operands((64, n, k, 0, None, dtype, "allbytes"), "cuda")
            ref = fp8_gemm_ref(**args)
            cfg = pick_config(64, n, k)
            for c in (cfg, replace(cfg, w_bits=False)):
                assert_matches(fp8_gemm(**args, config=c), ref, f"{name} all bytes {dtype} {c}")
        args = operands((16, n, k, 0, None, "bf16", "bias res"), "cuda")
        ref = fp8_gemm_ref(**args)
        res = args.pop("residual")
        assert_matches(fp8_gemm(**args, residual=res, out=res), ref, f"{name} residual")


@pytest.mark.gpu
@needs_cuda
def test_gpu_row_quantizer_equals_the_torch_reference():
    for name in QUANT_CASES:
        run_quant_case(name, "cuda")


@pytest.mark.gpu
@needs_cuda
def test_gpu_graph_replay_and_prefill():
    """A split-K call captured in a CUDA graph replays the eager result bit for bit on new
    inputs; above DECODE_MAX_ROWS fp8_linear takes the prefill path (activations quantized per
    row where _scaled_mm serves: within a few percent)."""
    from kernels.fp8_gemm import fp8_gemm
    from kernels.fp8_linear import fp8_linear, prefill_path
    from kernels.fp8_gemm_ref import fp8_gemm_ref
    args = operands((16, 12288, 4096, 0, None, "bf16", ""), "cuda")
    assert pick_config(16, 12288, 4096).split_k > 1
    x = args.pop("x")
    fp8_gemm(x, **args)                              # the counters, before the capture
    torch.cuda.synchronize()
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        out = fp8_gemm(x, **args)
    for seed in (1, 2):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, fp8_gemm(x, **args))
    big = operands((300, 4096, 4096, 0, None, "bf16", "bias"), "cuda")
    ref = fp8_gemm_ref(**big)
    rel = (fp8_linear(**big).float() - ref.float()).norm() / ref.float().norm()
    assert rel < (0.05 if prefill_path(big["x"], big["q"], big["scale"]) == "scaled_mm"
                  else 0.01), rel


@pytest.mark.gpu
@needs_cuda
def test_gpu_the_warm_up_row_counts_leave_nothing_to_compile():
    """After the row counts the worker's warm-up runs, every M from 1 to DECODE_MAX_ROWS (and
    the prefill side) reuses a compiled kernel."""
    from triton import knobs
    from kernels import compile_watch
    from kernels.fp8_linear import fp8_linear
    from services.worker.startup.warmup import token_counts
    args = operands((1, 4096, 4096, 0, None, "bf16", ""), "cuda")
    x_all = torch.randn(DECODE_MAX_ROWS + 8, 4096, device="cuda", dtype=torch.bfloat16)
    for t in token_counts(DECODE_MAX_ROWS + 8):
        fp8_linear(x_all[:t], args["q"], args["scale"], args["group"])
    new: list[str] = []
    before = knobs.runtime.jit_cache_hook
    try:
        assert compile_watch.install(new.append)
        for t in range(1, DECODE_MAX_ROWS + 8):
            fp8_linear(x_all[:t], args["q"], args["scale"], args["group"])
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook = before
    assert not new, new


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["fp8-weight-only", "fp8"])
def test_gpu_fp8_engine_matches_the_cpu_and_its_graphs_match_eager(mode):
    """The tiny model quantized to FP8 at load (fp8: its linear inputs per token too, W8A8):
    on CUDA in fp32 (the kernel, its fp32 dot in IEEE precision; W8A8 e4m3 x e4m3) the CPU's
    greedy tokens (dequantize-then-GEMM); in bf16 the decode graphs give the eager steps'
    tokens (the kernel is deterministic, split-K included).

    W8A16: every sequence's tokens equal the CPU's. W8A8 rounds each input to e4m3 (steps of
    1/16 of a binade), so an fp32 difference of one ulp between the devices' activations
    (other summation orders) can move an element across a rounding boundary: that changes a
    logit by far more than fp32 rounding does, and a near-tie among the tiny model's logits
    can then go the other way. So under W8A8 each sequence must agree over its first 4 tokens
    and 10 of 12 whole (the H100: 10 whole, the other two diverging after 6 or more)."""
    from tests.test_gpu import greedy_tokens
    gpu = greedy_tokens("cuda", "float32", quantization=mode)
    cpu = greedy_tokens("cpu", "float32", quantization=mode)
    if mode == "fp8-weight-only":
        assert gpu == cpu
    else:
        assert all(gpu[r][:4] == cpu[r][:4] for r in cpu), (gpu, cpu)
        assert sum(gpu[r] == cpu[r] for r in cpu) >= 10, (gpu, cpu)
    assert (greedy_tokens("cuda", "bfloat16", graphs=False, quantization=mode)
            == greedy_tokens("cuda", "bfloat16", graphs=True, quantization=mode))


if __name__ == "__main__":           # the child: TRITON_INTERPRET=1 set by the parent
    for case_name in sys.argv[1:]:
        try:
            run_case(case_name)
            print(json.dumps({"case": case_name, "ok": True, "error": ""}), flush=True)
        except Exception as e:  # noqa: BLE001 - reported to the parent, case by case
            print(json.dumps({"case": case_name, "ok": False, "error": repr(e)[:2000]}),
                  flush=True)


def test_scaled_mm_with_its_operands_swapped_gives_the_same_rows():
    """kernels.fp8_linear.scaled_mm_rows: W @ x.T transposed back (few rows, a multiple of 16)
    equals x @ W.T, row-major; rows not a multiple of 16 take the plain form (on this CPU's
    torch._scaled_mm, where it has one)."""
    from kernels.fp8_linear import scaled_mm_rows
    from kernels.fp8_gemm_ref import quantize_rows_ref
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(96, 128, generator=gen)
    q, scale = quantize_rows_ref(w)
    for m in (16, 48, 20):
        xq, xs = quantize_rows_ref(torch.randn(m, 128, generator=gen))
        try:
            plain = scaled_mm_rows(xq, xs, q, scale, torch.bfloat16, swap_max_rows=0)
        except (RuntimeError, NotImplementedError):
            pytest.skip("no torch._scaled_mm on this device")
        swapped = scaled_mm_rows(xq, xs, q, scale, torch.bfloat16, swap_max_rows=64)
        assert swapped.is_contiguous() and swapped.shape == (m, 96)
        assert torch.equal(swapped, plain)
        ref = (xq.float() * xs) @ (q.float() * scale).T
        torch.testing.assert_close(plain.float(), ref, atol=0.1, rtol=1e-2)
