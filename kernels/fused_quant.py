"""The e4m3 rows that the fused kernels (kernels.fused) write beside their output for a W8A8
GEMM after them (--quantization fp8: services.worker.model.fp8).

A W8A8 linear's input is quantized per row: scale = max|row| / 448 (float32 [T, 1]) and the
row / scale rounded to e4m3 (kernels.fp8_tiles.quantize_rows, one launch of its own). Where the
input is the output of a kernel of ours that holds each whole row in registers, the RMSNorm
(rms_norm, add_rms_norm) and the MLP's gate (silu_mul / gate_mul, then a program a row), that
kernel writes the row's e4m3 values and scale too (`rows=(xq, xs)`), from the output as rounded
to its dtype, with quantize_rows' arithmetic (kernels.fp8_tiles.store_e4m3_row): the same bytes
and scales as quantize_rows of the output, one launch fewer and the output not read again. The
output is still written (the LoRA beside the GEMM reads it).

`new_rows(t, k, device)` makes the buffers; the kernels' torch path (off CUDA, and the tests'
reference) is the unfused output then quantize_rows_ref (`rows_ref`).
"""
from __future__ import annotations

import torch
import triton

from kernels.fp8_gemm_ref import quantize_rows_ref

FP8 = torch.float8_e4m3fn
Rows = tuple[torch.Tensor, torch.Tensor]    # a GEMM input's e4m3 rows [T, K] and scales [T, 1]

# The gate's launch with rows: a program a row holding it whole (the row's max needs all of
# it), up to max_block columns (wider: silu_mul's own launch, then quantize_rows), with a warp
# for each cols_per_warp columns, 4 to max_warps. Compiled for sm_90, 16384 columns on 16 warps
# and 32768 on 32 take 64 registers a thread and spill nothing (Llama 3 8B's 14336 and 70B's
# 28672 intermediate columns: a block of 16384 and 32768).
SILU_ROWS_LAUNCH = {"max_block": 32768, "cols_per_warp": 1024, "max_warps": 32}


def new_rows(t: int, k: int, device: torch.device) -> Rows:
    """Empty buffers for the e4m3 rows of a [t, k] input and their scales."""
    return (torch.empty((t, k), dtype=FP8, device=device),
            torch.empty((t, 1), dtype=torch.float32, device=device))


def rows_ref(out: torch.Tensor, rows: Rows | None) -> torch.Tensor:
    """The torch path of `rows`: quantize_rows_ref(out) copied into them; returns out."""
    if rows is not None:
        xq, xs = quantize_rows_ref(out)
        rows[0].copy_(xq)
        rows[1].copy_(xs)
    return out


def rows_args(rows: Rows | None, out: torch.Tensor) -> dict:
    """The kernels' q_ptr, s_ptr, stride_q, QUANT and UPCAST (the interpreter's rounding,
    kernels.fp8_tiles.e4m3_of) for rows = (e4m3 [T, K], float32 [T, 1] contiguous) beside out
    [T, K]; without rows out stands in for the pointers (QUANT off: never touched)."""
    if rows is None:
        return dict(q_ptr=out, s_ptr=out, stride_q=0, QUANT=False, UPCAST=False)
    xq, xs = rows
    if (xq.dtype != FP8 or xq.shape != out.shape or xq.stride(1) != 1
            or xs.dtype != torch.float32 or xs.shape != (out.shape[0], 1)
            or not xs.is_contiguous()):
        raise ValueError(f"rows: {FP8} {list(out.shape)} with unit column stride and float32 "
                         f"[{out.shape[0]}, 1] contiguous wanted, got {xq.dtype} "
                         f"{list(xq.shape)}, {xs.dtype} {list(xs.shape)}")
    return dict(q_ptr=xq, s_ptr=xs, stride_q=xq.stride(0), QUANT=True, UPCAST=not out.is_cuda)


def silu_rows_launch(inter: int) -> tuple[int | None, int]:
    """(BLOCK, num_warps) of the gate's launch with rows for rows of `inter` columns; BLOCK
    None when a program cannot hold the row (SILU_ROWS_LAUNCH)."""
    block = triton.next_power_of_2(inter)
    if block > SILU_ROWS_LAUNCH["max_block"]:
        return None, 0
    warps = block // SILU_ROWS_LAUNCH["cols_per_warp"]
    return block, max(4, min(SILU_ROWS_LAUNCH["max_warps"], warps))
