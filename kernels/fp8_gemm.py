"""The FP8 GEMM for decode and small-prefill row counts (W8A16, or W8A8 with x given quantized),
and the prefill path.

Semantics (kernels.fp8_gemm_ref.fp8_gemm_ref):

    out = (x @ dequant(q, scale, group).T + bias + residual).to(x.dtype)
    dequant(q, scale, group)[n, k] = float32(q[n, k]) * scale[n, k // group]

x [M, K] bf16 (fp16, fp32), rows strided; q [N, K] float8_e4m3fn, contiguous; scale float32
[N, G], G = ceil(K / group) (G = 1: one scale a row, per channel or per tensor); bias [N] and
residual [M, N] optional, in x's dtype; out [M, N], a new tensor or `out` (residual itself for
an in-place add).

The kernel reads each weight byte once: FP8 tiles of W are loaded (software-pipelined), made
into x's dtype in registers (config.w_bits: by moving the e4m3 bits into place with integer
operations, the exponent's bias folded into the epilogue's scale: kernels.fp8_tiles; else
Triton's conversion) and multiplied on the tensor cores as the MMA's A operand against x's
tile (acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile.T, "swap-AB": M, 1 to 256 rows, rides the MMA's
narrow side), accumulating in fp32. A per-row scale is applied once, in the epilogue; per-group
scales inside the K loop, each K tile lying in one group (kernels.fp8_gemm_config
.group_block_k). The epilogue adds bias and residual in fp32 and rounds once to x's dtype.
Under PDL (kernels.pdl) the row scales and the bias, weights, are read before the wait; x and
the residual after it.

W8A8 with x given quantized (x e4m3 [M, K] and x_scale float32 [M, 1], kernels.fp8_tiles
.quantize_rows' output; --quantization fp8): out = ((x * x_scale) @ dequant(...).T + ...)
in out_dtype; both tiles go from shared memory to e4m3 x e4m3 MMAs as loaded (no per-element
work in the K loop), x's row scales applied once before the epilogue.

W8A8 in the kernel (config.act_fp8; off in every picked config: slower than W8A16 from 64 rows on
the H100, bench/results/fp8-gemm-h100.md): each x tile quantized to e4m3 in registers, one
scale per row of the tile (max|x| / 448 over its K), and the MMA run on e4m3 operands, so W's
tile reaches the tensor cores as it was loaded (no bf16 conversion); each tile's product is
scaled by its x scales. Semantics: kernels.fp8_gemm_ref.fp8_gemm_ref with that config (x as
quantize_x_tiles makes it). The LoRA beside it reads the bf16 x.

Split-K (config.split_k > 1, at decode M, where N alone gives too few tiles for 132 SMs): each
split writes its fp32 partial tile to a scratch [S, M, N]; the last split of an output tile to
arrive (a per-device arrival counter that it resets, so no memset between calls) sums the
partials in split order, so the result does not depend on which finished first, and runs the
epilogue. One launch; nothing is read on the host, and the scratch is a torch allocation, so a
call can be captured in a CUDA graph (the counters are allocated on first use, which must come
before a capture: the graph runner's warm forwards do it).

Specializations: M is not specialized (do_not_specialize), and the configuration depends on M
only through its bucket (kernels.fp8_gemm_config), so each (projection, bucket) compiles once;
the worker's warm-up meets every bucket (its prompt lengths 1, 2-15, 16, 17, 31-33, ... 255-257).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.fp8_gemm_config import (N_COUNTERS, SMS_DEFAULT, Fp8GemmConfig, group_block_k,
                                     pick_config)
from kernels.fp8_tiles import FOLD, w_mode, w_operand, x_fp8
from kernels.pdl import launch_args, wait_then_release

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


@triton.jit
def _row_terms(s_ptr, bias_ptr, rn, n_ok, stride_s, BLOCK_N: tl.constexpr,
               GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, FOLD: tl.constexpr):
    """The epilogue's per-column factors, fp32 [BLOCK_N]: the row scale (1 when GROUPED: the K
    loop applied the scales) times FOLD (kernels.fp8_tiles: the power of two W's operand left
    out) and the bias (0 without). Weights, so read before the PDL wait."""
    if GROUPED:
        s_row = tl.full((BLOCK_N,), FOLD, tl.float32)
    else:
        s_row = tl.load(s_ptr + rn * stride_s, mask=n_ok, other=0.0) * FOLD
    if HAS_BIAS:
        b_row = tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    else:
        b_row = tl.zeros((BLOCK_N,), tl.float32)
    return s_row, b_row


@triton.jit
def _epilogue(acc, s_row, b_row, rn, rm, n_ok, m_ok, res_ptr, out_ptr, stride_r, stride_o,
              HAS_RES: tl.constexpr):
    """out[rm, rn] = acc.T * s_row + b_row + residual, rounded once. acc: fp32
    [BLOCK_N, BLOCK_M]."""
    acc = acc * s_row[:, None] + b_row[:, None]
    io_ok = n_ok[:, None] & m_ok[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + rm[None, :] * stride_r + rn[:, None], mask=io_ok,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + rm[None, :] * stride_o + rn[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=io_ok)


@triton.jit
def _k_loop(x_ptr, q_ptr, s_ptr, rn_w, rm_x, K, stride_x, stride_q, stride_s, group, kt0, kt1,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            GROUPED: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
            DOT_PREC: tl.constexpr, STAGES: tl.constexpr, A8: tl.constexpr,
            W_BITS: tl.constexpr, XQ: tl.constexpr):
    """sum over K tiles kt0..kt1 of W[rn_w, Kt] @ x[rm_x, Kt].T (times each tile's group scale
    when GROUPED): fp32 [BLOCK_N, BLOCK_M]. rn_w, rm_x are in bounds (wrapped), so only K needs a
    mask, and only when K is not a whole number of tiles. A8: each x tile quantized to e4m3 in
    registers (x_fp8) and the MMA run on e4m3 operands, W's tile as it was loaded; the tile's
    x scales applied to its product. Else W's tile becomes the operand as W_BITS says
    (kernels.fp8_tiles.w_operand: the result is then 1 / FOLD of the sum)."""
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = q_ptr + rn_w[:, None] * stride_q + rk[None, :]           # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + rm_x[None, :] * stride_x + rk[:, None]           # [BLOCK_K, BLOCK_M]
    # XQ: x already e4m3 (its row scales applied by the caller): e4m3 x e4m3 MMAs, both
    # operands from shared memory as loaded
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kt in tl.range(kt0, kt1, num_stages=STAGES):
        k0 = kt * BLOCK_K
        if EVEN_K:
            w = tl.load(w_ptrs + k0)
            xt = tl.load(x_ptrs + k0)
        else:
            k_ok = (k0 + rk) < K
            w = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0)
            xt = tl.load(x_ptrs + k0, mask=k_ok[:, None], other=0.0)
        if XQ:
            wq = w.to(tl.float32) if UPCAST else w
            xq = xt.to(tl.float32) if UPCAST else xt
            if GROUPED:
                s = tl.load(s_ptr + rn_w * stride_s + k0 // group)
                acc += tl.dot(wq, xq, out_dtype=tl.float32) * s[:, None]
            else:
                acc = tl.dot(wq, xq, acc, out_dtype=tl.float32)
        elif A8:
            xq, sx = x_fp8(xt, UPCAST)
            wq = w.to(tl.float32) if UPCAST else w
            part = tl.dot(wq, xq, out_dtype=tl.float32) * sx[None, :]
            if GROUPED:
                part *= tl.load(s_ptr + rn_w * stride_s + k0 // group)[:, None]
            acc += part
        else:
            if UPCAST:                   # the interpreter: numpy has no bf16 matmul
                wd = w_operand(w, tl.float32, W_BITS)
                xt = xt.to(tl.float32)
            else:
                wd = w_operand(w, x_ptr.dtype.element_ty, W_BITS)
            if GROUPED:
                s = tl.load(s_ptr + rn_w * stride_s + k0 // group)
                acc += tl.dot(wd, xt, input_precision=DOT_PREC) * s[:, None]
            else:
                acc = tl.dot(wd, xt, acc, input_precision=DOT_PREC)
    return acc


@triton.jit(do_not_specialize=("M",))
def _fp8_gemm_kernel(x_ptr, q_ptr, s_ptr, bias_ptr, res_ptr, out_ptr, ws_ptr, cnt_ptr, xs_ptr,
                     M, N, K, stride_x, stride_q, stride_s, stride_r, stride_o, group,
                     tiles_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, GROUPED: tl.constexpr,
                     EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                     UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, STAGES: tl.constexpr,
                     A8: tl.constexpr, W_BITS: tl.constexpr, FOLD: tl.constexpr,
                     XQ: tl.constexpr, USE_PDL: tl.constexpr):
    """One program an (N tile, K split, M tile), M tiles fastest: the row tiles of one N tile
    run side by side, so W's tile comes from HBM once and from L2 for the others."""
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = pid % m_tiles
    pid_k = (pid // m_tiles) % SPLIT_K
    pid_n = pid // (m_tiles * SPLIT_K)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    kt0 = pid_k * tiles_per_split
    kt1 = tl.minimum(kt0 + tiles_per_split, tl.cdiv(K, BLOCK_K))
    s_row, b_row = _row_terms(s_ptr, bias_ptr, rn, n_ok, stride_s, BLOCK_N, GROUPED, HAS_BIAS,
                               FOLD)
    wait_then_release(USE_PDL)           # x is the kernel before's output
    acc = _k_loop(x_ptr, q_ptr, s_ptr, (rn % N).to(tl.int64), (rm % M).to(tl.int64), K,
                  stride_x, stride_q, stride_s, group, kt0, kt1, BLOCK_M, BLOCK_N, BLOCK_K,
                  GROUPED, EVEN_K, UPCAST, DOT_PREC, STAGES, A8, W_BITS, XQ)
    if XQ:                               # x's row scales (the quantizer's output: after the wait)
        acc *= tl.load(xs_ptr + rm % M)[None, :]
    rm64 = rm.to(tl.int64)
    if SPLIT_K == 1:
        _epilogue(acc, s_row, b_row, rn, rm64, n_ok, m_ok, res_ptr, out_ptr, stride_r, stride_o,
                  HAS_RES)
    else:
        io_ok = n_ok[:, None] & m_ok[None, :]
        tl.store(ws_ptr + (pid_k * M + rm64)[None, :] * N + rn[:, None], acc, mask=io_ok)
        tl.debug_barrier()               # every thread's partial stored before the arrival
        cnt = cnt_ptr + pid_n * m_tiles + pid_m
        if tl.atomic_add(cnt, 1, sem="acq_rel") == SPLIT_K - 1:     # the tile's last split
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):          # in split order: deterministic
                # .cg: at L2, where the other programs' partials are (never a stale L1 line)
                total += tl.load(ws_ptr + (s * M + rm64)[None, :] * N + rn[:, None],
                                 mask=io_ok, other=0.0, cache_modifier=".cg")
            _epilogue(total, s_row, b_row, rn, rm64, n_ok, m_ok, res_ptr, out_ptr, stride_r,
                      stride_o, HAS_RES)
            tl.atomic_xchg(cnt, 0, sem="relaxed")


# ---------------------------------------------------------------- host side
@functools.lru_cache(maxsize=None)
def _sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """The device's SM count (the table's default off a GPU)."""
    if device.type != "cuda":
        return SMS_DEFAULT
    return _sms(device.index if device.index is not None else torch.cuda.current_device())


def arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's N_COUNTERS int32 arrival counters of split-K calls, zeroed once; each call
    leaves them zero. Allocated on first use, which must not be inside a CUDA-graph capture. One
    set a device: two split-K calls must not run at once (a stream runs one kernel at a time,
    and under PDL a program writes nothing before the kernel before it has finished)."""
    key = (device.type, device.index if device.type != "cuda" or device.index is not None
           else torch.cuda.current_device())
    words = _COUNTERS.get(key)
    if words is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fp8_gemm: call it once before capturing a CUDA graph (the "
                               "split-K arrival counters are allocated on first use)")
        words = _COUNTERS[key] = torch.zeros(N_COUNTERS, dtype=torch.int32, device=device)
    return words


def _scale_group(q: torch.Tensor, scale: torch.Tensor, group: int) -> int:
    """The group width the kernel walks: 0 for one scale a row."""
    return 0 if scale.shape[1] == 1 else group


def supported(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int) -> bool:
    """Whether the kernel serves these operands (else fp8_linear takes the prefill path):
    a float x, groups that hold whole K tiles of at least 16 columns, and on CUDA a card with
    e4m3 conversions (sm_89+)."""
    g = _scale_group(q, scale, group)
    return (x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and group_block_k(128, g) >= 16
            and (not x.is_cuda or capability(x.device) >= (8, 9)))


def _check(x, q, scale, group, bias, residual, out, x_scale, dt) -> None:
    m, k = x.shape
    n = q.shape[0]
    if q.dtype != FP8 or q.shape[1] != k or q.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"fp8_gemm: q must be {FP8} [N, {k}] and x [M, K], both with unit "
                         f"column stride; got q {q.dtype} {tuple(q.shape)}, x {tuple(x.shape)}")
    if scale.dtype != torch.float32 or scale.shape[0] != n or scale.shape[1] != -(-k // group):
        raise ValueError(f"fp8_gemm: scale must be float32 [{n}, ceil({k} / {group})], got "
                         f"{scale.dtype} {tuple(scale.shape)}")
    if (x.dtype == FP8) != (x_scale is not None) or (x_scale is not None and (
            x_scale.dtype != torch.float32 or x_scale.shape != (m, 1)
            or not x_scale.is_contiguous())):
        raise ValueError(f"fp8_gemm: an {FP8} x needs x_scale, float32 [{m}, 1] contiguous "
                         f"(quantize_rows' scales), and only it; got x {x.dtype}, x_scale "
                         f"{None if x_scale is None else (x_scale.dtype, tuple(x_scale.shape))}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != dt or bias.stride(0) != 1):
        raise ValueError(f"fp8_gemm: bias must be [{n}] {dt}, got {tuple(bias.shape)}")
    for name, t in (("residual", residual), ("out", out)):
        if t is not None and (t.shape != (m, n) or t.dtype != dt or t.stride(1) != 1):
            raise ValueError(f"fp8_gemm: {name} must be [{m}, {n}] {dt} with unit column "
                             f"stride, got {tuple(t.shape)} {t.dtype}")


def _forms(x: torch.Tensor, cfg: Fp8GemmConfig, dt: torch.dtype) -> dict:
    """The kernel's constexprs that follow from x and the config: the MMA's form (XQ: x given
    as e4m3; A8: quantized in the kernel; else W's tile made into x's dtype as W_BITS says)."""
    xq = x.dtype == FP8
    wb = w_mode(dt, x.is_cuda, cfg.w_bits and not cfg.act_fp8 and not xq)
    return dict(UPCAST=not x.is_cuda, DOT_PREC="ieee" if dt == torch.float32 else "tf32",
                A8=cfg.act_fp8 and not xq, W_BITS=wb, FOLD=FOLD[wb], XQ=xq)


def fp8_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int,
             bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
             config: Fp8GemmConfig | None = None, out: torch.Tensor | None = None,
             x_scale: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16
             ) -> torch.Tensor:
    """The kernel (module docstring for the semantics): [M, N] in x's dtype. config: the
    launch (default: kernels.fp8_gemm_config.pick_config by M's bucket). x may come quantized
    (e4m3, with quantize_rows' x_scale [M, 1]): the W8A8 form, out_dtype out (and bias and
    residual in it); config.act_fp8 is then moot. No device reads."""
    dt = x.dtype if x_scale is None else out_dtype
    _check(x, q, scale, group, bias, residual, out, x_scale, dt)
    m, k = x.shape
    n = q.shape[0]
    g = _scale_group(q, scale, group)
    cfg = config or pick_config(m, n, k, g, device_sms(x.device))
    if g and g % cfg.block_k:
        raise ValueError(f"fp8_gemm: block_k {cfg.block_k} must divide the scale group {g}")
    out = torch.empty((m, n), dtype=dt, device=x.device) if out is None else out
    if m == 0:
        return out
    k_tiles = triton.cdiv(k, cfg.block_k)
    per = triton.cdiv(k_tiles, cfg.split_k)
    split = triton.cdiv(k_tiles, per)                   # no empty split
    m_tiles, n_tiles = triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n)
    if split > 1 and m_tiles * n_tiles > N_COUNTERS:
        raise ValueError(f"fp8_gemm: {m_tiles * n_tiles} output tiles is more than the "
                         f"{N_COUNTERS} split-K counters")
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    _fp8_gemm_kernel[(n_tiles * split * m_tiles,)](
        x, q, scale, bias if bias is not None else out, residual if residual is not None
        else out, out, ws, arrival_counters(x.device), x_scale if x_scale is not None else
        scale, m, n, k, x.stride(0), q.stride(0), scale.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), max(g, 1), per,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
        GROUPED=g > 0, EVEN_K=k % cfg.block_k == 0, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, STAGES=cfg.num_stages, **_forms(x, cfg, dt),
        num_warps=cfg.num_warps, num_stages=1, **launch_args(x.device))
    return out


@functools.lru_cache(maxsize=None)
def _device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    return _device_capability(device.index if device.index is not None
                              else torch.cuda.current_device())
