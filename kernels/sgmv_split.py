"""Triton SGMV for decode-sized batches: split-K shrink, then expand — two short launches.

Semantics are kernels.sgmv_ref.sgmv_ref's. At decode sizes the work is latency-bound: one
program walking all of K for its rows is a long dependent chain. Here the shrink spreads K over
programs, each writing a partial v = x[rows, Kc] @ A[:, Kc].T into a scratch buffer (fp32, no
atomics, no memset), and the expand sums the partials and adds (scale * v) @ Bt to one column
block of y. Both launches are persistent grids over work items of live segments only (base-only
and padded segments cost nothing); nothing reads device memory on the host, so both can be
captured in a CUDA graph.

Shapes: as sgmv_ref. Scratch: v [KS, n_slices, T, RANK_BLOCK] fp32, KS = cdiv(K, k_chunk); the
kernels use only as many K chunks (<= KS) as fill the grid once: few live tiles (one adapter,
decode) take many short chunks, many segments take fewer, longer ones.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sgmv_triton import _locate, _slice_bounds


@triton.jit
def _live_tiles(seg_start_ptr, seg_slot_ptr, n_segs, SEG_BLOCK: tl.constexpr,
                BLOCK_M: tl.constexpr):
    si = tl.arange(0, SEG_BLOCK)
    s_ok = si < n_segs
    lo = tl.load(seg_start_ptr + si, mask=s_ok, other=0)
    hi = tl.load(seg_start_ptr + si + 1, mask=s_ok, other=0)
    slot = tl.load(seg_slot_ptr + si, mask=s_ok, other=-1)
    tiles = tl.where(slot >= 0, (tl.maximum(hi - lo, 0) + BLOCK_M - 1) // BLOCK_M, 0)
    return si, lo, hi, slot, tiles, tl.cumsum(tiles, axis=0)


@triton.jit
def _k_split(tiles, n_ks, budget, N_SLICES: tl.constexpr):
    """How many K chunks the shrink uses: enough items to fill `budget` programs once, at most
    n_ks (the scratch's depth). Both kernels compute it the same way from the live tiles."""
    base = tl.sum(tiles) * N_SLICES
    return tl.minimum(tl.maximum(budget // tl.maximum(base, 1), 1), n_ks)


@triton.jit
def _shrink_kernel(x_ptr, pool_ptr, a_off_ptr, ranks_ptr, seg_start_ptr, seg_slot_ptr, v_ptr,
                   K, T, n_slots, n_segs, n_ks, stride_x, budget,
                   N_SLICES: tl.constexpr, SEG_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_K: tl.constexpr, RANK_BLOCK: tl.constexpr,
                   DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    si, lo, hi, slot, tiles, tiles_end = _live_tiles(seg_start_ptr, seg_slot_ptr, n_segs,
                                                     SEG_BLOCK, BLOCK_M)
    n_ks = _k_split(tiles, n_ks, budget, N_SLICES)
    chunk = ((K + n_ks - 1) // n_ks + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    total = tl.sum(tiles) * N_SLICES * n_ks
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    rr = tl.arange(0, RANK_BLOCK)
    for w in range(pid, total, nprog):
        ks = w % n_ks
        j = (w // n_ks) % N_SLICES
        tile = w // (n_ks * N_SLICES)
        s, row0, m_len = _locate(tile, si, lo, hi, slot, tiles, tiles_end, BLOCK_M)
        a_o = tl.load(a_off_ptr + j * n_slots + s)
        if a_o >= 0:
            rank = tl.load(ranks_ptr + s)
            rows = (row0 + rm).to(tl.int64)
            row_ok = rm < m_len
            acc = tl.zeros((BLOCK_M, RANK_BLOCK), dtype=tl.float32)
            for k0 in range(ks * chunk, tl.minimum(ks * chunk + chunk, K), BLOCK_K):
                k_ok = (k0 + rk) < K
                xt = tl.load(x_ptr + rows[:, None] * stride_x + (k0 + rk)[None, :],
                             mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                at = tl.load(pool_ptr + a_o + rr[:, None] * K + (k0 + rk)[None, :],
                             mask=(rr < rank)[:, None] & k_ok[None, :], other=0.0)
                if UPCAST:
                    xt = xt.to(tl.float32)
                    at = at.to(tl.float32)
                acc = tl.dot(xt, tl.trans(at), acc, input_precision=DOT_PREC)
            v_rows = ((ks * N_SLICES + j) * T + rows) * RANK_BLOCK
            tl.store(v_ptr + v_rows[:, None] + rr[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _expand_kernel(y_ptr, pool_ptr, b_off_ptr, ranks_ptr, scales_ptr, seg_start_ptr,
                   seg_slot_ptr, v_ptr, T, n_slots, n_segs, n_ks, max_col_blocks, stride_y,
                   budget, s0, s1, s2, s3, s4,
                   N_SLICES: tl.constexpr, SEG_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, RANK_BLOCK: tl.constexpr, DOT_PREC: tl.constexpr,
                   UPCAST: tl.constexpr):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    si, lo, hi, slot, tiles, tiles_end = _live_tiles(seg_start_ptr, seg_slot_ptr, n_segs,
                                                     SEG_BLOCK, BLOCK_M)
    n_ks = _k_split(tiles, n_ks, budget, N_SLICES)
    base = tl.sum(tiles) * N_SLICES
    # column splits: enough items to fill the grid; with many live tiles, one item sums v once
    # and sweeps several column blocks
    n_split = tl.minimum(tl.maximum(nprog // tl.maximum(base, 1), 1), max_col_blocks)
    rm = tl.arange(0, BLOCK_M)
    rr = tl.arange(0, RANK_BLOCK)
    rn = tl.arange(0, BLOCK_N)
    for w in range(pid, base * n_split, nprog):
        split = w % n_split
        j = (w // n_split) % N_SLICES
        tile = w // (n_split * N_SLICES)
        s, row0, m_len = _locate(tile, si, lo, hi, slot, tiles, tiles_end, BLOCK_M)
        col0, col1 = _slice_bounds(j, s0, s1, s2, s3, s4, N_SLICES)
        width = col1 - col0
        n_blocks = (width + BLOCK_N - 1) // BLOCK_N
        per = (n_blocks + n_split - 1) // n_split
        nb0 = split * per
        nb1 = tl.minimum(nb0 + per, n_blocks)
        b_o = tl.load(b_off_ptr + j * n_slots + s)
        if (b_o >= 0) & (nb0 < nb1):
            rank = tl.load(ranks_ptr + s)
            scale = tl.load(scales_ptr + s)
            rows = (row0 + rm).to(tl.int64)
            row_ok = rm < m_len
            v = tl.zeros((BLOCK_M, RANK_BLOCK), dtype=tl.float32)
            for ks in range(0, n_ks):
                v_rows = ((ks * N_SLICES + j) * T + rows) * RANK_BLOCK
                v += tl.load(v_ptr + v_rows[:, None] + rr[None, :], mask=row_ok[:, None],
                             other=0.0)
            v = (v * scale).to(pool_ptr.dtype.element_ty)
            if UPCAST:
                v = v.to(tl.float32)
            for nb in range(nb0, nb1):                   # not pipelined: it stores into y
                cols = nb * BLOCK_N + rn
                c_ok = cols < width
                bt = tl.load(pool_ptr + b_o + rr[:, None] * width + cols[None, :],
                             mask=(rr < rank)[:, None] & c_ok[None, :], other=0.0)
                if UPCAST:
                    bt = bt.to(tl.float32)
                delta = tl.dot(v, bt, input_precision=DOT_PREC)
                y_ptrs = y_ptr + rows[:, None] * stride_y + (col0 + cols)[None, :]
                io_ok = row_ok[:, None] & c_ok[None, :]
                old = tl.load(y_ptrs, mask=io_ok, other=0.0)
                tl.store(y_ptrs, (old.to(tl.float32) + delta).to(y_ptr.dtype.element_ty),
                         mask=io_ok)


def _programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 4                                                   # TRITON_INTERPRET=1
    from kernels.sgmv_triton import _sm_count
    return 4 * _sm_count(device.index if device.index is not None else
                         torch.cuda.current_device())


def sgmv_split(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start, seg_slot,
               max_rank: int, k_chunk: int = 256, block_n: int = 64) -> torch.Tensor:
    """Same contract as kernels.sgmv_ref.sgmv_ref (checked by the caller): two launches."""
    t_rows, k = x.shape
    n_segs = seg_slot.shape[0]
    if t_rows == 0 or n_segs == 0:
        return y
    n_slices = len(slice_starts) - 1
    rb = max(16, triton.next_power_of_2(max_rank))
    block_m = 16
    block_k = min(k_chunk, 128 if rb <= 32 else 64)
    n_ks = triton.cdiv(k, k_chunk)
    v = torch.empty((n_ks, n_slices, t_rows, rb), dtype=torch.float32, device=x.device)
    widths = [slice_starts[i + 1] - slice_starts[i] for i in range(n_slices)]
    max_col_blocks = triton.cdiv(max(widths), block_n)
    tiles_bound = triton.cdiv(t_rows, block_m) + n_segs
    progs = _programs(x.device)
    seg_block = max(16, triton.next_power_of_2(n_segs))
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    upcast = x.dtype == torch.bfloat16 and not x.is_cuda
    shrink_grid = max(1, min(progs, tiles_bound * n_slices * n_ks))
    _shrink_kernel[(shrink_grid,)](
        x, pool, a_off, ranks, seg_start, seg_slot, v, k, t_rows, ranks.shape[0], n_segs,
        n_ks, x.stride(0), shrink_grid, N_SLICES=n_slices, SEG_BLOCK=seg_block,
        BLOCK_M=block_m, BLOCK_K=block_k, RANK_BLOCK=rb, DOT_PREC=prec, UPCAST=upcast,
        num_warps=4, num_stages=1)
    s = list(slice_starts) + [slice_starts[-1]] * (5 - len(slice_starts))
    _expand_kernel[(max(1, min(progs, tiles_bound * n_slices * max_col_blocks)),)](
        y, pool, b_off, ranks, scales, seg_start, seg_slot, v, t_rows, ranks.shape[0], n_segs,
        n_ks, max_col_blocks, y.stride(0), shrink_grid, *s, N_SLICES=n_slices,
        SEG_BLOCK=seg_block,
        BLOCK_M=block_m, BLOCK_N=block_n, RANK_BLOCK=rb, DOT_PREC=prec, UPCAST=upcast,
        num_warps=4, num_stages=1)
    return y
