"""The Triton kernel behind kernels.adapter_scatter (read its docstring for the semantics).

Grid (segments, ceil(max_elems / BLOCK)): program (s, c) moves elements c * BLOCK .. + BLOCK of
segment s, in the source's row-major order (reads coalesce; B's transposed writes do not, and
at 33.6 MB an adapter that costs tens of microseconds against a millisecond-long copy).
Destinations are addressed through a table of base pointers, so one launch writes the pool and
the extended q/k/v weights of every layer. Nothing a placement varies (sizes, offsets, the
number of segments) is a compile-time constant: one compile per (src dtype, dst dtype, fold).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.adapter_scatter import BLOCK, NFIELDS, ZERO

_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _scatter_kernel(src_ptr, dst_ptrs, segs_ptr, fold_ptr, fold_stride,
                    DST_DTYPE: tl.constexpr, HAS_FOLD: tl.constexpr, NF: tl.constexpr,
                    ZERO_FLAG: tl.constexpr, BLOCK_E: tl.constexpr):
    seg = segs_ptr + tl.program_id(0) * NF
    rows = tl.load(seg + 3)
    cols = tl.load(seg + 4)
    e = tl.program_id(1).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    live = e < rows * cols
    if tl.program_id(1).to(tl.int64) * BLOCK_E < rows * cols:
        r = e // cols
        c = e - r * cols
        flags = tl.load(seg + 9)
        s_off = tl.load(seg + 2)
        s_rs = tl.load(seg + 5)
        n_read = tl.where((flags & ZERO_FLAG) == 0, rows * cols, 0)   # a zero segment reads none
        x = tl.load(src_ptr + s_off + r * s_rs + c, mask=e < n_read, other=0.0)
        x = x.to(tl.float32)
        if HAS_FOLD:
            f = tl.load(seg + 8)
            n_fold = tl.where(f >= 0, rows * cols, 0)       # f < 0: this segment is not folded
            g = tl.load(fold_ptr + f * fold_stride + c, mask=e < n_fold, other=1.0)
            x = x * g.to(tl.float32)
        base = tl.load(dst_ptrs + tl.load(seg)).to(tl.pointer_type(DST_DTYPE))
        d_at = tl.load(seg + 1) + r * tl.load(seg + 6) + c * tl.load(seg + 7)
        tl.store(base + d_at, x.to(DST_DTYPE), mask=live)


def launch(src: torch.Tensor, dst_dtype: torch.dtype, dst_ptrs: torch.Tensor,
           segs: torch.Tensor, fold: torch.Tensor | None, max_elems: int) -> None:
    """One launch over every segment (the wrapper in kernels.adapter_scatter checked them)."""
    grid = (segs.shape[0], triton.cdiv(max_elems, BLOCK))
    has_fold = fold is not None
    _scatter_kernel[grid](src, dst_ptrs, segs, fold if has_fold else src,
                          fold.stride(0) if has_fold else 0, DST_DTYPE=_TL[dst_dtype],
                          HAS_FOLD=has_fold, NF=NFIELDS, ZERO_FLAG=ZERO, BLOCK_E=BLOCK,
                          num_warps=4)
