"""Programmatic dependent launch (kernels.pdl): when it is on; that every kernel launched with
it waits for its predecessor (compiled for sm_90 without a GPU); and, on a GPU, that chained
calls under PDL give bit for bit what plain launches give."""
from __future__ import annotations

import contextlib

import pytest
import torch

from kernels import pdl
from test_sgmv import compile_for_sm90

I32, BF16, I64, F32, E4M3 = "i32", "*bf16", "*i64", "*fp32", "*fp8e4nv"

# kernel -> (argument types, constexprs other than USE_PDL)
KERNELS = {
    "fused._rms_kernel": ([BF16] * 5 + [I32] * 4 + ["fp32"] + [BF16, BF16, I32],
                          dict(ADD=True, NORM_D=True, BLOCK=4096, QUANT=False, UPCAST=False)),
    # with `rows`: the output's e4m3 rows and scales too (kernels.fused_quant)
    "fused._rms_kernel_rows": ([BF16] * 5 + [I32] * 4 + ["fp32"] + [E4M3, F32, I32],
                               dict(ADD=True, NORM_D=True, BLOCK=4096, QUANT=True,
                                    UPCAST=False)),
    "fused._rope_kernel": ([BF16] * 3 + [I64] + [I32] * 3, dict(HALF=64, BLOCK_H=64)),
    "fused._rope_kv_kernel": ([BF16] * 6 + [I64] * 2 + [BF16] * 3 + [I32] * 7 + ["fp32"] * 4,
                              dict(HALF=64, BLOCK_H=128, BLOCK_V=4096, RMS=True,
                                   BLOCK_HID=4096, QK_NORM=True)),
    "fused._silu_mul_kernel": ([BF16] * 3 + [I32] * 5 + ["fp32"] + [BF16, BF16, I32],
                               dict(BLOCK=1024, RMS=True, BLOCK_HID=4096, ACT=0, QUANT=False,
                                    UPCAST=False)),
    "fused._silu_mul_kernel_rows": ([BF16] * 3 + [I32] * 5 + ["fp32"] + [E4M3, F32, I32],
                                    dict(BLOCK=16384, RMS=False, BLOCK_HID=1, ACT=1,
                                         QUANT=True, UPCAST=False)),
    "attention_triton._paged_attn_kernel": (
        [BF16] * 4 + ["*i32"] * 3 + [F32] * 2 + [I32] * 4 + ["fp32", I32, "fp32"] + [I32] * 11,
        dict(GROUP=4, GROUP_PAD=4, ROWS=16, D=128, D_PAD=128, BLOCK_N=64, DOT_PREC="tf32",
             UPCAST=False, ALIGNED=False, SPLITS=4, ROW_KIND=0, SOFTCAP=0.0)),
    "attention_triton._split_combine_kernel": (
        [BF16, F32, F32, "*i32"] + [I32] * 4, dict(SPLITS=4, D=128, D_PAD=128, ROW_KIND=0)),
    "kv_write_triton._write_kv_kernel": ([BF16] * 4 + [I64] + [I32] * 3 + ["fp32"] * 2,
                                         dict(BLOCK=1024)),
    "sgmv_split._shrink_kernel": (
        [BF16] * 2 + [I64, "*i32", "*i32", "*i32", F32, F32, "*i32"] + [I32] * 7,
        dict(N_SLICES=3, SEG_BLOCK=64, BLOCK_M=16, BLOCK_K=128, RANK_BLOCK=16,
             DOT_PREC="tf32", UPCAST=False, STAGES=3, RANK_SPLIT=1, REDUCE=False, KS_MAX=16,
             ALIGN=8)),
    "sgmv_split._expand_kernel": (
        [BF16] * 2 + [I64, "*i32", F32, "*i32", "*i32", F32, F32, "*i32"] + [I32] * 13,
        dict(N_SLICES=3, SEG_BLOCK=64, BLOCK_M=16, BLOCK_N=256, RANK_BLOCK=16,
             DOT_PREC="tf32", UPCAST=False, KS_MAX=16, REDUCE=False, ALIGN=8, COLS=False)),
    "sgmv_split._one_launch_kernel": (
        [BF16] * 3 + [I64] * 2 + ["*i32", F32, "*i32", "*i32", F32, "*i32"] + [I32] * 13,
        dict(N_SLICES=3, SEG_BLOCK=64, BLOCK_M=16, BLOCK_K=128, BLOCK_N=64, RANK_BLOCK=16,
             DOT_PREC="tf32", UPCAST=False, STAGES=3, KS_MAX=16, SPIN_LIMIT=1 << 22,
             ALIGN=8)),
    "sgmv_triton._sgmv_kernel": (
        [BF16] * 3 + [I64] * 2 + ["*i32", F32, "*i32", "*i32"] + [I32] * 11,
        dict(N_SLICES=3, SEG_BLOCK=256, BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, RANK_BLOCK=16,
             EVEN_K=True, ALIGN=8, DOT_PREC="tf32", UPCAST=False, STAGES=2, NARROW_N=32,
             NARROW_K=16)),
    # the FP8 GEMM in its three forms (W8A16 with W's bits moved into bf16; W8A8 with x
    # quantized in the kernel, or given as e4m3: e4m3 x e4m3 wgmma) and its row quantizer
    **{f"fp8_gemm._fp8_gemm_kernel{suffix}": (
        ["*fp8e4nv" if xq else BF16, "*fp8e4nv", F32, BF16, BF16, BF16, F32, "*i32", F32]
        + [I32] * 10,
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, SPLIT_K=2, GROUPED=False, EVEN_K=True,
             HAS_BIAS=True, HAS_RES=True, UPCAST=False, DOT_PREC="tf32", STAGES=4, A8=a8,
             W_BITS=0 if a8 or xq else 1, FOLD=1.0 if a8 or xq else 2.0 ** 120, XQ=xq))
       for suffix, a8, xq in (("", False, False), ("_a8", True, False), ("_xq", False, True))},
    "fp8_tiles._quantize_rows_kernel": ([BF16, "*fp8e4nv", F32] + [I32] * 3,
                                       dict(BLOCK=4096, UPCAST=False)),
}


def _kernel(name: str):
    module, attr = name.split(".")
    for variant in ("_a8", "_xq", "_rows"):                  # a variant's name: the same kernel
        attr = attr.removesuffix(variant)
    return getattr(__import__(f"kernels.{module}", fromlist=[attr]), attr)


# Kernels that read before their wait: the step's tables and adapter weights (written before
# the step), or the residual (the folded norms' factor: written two or more kernels back), never
# what the kernel just before may write (kernels.pdl's contract).
EARLY_READS = {"sgmv_split._shrink_kernel", "sgmv_split._expand_kernel",
               "sgmv_split._one_launch_kernel", "fused._rms_kernel", "fused._rms_kernel_rows",
               "fused._rope_kernel",
               "fused._rope_kv_kernel", "attention_triton._paged_attn_kernel",
               "attention_triton._split_combine_kernel", "fused._silu_mul_kernel",
               "sgmv_triton._sgmv_kernel", "fp8_gemm._fp8_gemm_kernel",
               "fp8_gemm._fp8_gemm_kernel_a8", "fp8_gemm._fp8_gemm_kernel_xq"}


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_waits_before_it_touches_the_predecessors_data(name):
    """With USE_PDL a program waits (griddepcontrol.wait) at its entry, before any global load
    or store, and releases its dependents after the wait; the EARLY_READS kernels wait inside
    their work loop (the PTX orders blocks by layout, not by flow, so for them only the
    presence of both is checked here: test_gpu runs them with and without PDL). Without
    USE_PDL neither instruction is there."""
    types, consts = KERNELS[name]
    ptx = compile_for_sm90(_kernel(name), types, dict(consts, USE_PDL=True),
                           num_stages=1).asm["ptx"]
    wait, release = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    assert wait >= 0 and release >= 0
    if name not in EARLY_READS:
        first = min(i for i in (ptx.find("ld.global"), ptx.find("cp.async"),
                                ptx.find("st.global"), ptx.find("atom.global")) if i >= 0)
        assert wait < release < first, (wait, release, first)
    plain = compile_for_sm90(_kernel(name), types, dict(consts, USE_PDL=False),
                             num_stages=1).asm["ptx"]
    assert "griddepcontrol" not in plain


def test_enabled_only_on_capable_cuda_devices(monkeypatch):
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_args(torch.device("cpu")) == {"USE_PDL": False, "launch_pdl": False}
    was = pdl._ON
    pdl.set_enabled(True)
    pdl._capable.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    try:
        dev = torch.device("cuda", 0)
        assert pdl.enabled(dev) and pdl.launch_args(dev) == {"USE_PDL": True, "launch_pdl": True}
        assert pdl.launch_args(dev, False) == {"USE_PDL": False, "launch_pdl": False}
        with pdl.disabled():
            assert not pdl.enabled(dev)
        assert pdl.enabled(dev)
        pdl._capable.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (8, 0))
        assert not pdl.enabled(dev)                       # Ampere: no griddepcontrol
    finally:
        pdl.set_enabled(was)
        pdl._capable.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_chained_sgmv_reads_what_the_previous_call_wrote():
    """Eight SGMV calls in one graph, each one's x the y that the call before it wrote (the
    engine's dependency: an expand's output feeds the next shrink). Under PDL each kernel starts
    before the last one ends and reads its tables early; it must still see finished inputs.
    The kernels are deterministic (no atomics in the sums), so a graph captured with PDL gives
    bit for bit what one captured without gives, every replay; and each call's output is its
    start plus the reference delta of the output before it."""
    from kernels import pdl as pdl_mod
    from kernels.sgmv import sgmv
    from kernels.sgmv_ref import sgmv_ref
    from test_sgmv import _args, build_case
    if not pdl_mod.enabled(torch.device("cuda")):
        pytest.skip("no programmatic dependent launch on this device")
    for spec in (("bf16", 256, (256,), 64, "distinct", 8, 16, ""),      # two launches
                 ("bf16", 256, (256,), 16, "zipf", 5, 64, "pad"),
                 ("bf16", 256, (256,), 64, "distinct", 8, 64, "")):     # one, grid barrier
        c = build_case(spec, device="cuda")
        bufs = [torch.randn_like(c["x"]) for _ in range(9)]
        start = [b.clone() for b in bufs]

        def chain():
            for i in range(8):
                sgmv(*_args(dict(c, x=bufs[i], y=bufs[i + 1])))

        graphs = {}
        for on in (True, False):
            with contextlib.nullcontext() if on else pdl_mod.disabled():
                chain()                                           # compile, allocate
                graphs[on] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs[on]):
                    chain()
        for rep in range(10):
            for s0 in start:
                s0.normal_()
            outs = {}
            for on, graph in graphs.items():
                for b, s0 in zip(bufs, start):
                    b.copy_(s0)
                graph.replay()
                outs[on] = [b.clone() for b in bufs]
            torch.cuda.synchronize()
            for i in range(1, 9):
                assert torch.equal(outs[True][i], outs[False][i]), (spec[3], spec[6], rep, i)
            for i in range(8):      # each call against the reference from its real input
                got = outs[True]
                args = _args(dict(c, y=start[i + 1].float(), x=got[i].float(),
                                  pool=c["pool"].float()))
                ref = sgmv_ref(*args)
                # normwise: the chain grows the values, so elementwise ratios meet
                # cancellation; reading x before the call before had written it is off by O(1)
                err = ((got[i + 1].float() - ref).abs().max() / ref.abs().max()).item()
                assert err < 1e-2, (spec[3], spec[6], rep, i, err)
