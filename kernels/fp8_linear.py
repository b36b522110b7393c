"""qlinear's CUDA path for FP8 weights: which GEMM a step of M rows runs (kernels.fp8_gemm's
kernel, or torch._scaled_mm / dequantize-then-GEMM above it: the prefill path).

`fp8_linear` is qlinear's CUDA path: the kernel up to DECODE_MAX_ROWS rows, `fp8_prefill` above
(torch._scaled_mm with per-row activation scales where the build and the weight allow, else
dequantize-then-GEMM; the choice is that one function's).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8_gemm import capability, fp8_gemm, supported
from kernels.fp8_gemm_config import (DECODE_MAX_ROWS, DYNAMIC_KERNEL_MAX_ROWS,
                                     SCALED_MM_SWAP_MAX_ROWS)
from kernels.fp8_gemm_ref import dequant, qdq_rows
from kernels.fp8_tiles import quantize_rows


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(q, scale, group).T (+ bias) -> [M, N] in x's dtype: the kernel up
    to DECODE_MAX_ROWS rows (and for the operands it serves), else fp8_prefill."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if x.shape[0] <= DECODE_MAX_ROWS and supported(x, q, scale, group):
        return fp8_gemm(x, q, scale, group, bias)
    return fp8_prefill(x, q, scale, group, bias)


def fp8_linear_dynamic(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int,
                       bias: torch.Tensor | None = None,
                       rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """fp8_linear with x quantized per row on every path (W8A8, dynamic per-token scales):
    the row quantizer, then the kernel on e4m3 x e4m3, up to DYNAMIC_KERNEL_MAX_ROWS rows where
    _scaled_mm takes the weight (one scale a row, sm_90), else up to DECODE_MAX_ROWS; above,
    the prefill path (_scaled_mm quantizes the same way; its dequantize fallback gets x
    quantized and scaled back first, kernels.fp8_gemm_ref.qdq_rows). rows: x's rows already
    quantized (e4m3 [M, K], scales [M, 1]: what quantize_rows(x) gives, written by the kernel
    that made x, kernels.fused_quant), so not quantized again."""
    if x.stride(1) != 1:
        x = x.contiguous()
    path = prefill_path(x, q, scale)
    most = DYNAMIC_KERNEL_MAX_ROWS if path == "scaled_mm" else DECODE_MAX_ROWS
    if x.shape[0] <= most and supported(x, q, scale, group):
        xq, sx = quantize_rows(x) if rows is None else rows
        return fp8_gemm(xq, q, scale, group, bias, x_scale=sx, out_dtype=x.dtype)
    if path != "scaled_mm":
        return fp8_prefill(qdq_rows(x), q, scale, group, bias)
    return fp8_prefill(x, q, scale, group, bias, rows)


def prefill_path(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> str:
    """"scaled_mm" where torch._scaled_mm can take these operands with per-row scales (sm_90+,
    a bf16 / fp16 x, one weight scale a row, N and K multiples of 16), else "dequant"."""
    ok = (hasattr(torch, "_scaled_mm") and x.is_cuda and scale.shape[1] == 1
          and x.dtype in (torch.bfloat16, torch.float16)
          and q.shape[0] % 16 == 0 and q.shape[1] % 16 == 0)
    return "scaled_mm" if ok and capability(x.device)[0] >= 9 else "dequant"


def e4m3_device(device: torch.device) -> bool:
    """A CUDA device whose kernels convert to e4m3 (sm_89+): where a W8A8 input's rows may be
    written by the kernel that makes the input (kernels.fused_quant)."""
    return device.type == "cuda" and capability(device) >= (8, 9)


def fp8_prefill(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int,
                bias: torch.Tensor | None = None,
                rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The prefill GEMM (more than DECODE_MAX_ROWS rows: compute, not W's bytes, bounds it).
    "scaled_mm" (prefill_path): x quantized per row to e4m3 (W8A8 for these rows only; the LoRA
    still reads the bf16 x) and torch._scaled_mm on the FP8 tensor cores, row and column scales
    in its epilogue. "dequant": W dequantized to x's dtype, then the ordinary GEMM (a bf16 copy
    of W written and read each call). rows: quantize_rows(x), made already (fp8_linear_dynamic)."""
    if prefill_path(x, q, scale) == "scaled_mm":
        xq, xs = quantize_rows(x) if rows is None else rows
        y = scaled_mm_rows(xq, xs, q, scale, x.dtype)
        return y if bias is None else y.add_(bias)
    return F.linear(x, dequant(q, scale, group, x.dtype), bias)


def scaled_mm_rows(xq: torch.Tensor, xs: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype, swap_max_rows: int | None = None) -> torch.Tensor:
    """(xq * xs) @ (q * scale).T in dtype, [M, N] row-major, on torch._scaled_mm (rowwise
    scales: xs [M, 1], scale [N, 1]). Up to swap_max_rows rows (default
    SCALED_MM_SWAP_MAX_ROWS; M a multiple of 16) with the operands swapped, W @ x.T, then
    transposed back into a row-major copy."""
    m = xq.shape[0]
    most = SCALED_MM_SWAP_MAX_ROWS if swap_max_rows is None else swap_max_rows
    if 0 < m <= most and m % 16 == 0:
        return torch._scaled_mm(q, xq.t(), scale_a=scale.reshape(-1, 1),
                                scale_b=xs.reshape(1, -1), out_dtype=dtype).t().contiguous()
    return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scale.reshape(1, -1),
                            out_dtype=dtype)
