"""The Triton kernel behind kernels.adapter_scatter (read its docstring for the semantics).

Grid (segments, ceil(max_elems / BLOCK)): program (s, c) moves elements c * BLOCK .. + BLOCK of
segment s, in the source's row-major order (reads coalesce; B's transposed writes do not, and
at 33.6 MB an adapter that costs tens of microseconds against a millisecond-long copy).
Destinations are addressed through a table of base pointers, so one launch writes the pool and
the extended q/k/v weights of every layer. With table writes (HAS_TABLES), one more program
row, the last, writes them (a slot's few hundred table entries), so a placement is one launch.
Nothing a placement varies (sizes, offsets, the number of segments or writes) is a compile-time
constant: one compile per (src dtype, dst dtype, fold, tables).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.adapter_scatter import BLOCK, NFIELDS, ZERO

_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit(do_not_specialize=("w_stride", "n_writes", "n_wide"))
def _scatter_kernel(src_ptr, dst_ptrs, segs_ptr, fold_ptr, fold_stride,
                    w_ptr, w_stride, n_writes, n_wide, wide_ptr, narrow_ptr,
                    DST_DTYPE: tl.constexpr, HAS_FOLD: tl.constexpr, NF: tl.constexpr,
                    ZERO_FLAG: tl.constexpr, BLOCK_E: tl.constexpr, HAS_TABLES: tl.constexpr,
                    BLOCK_W: tl.constexpr):
    if HAS_TABLES:
        if tl.program_id(0) == tl.num_programs(0) - 1:
            if tl.program_id(1) == 0:
                _table_writes(w_ptr, w_stride, n_writes, n_wide, wide_ptr, narrow_ptr, BLOCK_W)
        else:
            _segment(src_ptr, dst_ptrs, segs_ptr, fold_ptr, fold_stride, DST_DTYPE, HAS_FOLD,
                     NF, ZERO_FLAG, BLOCK_E)
    else:
        _segment(src_ptr, dst_ptrs, segs_ptr, fold_ptr, fold_stride, DST_DTYPE, HAS_FOLD, NF,
                 ZERO_FLAG, BLOCK_E)


@triton.jit
def _segment(src_ptr, dst_ptrs, segs_ptr, fold_ptr, fold_stride, DST_DTYPE: tl.constexpr,
             HAS_FOLD: tl.constexpr, NF: tl.constexpr, ZERO_FLAG: tl.constexpr,
             BLOCK_E: tl.constexpr):
    """Program (s, c): elements c * BLOCK_E .. + BLOCK_E of segment s."""
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


@triton.jit
def _table_writes(w_ptr, w_stride, n, n_wide, wide_ptr, narrow_ptr, BLOCK_W: tl.constexpr):
    """n table writes, positions at w_ptr[i] and values at w_ptr[w_stride + i]: the first n_wide
    into the int64 table, the rest into the int32 one."""
    for start in range(0, n, BLOCK_W):
        i = start + tl.arange(0, BLOCK_W)
        live = i < n
        pos = tl.load(w_ptr + i, mask=live, other=0)
        val = tl.load(w_ptr + w_stride + i, mask=live, other=0)
        tl.store(wide_ptr + pos, val, mask=live & (i < n_wide))
        tl.store(narrow_ptr + pos, val.to(tl.int32), mask=live & (i >= n_wide))


def launch(src: torch.Tensor, dst_dtype: torch.dtype, dst_ptrs: torch.Tensor,
           segs: torch.Tensor, n_segs: int, fold: torch.Tensor | None, max_elems: int,
           tables: tuple | None = None) -> None:
    """One launch over the first n_segs segment rows of segs (flat or [S, NFIELDS]) and, with
    tables = (writes, n_writes, n_wide, wide, narrow), the table writes: writes an int64
    [2, >= n_writes] tensor, positions then values (the wrapper in kernels.adapter_scatter
    checked them)."""
    has_tables = tables is not None
    writes, n_writes, n_wide, wide, narrow = tables if has_tables else (segs, 0, 0, segs, segs)
    grid = (n_segs + has_tables, triton.cdiv(max(max_elems, 1), BLOCK))
    has_fold = fold is not None
    _scatter_kernel[grid](src, dst_ptrs, segs, fold if has_fold else src,
                          fold.stride(0) if has_fold else 0, writes,
                          writes.stride(0) if has_tables else 0, n_writes, n_wide, wide,
                          narrow, DST_DTYPE=_TL[dst_dtype], HAS_FOLD=has_fold, NF=NFIELDS,
                          ZERO_FLAG=ZERO, BLOCK_E=BLOCK, HAS_TABLES=has_tables, BLOCK_W=256,
                          num_warps=4)
