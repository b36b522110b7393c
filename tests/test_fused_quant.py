"""The e4m3 rows the fused kernels write beside their output (kernels.fused_quant: `rows` on
rms_norm, add_rms_norm and silu_mul / gate_mul) for a W8A8 GEMM after them, and the model's
use of them (services.worker.model.fp8: input_rows, Quantized, qlinear).

Under the Triton interpreter (a child process: TRITON_INTERPRET must be set before triton
loads, as in tests/test_fused.py) each kernel with rows gives the same output as without, bit
for bit, and rows whose bytes and scales are quantize_rows_ref's of that output: rows of every
scale (1e-4 to 1e3), a zero row (whose outputs are -0.0 where a norm weight is negative: byte
0x80), values that round up into the next binade, masked lanes (96 and 80 columns of 128), the
SiLU and GELU-tanh gates, and the gate's two-launch form for rows too wide for a program. On
CPU the fp8-dynamic model makes no rows (its path is as before); with rows forced on (the torch
path of each producer) its logits are the same bit for bit, so the model hands the Quantized
input to the GEMM and the plain one to the LoRA and lm_head. The `gpu` tests check the fused
path against the unfused one (the row quantizer's own launch) bit for bit on CUDA: the kernels
at Llama 8B / 70B widths, inside a CUDA graph, and the fp8-dynamic engine's logits and greedy
tokens.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
E4M3 = torch.float8_e4m3fn


def varied(t: int, k: int, gen: torch.Generator, dtype, device, top: float = 3.0) -> torch.Tensor:
    """[t, k] normal values, row r scaled by 10^(-4 + (top + 4) r / (t - 1)); row t // 2
    zeros."""
    x = torch.randn(t, k, generator=gen) * torch.logspace(-4, top, t)[:, None]
    x[t // 2] = 0.0
    return x.to(device, dtype)


def assert_rows(out: torch.Tensor, rows: tuple, what: str) -> dict:
    """rows == quantize_rows_ref(out), bytes and scales; returns counts of the cases met:
    -0.0 bytes, and values rounded up to a power of two from below it (the next binade)."""
    from kernels.fp8_gemm_ref import quantize_rows_ref
    want_q, want_s = quantize_rows_ref(out)
    assert rows[0].dtype == E4M3 and rows[1].dtype == torch.float32, what
    assert torch.equal(rows[1], want_s), f"{what}: scales"
    assert torch.equal(rows[0].view(torch.uint8), want_q.view(torch.uint8)), f"{what}: bytes"
    got = rows[0].float().abs()
    ratio = out.float().abs() / want_s
    pow2 = (got > 0) & (torch.frexp(got).mantissa == 0.5)
    return {"neg_zero": int((rows[0].view(torch.uint8) == 0x80).sum()),
            "next_binade": int((pow2 & (ratio < got)).sum())}


def _both(fn, t: int, k: int, device, what: str, seen: dict):
    """fn(rows) without rows and with them: the same output, rows as quantize_rows_ref's."""
    from kernels.fused_quant import new_rows
    plain = fn(None)
    rows = new_rows(t, k, torch.device(device))
    got = fn(rows)
    assert torch.equal(got, plain), f"{what}: the output changed"
    for key, n in assert_rows(got, rows, what).items():
        seen[key] = seen.get(key, 0) + n


def check_norms(gen, device, dtype, impl, seen) -> None:
    from kernels import fused
    for hid in (96, 128):
        t = 9
        x = varied(t, hid, gen, dtype, device)
        w = (torch.randn(hid, generator=gen) * 2).to(device, dtype)       # both signs
        _both(lambda rows: fused.rms_norm(x, w, 1e-5, impl=impl, rows=rows), t, hid, device,
              f"rms_norm {dtype} {hid} {impl}", seen)
        delta = varied(t, hid, gen, dtype, device).flip(0)
        dw = (1 + 0.1 * torch.randn(hid, generator=gen)).to(device, dtype)
        for dn in (None, dw):
            hs = []

            def add(rows, dn=dn):
                h = x.clone()
                out = fused.add_rms_norm(h, delta, w, 1e-5, impl=impl, delta_norm=dn, rows=rows)
                hs.append(h)
                return out
            _both(add, t, hid, device, f"add_rms_norm {dtype} {hid} {impl} {dn is not None}",
                  seen)
            assert torch.equal(hs[0], hs[1]), "the residual changed"


def check_gate(gen, device, dtype, impl, seen) -> None:
    from kernels import fused, fused_quant
    for act in ("silu", "gelu_pytorch_tanh"):
        for inter in (80, 128):
            t = 9
            # fp16: products kept finite (an inf row's bytes are NaN's either way, not compared)
            gu = varied(t, 2 * inter, gen, dtype, device, 1.5 if dtype == torch.float16 else 3)
            _both(lambda rows: fused.gate_mul(gu, act, impl=impl, rows=rows), t, inter, device,
                  f"gate_mul {act} {dtype} {inter} {impl}", seen)
    was = fused_quant.SILU_ROWS_LAUNCH["max_block"]
    fused_quant.SILU_ROWS_LAUNCH["max_block"] = 64        # 80 columns: silu_mul + quantize_rows
    try:
        gu = varied(5, 160, gen, dtype, device, 1.5)
        assert fused_quant.silu_rows_launch(80)[0] is None
        _both(lambda rows: fused.silu_mul(gu, impl=impl, rows=rows), 5, 80, device,
              f"silu_mul too wide {dtype} {impl}", seen)
    finally:
        fused_quant.SILU_ROWS_LAUNCH["max_block"] = was


def check(device: str = "cpu") -> dict:
    gen = torch.Generator().manual_seed(0)
    seen: dict = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for impl in ("triton", "torch"):
            check_norms(gen, device, dtype, impl, seen)
            check_gate(gen, device, dtype, impl, seen)
    assert seen["neg_zero"] > 0 and seen["next_binade"] > 0, seen
    return seen


def test_fused_rows_equal_the_row_quantizers_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ok" in proc.stdout


def test_rows_of_the_wrong_shape_or_dtype_are_refused():
    from kernels.fused_quant import new_rows, rows_args
    out = torch.zeros(4, 32, dtype=torch.bfloat16)
    xq, xs = new_rows(4, 32, out.device)
    assert rows_args((xq, xs), out)["QUANT"] and not rows_args(None, out)["QUANT"]
    for bad in ((xq[:, :16], xs), (xq, xs[:2]), (xq.view(torch.uint8), xs),
                (xq, xs.to(torch.float64)), (xq, torch.zeros(4, 2)[:, :1])):
        with pytest.raises(ValueError, match="rows"):
            rows_args(bad, out)


def test_the_gate_holds_a_row_up_to_32768_columns():
    from kernels.fused_quant import silu_rows_launch
    assert silu_rows_launch(80) == (128, 4)
    assert silu_rows_launch(14336) == (16384, 16)          # Llama 3 8B
    assert silu_rows_launch(28672) == (32768, 32)          # Llama 3 70B
    assert silu_rows_launch(53248) == (None, 0)            # Llama 3.1 405B: two launches


def test_a_quantized_input_computes_what_its_plain_rows_do_on_cpu():
    """qlinear of a Quantized: the GEMM of its plain x on the CPU path (where no producer makes
    rows: input_rows is None off CUDA, and for plain and W8A16 weights)."""
    from services.worker.model.fp8 import Quantized, input_rows, qlinear, quantize
    from kernels.fp8_gemm_ref import quantize_rows_ref
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=g)
    w = torch.randn(48, 64, generator=g) * 0.05
    for tokens in (False, True):
        fw = quantize(w, tokens=tokens)
        assert input_rows(fw, x) is None and input_rows(w, x) is None
        assert torch.equal(qlinear(Quantized(x, *quantize_rows_ref(x)), fw), qlinear(x, fw))


def test_the_fp8_dynamic_model_with_rows_forced_gives_the_same_logits(monkeypatch):
    """The tiny Llama with fp8-dynamic on CPU (float32): its producers make no rows (as
    before); with rows forced on (e4m3_device true: each norm and gate fills them on its torch
    path, qlinear gets a Quantized) its prefill logits for 3 prompts with and without adapters
    are the same bit for bit: the LoRA, lm_head and the CPU GEMM read the plain input."""
    from services.worker.model import fp8
    from tests.test_fp8 import FIVE, _engine, _family, _prefill_logits
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        specs = {k: FIVE[k] for k in ("r64-all", "r16-mlp")}
        base_dir, _, dirs = _family(pathlib.Path(tmp), "llama", specs)
        built, slots = _engine(base_dir, dirs, "fp8-dynamic")
        g = torch.Generator().manual_seed(5)
        prompts = {n: torch.randint(2, 256, (3 + 4 * i,), generator=g).tolist()
                   for i, n in enumerate(["r64-all", "r16-mlp", "base"])}
        made = []
        plain = _prefill_logits(built, slots, prompts)
        real = fp8.new_rows
        monkeypatch.setattr(fp8, "e4m3_device", lambda device: True)
        monkeypatch.setattr(fp8, "new_rows", lambda *a: made.append(a) or real(*a))
        forced = _prefill_logits(built, slots, prompts)
    layers = built.spec.num_layers
    assert len(made) == 3 * layers              # every q/k/v, gate/up and down; not lm_head
    for name in prompts:
        assert torch.equal(plain[name], forced[name]), name


# ---------------------------------------------------------------- on CUDA
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_gpu_fused_rows_equal_the_row_quantizers_at_model_widths():
    """The interpreter's checks on CUDA, then each fused kernel at Llama 3 8B's and 70B's
    widths (hidden 4096 / 8192, intermediate 14336 / 28672) and every warm-up row count up to
    300: the output equals the unfused kernel's and the rows quantize_rows' (its own launch)
    bit for bit, and quantize_rows_ref's; then replayed from a CUDA graph on new inputs."""
    from kernels import fused
    from kernels.fp8_tiles import quantize_rows
    from kernels.fused_quant import new_rows
    from services.worker.startup.warmup import token_counts
    check("cuda")
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    for hid, inter in ((4096, 14336), (8192, 28672)):
        w = (torch.randn(hid, generator=gen) * 0.2).to(dev, torch.bfloat16)
        for t in token_counts(300):
            x = varied(t, hid, gen, torch.bfloat16, dev) if t > 2 else torch.randn(
                t, hid, generator=gen).to(dev, torch.bfloat16)
            gu = (torch.randn(t, 2 * inter, generator=gen) * 3).to(dev, torch.bfloat16)
            for name, fn, k in (
                    ("rms_norm", lambda r: fused.rms_norm(x, w, 1e-5, rows=r), hid),
                    ("add_rms_norm", lambda r: fused.add_rms_norm(x.clone(), x, w, 1e-5, rows=r),
                     hid),
                    ("gate_mul", lambda r: fused.gate_mul(gu, "silu", rows=r), inter)):
                plain = fn(None)
                rows = new_rows(t, k, dev)
                got = fn(rows)
                assert torch.equal(got, plain), (name, hid, t)
                xq, xs = quantize_rows(plain)
                assert torch.equal(rows[0].view(torch.uint8), xq.view(torch.uint8)), (name, t)
                assert torch.equal(rows[1], xs), (name, hid, t)
                assert_rows(got, rows, f"{name} {hid} {t}")
    _graph_replay(dev, gen)


def _graph_replay(dev, gen) -> None:
    """rms_norm then gate_mul with rows captured in a CUDA graph: each replay on new inputs
    gives the eager calls' outputs and rows."""
    from kernels import fused
    from kernels.fused_quant import new_rows
    t, hid, inter = 16, 4096, 14336
    x = torch.randn(t, hid, device=dev, dtype=torch.bfloat16)
    w = torch.randn(hid, device=dev, dtype=torch.bfloat16)
    gu = torch.randn(t, 2 * inter, device=dev, dtype=torch.bfloat16)
    rows_n, rows_g = new_rows(t, hid, dev), new_rows(t, inter, dev)

    def step():
        return fused.rms_norm(x, w, 1e-5, rows=rows_n), fused.gate_mul(gu, "silu", rows=rows_g)
    step()                                              # compile before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (1, 2):
        g = torch.Generator(device=dev).manual_seed(seed)
        x.copy_(torch.randn(x.shape, generator=g, device=dev))
        gu.copy_(torch.randn(gu.shape, generator=g, device=dev) * 4)
        graph.replay()
        for out, rows in zip(outs, (rows_n, rows_g)):
            assert_rows(out, rows, f"graph replay {seed}")
        eager = step()
        assert all(torch.equal(a, b) for a, b in zip(outs, eager))


@pytest.mark.gpu
@needs_cuda
def test_gpu_fp8_dynamic_engine_fused_rows_match_the_row_quantizer(monkeypatch):
    """The tiny model with fp8-dynamic on CUDA in bf16: the greedy tokens (decode graphs and
    eager steps) and the eager prefill logits with the rows fused into the norms and the gate
    equal those with every input quantized by its own launch (e4m3_device false for the
    producers), bit for bit."""
    from services.worker.model import fp8
    from tests.test_gpu import greedy_tokens
    fused_tokens = {g: greedy_tokens("cuda", "bfloat16", graphs=g, quantization="fp8-dynamic")
                    for g in (False, True)}
    with monkeypatch.context() as m:
        m.setattr(fp8, "e4m3_device", lambda device: False)
        apart = {g: greedy_tokens("cuda", "bfloat16", graphs=g, quantization="fp8-dynamic")
                 for g in (False, True)}
    assert fused_tokens == apart
    logits = _gpu_prefill_logits(monkeypatch)
    assert torch.equal(logits[True], logits[False])


def _gpu_prefill_logits(monkeypatch) -> dict:
    """{fused: last-position logits of 3 prompts in one eager step} of the tiny fp8-dynamic
    model on CUDA, with the rows fused (True) and quantized apart (False)."""
    from services.worker.config import EngineOptions
    from services.worker.engine.scheduler import Scheduled
    from services.worker.engine.sequence import Sequence
    from services.worker.model import fp8
    from services.worker.startup.factory import build_engine
    from tests.test_gpu import MODEL_DIR
    built = build_engine(MODEL_DIR, EngineOptions(device="cuda", dtype="bfloat16",
                                                  quantization="fp8-dynamic", cuda_graphs=False,
                                                  kv_cache_bytes=16 << 20, block_size=16))
    runner = built.engine.runner
    seqs = [Sequence(f"p{i}", list(range(3, 3 + n))) for i, n in enumerate((5, 17, 40))]
    for s in seqs:
        assert built.engine.scheduler.blocks.ensure(s, len(s.tokens))
    inputs = runner.steps.eager([Scheduled(s, len(s.tokens)) for s in seqs], runner.buffers)
    out = {}
    for fused in (True, False):
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(fp8, "e4m3_device", lambda device: False)
            out[fused] = runner.model.forward(inputs.input_ids, inputs.ctx, runner.kv_cache)
    return out


if __name__ == "__main__":
    print(check())
    print("ok")
