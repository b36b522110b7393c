"""Conversions of the FP8 GEMM (kernels.fp8_gemm): a W tile of e4m3 bytes made into the MMA's
operand type, an x tile quantized to e4m3, and x's rows quantized in one launch (quantize_rows).

W's tile without the conversion unit (`w_operand`, W_BITS 1-3). e4m3 and bf16 share fp32's
layout idea (sign, exponent, mantissa) with biases 7 and 127, so moving an e4m3 byte's sign to
bit 15 and its exponent and mantissa bits up by 4 gives the bf16 whose value is exactly the
e4m3 value times 2^-120, subnormals included (an e4m3 subnormal lands on a bf16 subnormal of
the same scaled value). The GEMM multiplies its fp32 result by 2^120 in the epilogue (FOLD), an
exact power of two. fp16 (bias 15): bits up by 7, factor 2^-8. fp32 (the interpreter's path and
an fp32 x): bits up by 20, factor 2^-120. Done with integer operations on the ALU pipe (two
bytes in one register: one PRMT, two LOP3-class operations) instead of the conversion unit's
F2FP + F2F pair per element, the pair that Triton's own e4m3 -> bf16 conversion compiles to on
sm_90 (no direct instruction there). e4m3fn's NaN (0x7F / 0xFF, never in a quantized weight)
would read as +-480.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_gemm_ref import quantize_rows_ref
from kernels.pdl import launch_args, wait_then_release

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_MAX_C = tl.constexpr(FP8_MAX)

W_CVT, W_BF16, W_F16, W_F32 = 0, 1, 2, 3    # how W's tile becomes the MMA operand
FOLD = {W_CVT: 1.0, W_BF16: 2.0 ** 120, W_F16: 2.0 ** 8, W_F32: 2.0 ** 120}


def w_mode(x_dtype: torch.dtype, on_cuda: bool, bits: bool) -> int:
    """The W_* mode for an x of this dtype: W_CVT when bits is off; the interpreter (numpy, no
    bf16 matmul) and an fp32 x take the fp32 bit form."""
    if not bits:
        return W_CVT
    if not on_cuda or x_dtype == torch.float32:
        return W_F32
    return W_F16 if x_dtype == torch.float16 else W_BF16


@triton.jit
def _bf16_bits(w):
    """Two e4m3 bytes -> two bf16 in one register: each byte at the top of its half (PRMT),
    the sign kept, exponent and mantissa shifted down by 4 into place."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 r, m;
        cvt.u32.u16 r, $1;
        prmt.b32 r, r, 0, 0x1404;
        and.b32 m, r, 0x7F007F00;
        shr.b32 m, m, 4;
        and.b32 r, r, 0x80008000;
        or.b32 $0, r, m;
        }""", constraints="=r,h", args=[w.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16,
        is_pure=True, pack=2)


@triton.jit
def _f16_bits(w):
    """_bf16_bits for fp16: exponent and mantissa shifted down by 1."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 r, m;
        cvt.u32.u16 r, $1;
        prmt.b32 r, r, 0, 0x1404;
        and.b32 m, r, 0x7F007F00;
        shr.b32 m, m, 1;
        and.b32 r, r, 0x80008000;
        or.b32 $0, r, m;
        }""", constraints="=r,h", args=[w.to(tl.uint8, bitcast=True)], dtype=tl.float16,
        is_pure=True, pack=2)


@triton.jit
def w_operand(w, X_DTYPE: tl.constexpr, W_BITS: tl.constexpr):
    """An e4m3 W tile as the MMA's operand, its values times 1 / FOLD[W_BITS] (module
    docstring). W_CVT: Triton's conversion to X_DTYPE (exact: e4m3 fits bf16, fp16, fp32)."""
    if W_BITS == 1:
        return _bf16_bits(w)
    elif W_BITS == 2:
        return _f16_bits(w)
    elif W_BITS == 3:
        b = w.to(tl.uint8, bitcast=True).to(tl.uint32)
        return (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True)
    else:
        return w.to(X_DTYPE)


@triton.jit
def e4m3_rne(v):
    """fp32 v (|v| <= 448) rounded to its nearest e4m3 value, ties to even, in fp32 arithmetic:
    adding and taking away 1.5 * 2^23 quanta rounds to a whole number of quanta, the quantum
    being 2^(exponent - 3) (2^-9 below e4m3's normal range). The interpreter's path: its own
    fp8 conversion does not carry a rounding up into the exponent (31.9 -> 16). The sign is
    v's sign bit, so -0.0 stays -0.0 (a SiLU's output, or a zero row times a negative norm
    weight), as torch's conversion keeps it."""
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    quantum = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    big = quantum * 12582912.0
    r = (tl.abs(v) + big) - big
    return tl.where(bits < 0, -r, r)


@triton.jit
def x_fp8(xt, UPCAST: tl.constexpr):
    """An x tile [BLOCK_K, BLOCK_M] quantized to e4m3 per row of x (a column here) with its
    own scale, max|x| / 448 over the tile's K: (the e4m3 tile, fp32 [BLOCK_M] scales). Under
    the interpreter the tile comes back as fp32 holding the e4m3 values."""
    xf = xt.to(tl.float32)
    sx = tl.maximum(tl.div_rn(tl.max(tl.abs(xf), axis=0), 448.0), 1e-12)
    if UPCAST:
        xq = e4m3_rne(tl.div_rn(xf, sx[None, :]))
    else:
        xq = tl.div_rn(xf, sx[None, :]).to(tl.float8e4nv)
    return xq, sx


@triton.jit
def row_scale(amax):
    """A row's e4m3 scale from its max |x| (fp32): max(amax, 1e-12) / 448, the division
    rounded to nearest (div_rn, not Triton's approximate `/`), as quantize_rows_ref divides."""
    return tl.div_rn(tl.maximum(amax, 1e-12), FP8_MAX_C)


@triton.jit
def e4m3_sat(v, UPCAST: tl.constexpr):
    """fp32 v clamped to +-448 and rounded to e4m3, to nearest even. UPCAST (the interpreter):
    rounded in fp32 first (e4m3_rne), so the conversion that follows is exact."""
    v = tl.minimum(tl.maximum(v, -FP8_MAX_C), FP8_MAX_C)
    if UPCAST:
        v = e4m3_rne(v)
    return v.to(tl.float8e4nv)


@triton.jit
def e4m3_of(v, scale, UPCAST: tl.constexpr):
    """fp32 v / scale (div_rn) clamped to +-448 and rounded to e4m3, to nearest: the bytes of
    quantize_rows_ref (e4m3_sat)."""
    return e4m3_sat(tl.div_rn(v, scale), UPCAST)


@triton.jit
def kv_value(v, dtype: tl.constexpr, KV_FP8: tl.constexpr, UPCAST: tl.constexpr, scale):
    """v as the KV cache stores it (dtype: the cache's element type): with KV_FP8 (an e4m3
    cache) v / scale (the layer's k_scale or v_scale, div_rn) clamped to +-448 and rounded to
    e4m3 (e4m3_of), as kernels.attention_ref.write_kv_ref stores it; else converted to dtype
    (scale unused)."""
    if KV_FP8:
        v = e4m3_of(v.to(tl.float32), scale, UPCAST)
    return v.to(dtype)


@triton.jit
def store_e4m3_row(y, ok, q_ptrs, s_ptr, UPCAST: tl.constexpr):
    """A whole row y (one block; lanes outside `ok` ignored) quantized as quantize_rows does,
    from registers: its e4m3 values stored at q_ptrs (masked by ok), its scale at s_ptr. For
    the kernels that wrote y and hold the row (kernels.fused), so y is read in its dtype,
    rounded, as quantize_rows would read it back."""
    yf = y.to(tl.float32)
    scale = row_scale(tl.max(tl.where(ok, tl.abs(yf), 0.0), axis=0))
    tl.store(q_ptrs, e4m3_of(yf, scale, UPCAST), mask=ok)
    tl.store(s_ptr, scale)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr,
                          UPCAST: tl.constexpr, USE_PDL: tl.constexpr):
    """One program a row: max|x| over the row (first pass), then x / scale rounded to e4m3
    (second pass, the row again from L2), scale = max|x| / 448 (row_scale, e4m3_of: the
    divisions round to nearest, so the bytes equal torch's quantize_rows_ref)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    wait_then_release(USE_PDL)
    amax = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        v = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
    scale = row_scale(tl.max(amax, axis=0))
    for k0 in range(0, K, BLOCK):
        ok = k0 + cols < K
        v = tl.load(x_ptr + row * stride_x + k0 + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_q + k0 + cols, e4m3_of(v, scale, UPCAST), mask=ok)
    tl.store(s_ptr + row, scale)


def kv_fp8_args(cache: torch.Tensor, x: torch.Tensor | None = None) -> dict:
    """The constexprs of a kernel that reads or writes a KV cache: KV_FP8 for an e4m3 cache
    (with x, the tensor written: UPCAST under the interpreter); none for a cache of the model's
    dtype, whose kernels stay as they were."""
    if cache.dtype != FP8:
        return {}
    return {"KV_FP8": True} if x is None else {"KV_FP8": True, "UPCAST": not x.is_cuda}


def kv_scale_args(kv_scale: tuple[float, float],
                  cache: torch.Tensor | None = None) -> tuple[float, float]:
    """A layer's (k_scale, v_scale) as kernel arguments, checked: positive and finite; (1.0,
    1.0), unchecked, for a cache of the model dtype (which ignores them)."""
    if cache is not None and cache.dtype != FP8:
        return 1.0, 1.0
    k, v = (float(x) for x in kv_scale)
    if not (0.0 < k < float("inf") and 0.0 < v < float("inf")):
        raise ValueError(f"KV scales must be positive and finite, got {kv_scale}")
    return k, v


QUANT_BLOCK = 4096                       # a row's columns a pass step


def quantize_rows(x: torch.Tensor, impl: str = "auto",
                  out: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]) with one scale a row: max|x[m]| / 448
    (a zero row: tiny, so it quantizes to zeros). The kernel, one launch (x read twice, the
    second time from L2), on a GPU or with impl="triton" (the interpreter); else
    kernels.fp8_gemm_ref.quantize_rows_ref. out: the two to write (e4m3 with unit column
    stride, scales contiguous), else new ones."""
    if not (x.is_cuda or impl == "triton"):
        xq, s = quantize_rows_ref(x)
        if out is None:
            return xq, s
        out[0].copy_(xq)
        out[1].copy_(s)
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    m, k = x.shape
    xq, s = out if out is not None else (torch.empty((m, k), dtype=FP8, device=x.device),
                                         torch.empty((m, 1), dtype=torch.float32,
                                                     device=x.device))
    if m:
        _quantize_rows_kernel[(m,)](x, xq, s, k, x.stride(0), xq.stride(0),
                                    BLOCK=min(QUANT_BLOCK, triton.next_power_of_2(k)),
                                    UPCAST=not x.is_cuda, num_warps=8 if k >= 4096 else 4,
                                    **launch_args(x.device))
    return xq, s
