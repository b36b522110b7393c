"""The split SGMV's Triton kernels: the two-launch form (shrink items, then expand items) and the
one-launch form with a grid barrier between them. Their semantics and launches:
kernels.sgmv_split."""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.pdl import wait_then_release
from kernels.sgmv_triton import _live_tiles, _locate, _slice_bounds

SPIN_LIMIT = 1 << 22          # barrier polls before a program gives up and flags a timeout


@triton.jit
def _k_split(tiles, n_ks, budget, N_SLICES: tl.constexpr):
    """How many K chunks the shrink uses: enough items to fill `budget` programs once, at most
    n_ks (the scratch's depth). Both phases compute it the same way from the live tiles."""
    base = tl.sum(tiles) * N_SLICES
    return tl.minimum(tl.maximum(budget // tl.maximum(base, 1), 1), n_ks)


@triton.jit
def _shrink_chunk(x_ptr, pool_ptr, a_o, rank, rows, row_ok, k_lo, k_hi, K, stride_x,
                  BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, RANK_BLOCK: tl.constexpr,
                  DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr):
    """x[rows, k_lo:k_hi] @ A[:, k_lo:k_hi].T in fp32 [BLOCK_M, RANK_BLOCK]; K loop pipelined.
    (A's first blocks are not loaded before the PDL wait: slower, bench/PERF_NOTES.md.)"""
    rk = tl.arange(0, BLOCK_K)
    rr = tl.arange(0, RANK_BLOCK)
    acc = tl.zeros((BLOCK_M, RANK_BLOCK), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        k_ok = (k0 + rk) < K
        xt = tl.load(x_ptr + rows[:, None] * stride_x + (k0 + rk)[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(pool_ptr + a_o + rr[:, None] * K + (k0 + rk)[None, :],
                     mask=(rr < rank)[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc = tl.dot(xt, tl.trans(at), acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _sum_partials(v_ptr, rows, row_ok, j, T, n_ks, col0, N_SLICES: tl.constexpr,
                  BLOCK_M: tl.constexpr, RANK_BLOCK: tl.constexpr, KS_MAX: tl.constexpr,
                  WIDTH: tl.constexpr):
    """The sum over K chunks of v[chunk, j, rows, col0:col0 + WIDTH] (fp32 [BLOCK_M, WIDTH]),
    in an unrolled loop (KS_MAX = the scratch's depth) so that the loads are all in flight
    together."""
    rm = tl.arange(0, BLOCK_M)
    rr = tl.arange(0, WIDTH)
    v = tl.zeros((BLOCK_M, WIDTH), dtype=tl.float32)
    for ks in tl.static_range(KS_MAX):
        v_rows = ((ks * N_SLICES + j) * T + rows) * RANK_BLOCK + col0
        # .cg: read at L2, where the other programs' partials are (never a stale L1 line)
        ks_ok = row_ok & (rm * 0 + ks < n_ks)    # (a tensor compare: the interpreter
        v += tl.load(v_ptr + v_rows[:, None] + rr[None, :],    # wants tensor masks)
                     mask=ks_ok[:, None], other=0.0, cache_modifier=".cg")
    return v


@triton.jit
def _b_block(pool_ptr, b_o, rank, width, nb, ok, BLOCK_N: tl.constexpr,
             RANK_BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    """Column block nb of an adapter's Bt [rank, width] (zeros where not ok). b_o is a
    multiple of ALIGN (or not ok)."""
    b_o = (b_o // ALIGN) * ALIGN                  # the same value, with its alignment visible
    rr = tl.arange(0, RANK_BLOCK)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    live_rank = tl.where(ok, rank, 0)             # (no scalar in the mask: the interpreter)
    return tl.load(pool_ptr + b_o + rr[:, None] * width + cols[None, :],
                   mask=(rr < live_rank)[:, None] & (cols < width)[None, :], other=0.0)


@triton.jit
def _expand_cols(y_ptr, pool_ptr, b_o, rank, v, rows, row_ok, width, col0, nb0, nb1, stride_y,
                 bt, BLOCK_N: tl.constexpr, RANK_BLOCK: tl.constexpr, DOT_PREC: tl.constexpr,
                 UPCAST: tl.constexpr, ALIGN: tl.constexpr):
    """y[rows, col0 + column blocks nb0:nb1 of the slice] += v @ Bt (v scaled, pool dtype).
    bt: block nb0 of Bt, loaded by the caller (before its PDL wait). At rank <= 32 each step
    loads the next block while it works on this one; at rank 64 two blocks would not fit the
    registers (the H200 run had rank 64 slower by 2-3 us), so it loads it after its store."""
    rn = tl.arange(0, BLOCK_N)
    for nb in range(nb0, nb1):                   # not pipelined by the compiler: it stores y
        cols = nb * BLOCK_N + rn
        y_ptrs = y_ptr + rows[:, None] * stride_y + (col0 + cols)[None, :]
        io_ok = row_ok[:, None] & (cols < width)[None, :]
        old = tl.load(y_ptrs, mask=io_ok, other=0.0)
        if RANK_BLOCK <= 32:
            bt_next = _b_block(pool_ptr, b_o, rank, width, nb + 1, nb + 1 < nb1, BLOCK_N,
                               RANK_BLOCK, ALIGN)
        if UPCAST:
            delta = tl.dot(v, bt.to(tl.float32), input_precision=DOT_PREC)
        else:
            delta = tl.dot(v, bt, input_precision=DOT_PREC)
        tl.store(y_ptrs, (old.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=io_ok)
        if RANK_BLOCK <= 32:
            bt = bt_next
        else:
            bt = _b_block(pool_ptr, b_o, rank, width, nb + 1, nb + 1 < nb1, BLOCK_N,
                          RANK_BLOCK, ALIGN)


@triton.jit
def _shrink_items(pid, nprog, x_ptr, pool_ptr, a_off_ptr, ranks_ptr, seg_start_ptr,
                  seg_slot_ptr, v_ptr, vsum_ptr, cnt_ptr, K, T, n_slots, n_segs, n_ks, stride_x,
                  budget, N_SLICES: tl.constexpr, SEG_BLOCK: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, RANK_BLOCK: tl.constexpr,
                  DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr,
                  USE_PDL: tl.constexpr, RANK_SPLIT: tl.constexpr, REDUCE: tl.constexpr,
                  KS_MAX: tl.constexpr, ALIGN: tl.constexpr):
    """Work items (row tile, slice, K chunk, rank part):
    v[chunk, slice, rows, part] = x[rows, Kc] @ A[part, Kc].T

    The rank tile is cut in RANK_SPLIT parts of RANK_BLOCK // RANK_SPLIT rows of A, each its
    own item (x is read once a part, from L2). `budget` is the expand's: the number of K chunks
    depends on the live tiles and slices only, so both phases compute it alike.
    With REDUCE, the item that finishes a (tile, slice, part) last (an arrival counter, which
    it resets) sums that part's partials in chunk order into vsum[slice, rows, part]: the same
    sum, in the same order, as the expand's, which then reads one partial.
    Under PDL the segment and offset tables (written before the step, never by the kernel
    before this one) are read before the wait; x and the scratch after it."""
    si, lo, hi, slot, tiles, tiles_end = _live_tiles(seg_start_ptr, seg_slot_ptr, n_segs,
                                                     SEG_BLOCK, BLOCK_M)
    n_ks = _k_split(tiles, n_ks, budget, N_SLICES)
    chunk = ((K + n_ks - 1) // n_ks + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    total = tl.sum(tiles) * N_SLICES * n_ks * RANK_SPLIT
    PART: tl.constexpr = RANK_BLOCK // RANK_SPLIT
    rm = tl.arange(0, BLOCK_M)
    rr = tl.arange(0, PART)
    for w in range(pid, total, nprog):
        part = w % RANK_SPLIT
        ks = (w // RANK_SPLIT) % n_ks
        j = (w // (RANK_SPLIT * n_ks)) % N_SLICES
        tile = w // (RANK_SPLIT * n_ks * N_SLICES)
        s, row0, m_len = _locate(tile, si, lo, hi, slot, tiles, tiles_end, BLOCK_M)
        a_o = tl.load(a_off_ptr + j * n_slots + s)
        rank = tl.load(ranks_ptr + s)
        wait_then_release(USE_PDL)
        if a_o >= 0:
            rows = (row0 + rm).to(tl.int64)
            row_ok = rm < m_len
            a_al = (a_o // ALIGN) * ALIGN     # the same value, with its alignment visible
            acc = _shrink_chunk(x_ptr, pool_ptr, a_al + part * PART * K, rank - part * PART,
                                rows, row_ok, ks * chunk, tl.minimum(ks * chunk + chunk, K), K,
                                stride_x, BLOCK_M, BLOCK_K, PART, DOT_PREC, UPCAST, STAGES)
            v_rows = ((ks * N_SLICES + j) * T + rows) * RANK_BLOCK + part * PART
            tl.store(v_ptr + v_rows[:, None] + rr[None, :], acc, mask=row_ok[:, None])
            if REDUCE:
                tl.debug_barrier()           # every thread's partial stored before the arrival
                cnt = cnt_ptr + (tile * N_SLICES + j) * RANK_SPLIT + part
                arrived = tl.atomic_add(cnt, 1, sem="acq_rel")
                if arrived == n_ks - 1:      # the last K chunk of this (tile, slice, part)
                    tl.debug_barrier()
                    v_sum = _sum_partials(v_ptr, rows, row_ok, j, T, n_ks, part * PART,
                                          N_SLICES, BLOCK_M, RANK_BLOCK, KS_MAX, PART)
                    s_rows = (j * T + rows) * RANK_BLOCK + part * PART
                    tl.store(vsum_ptr + s_rows[:, None] + rr[None, :], v_sum,
                             mask=row_ok[:, None])
                    tl.atomic_xchg(cnt, 0, sem="relaxed")
    wait_then_release(USE_PDL)               # a program without items waits too


@triton.jit
def _expand_items(pid, nprog, y_ptr, pool_ptr, b_off_ptr, ranks_ptr, scales_ptr, seg_start_ptr,
                  seg_slot_ptr, v_ptr, vsum_ptr, col_ptr, T, n_slots, n_segs, n_ks,
                  max_col_blocks, stride_y, stride_v, budget, s0, s1, s2, s3, s4,
                  N_SLICES: tl.constexpr, SEG_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, RANK_BLOCK: tl.constexpr, DOT_PREC: tl.constexpr,
                  UPCAST: tl.constexpr, KS_MAX: tl.constexpr, USE_PDL: tl.constexpr,
                  REDUCE: tl.constexpr, ALIGN: tl.constexpr, COLS: tl.constexpr):
    """Work items (row tile, slice, column split): y[rows, cols] += (scale * sum v) @ Bt.
    The K partials are summed in an unrolled loop (KS_MAX = the scratch's depth), so their loads
    are all in flight together. With COLS, v is not summed: it is read from columns of the
    base GEMM's output (v_ptr, rows stride_v apart), the slot's column block col_ptr[slot]
    (expand_columns). Under PDL the tables and the item's first block of Bt are read before the
    wait; the partials and y after it."""
    si, lo, hi, slot, tiles, tiles_end = _live_tiles(seg_start_ptr, seg_slot_ptr, n_segs,
                                                     SEG_BLOCK, BLOCK_M)
    n_ks = _k_split(tiles, n_ks, budget, N_SLICES)
    base = tl.sum(tiles) * N_SLICES
    # column splits: enough items to fill the grid; with many live tiles, one item sums v once
    # and sweeps several column blocks
    n_split = tl.minimum(tl.maximum(nprog // tl.maximum(base, 1), 1), max_col_blocks)
    rm = tl.arange(0, BLOCK_M)
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
        rank = tl.load(ranks_ptr + s)
        scale = tl.load(scales_ptr + s)
        live = (b_o >= 0) & (nb0 < nb1)
        if COLS:
            c_o = tl.load(col_ptr + s)
            live = live & (c_o >= 0)
        bt = _b_block(pool_ptr, b_o, rank, width, nb0, live, BLOCK_N, RANK_BLOCK, ALIGN)
        wait_then_release(USE_PDL)
        if live:
            rows = (row0 + rm).to(tl.int64)
            row_ok = rm < m_len
            if COLS:                         # x @ A.T: columns of the base GEMM's output
                rr = tl.arange(0, RANK_BLOCK)
                v = tl.load(v_ptr + rows[:, None] * stride_v
                            + ((c_o * N_SLICES + j) * RANK_BLOCK + rr)[None, :],
                            mask=row_ok[:, None], other=0.0).to(tl.float32)
            elif REDUCE:                     # the shrink summed them (vsum)
                s_rows = (j * T + rows) * RANK_BLOCK
                v = tl.load(vsum_ptr + s_rows[:, None] + tl.arange(0, RANK_BLOCK)[None, :],
                            mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
            else:
                v = _sum_partials(v_ptr, rows, row_ok, j, T, n_ks, 0, N_SLICES, BLOCK_M,
                                  RANK_BLOCK, KS_MAX, RANK_BLOCK)
            v = (v * scale).to(pool_ptr.dtype.element_ty)
            if UPCAST:
                v = v.to(tl.float32)
            _expand_cols(y_ptr, pool_ptr, b_o, rank, v, rows, row_ok, width, col0, nb0, nb1,
                         stride_y, bt, BLOCK_N, RANK_BLOCK, DOT_PREC, UPCAST, ALIGN)
    wait_then_release(USE_PDL)               # a program without items waits too


@triton.jit
def _grid_sync(bar_ptr, nprog, SPIN_LIMIT: tl.constexpr):
    """Every program of the launch waits here until all have arrived (all must be resident).

    bar_ptr[0] counts arrivals, bar_ptr[1] is the generation: the last program to arrive resets
    the count and then advances the generation, which releases the others. A program whose wait
    exceeds SPIN_LIMIT polls sets bar_ptr[2] and goes on (wrong output, but no hung GPU).
    Scalar atomics run on one thread of the program; the debug barriers order the program's
    other threads around it (their stores before the arrival, their loads after the release).
    """
    tl.debug_barrier()
    gen = tl.atomic_add(bar_ptr + 1, 0, sem="acquire")
    arrived = tl.atomic_add(bar_ptr, 1, sem="acq_rel")
    if arrived == nprog - 1:
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed")
        tl.atomic_add(bar_ptr + 1, 1, sem="release")
    else:
        spins = 0
        while (tl.atomic_add(bar_ptr + 1, 0, sem="acquire") == gen) & (spins < SPIN_LIMIT):
            spins += 1
        if spins >= SPIN_LIMIT:
            tl.atomic_xchg(bar_ptr + 2, 1)
    tl.debug_barrier()


# Arguments that change from step to step (rows, segments, work items) are not specialized:
# Triton would compile a variant for each combination of "is 1" / "divides by 16" among them,
# mid-serving, whenever a step met a new one (20-60 such compiles in a served run). The
# one-launch form (without PDL) too: it had them specialized, so without PDL a step's rows and
# segments being 1 or multiples of 16 were compiles of their own (tests/test_warmup_kernels.py).
PER_STEP = ("T", "n_segs", "n_ks", "budget")


@triton.jit(do_not_specialize=PER_STEP)
def _shrink_kernel(x_ptr, pool_ptr, a_off_ptr, ranks_ptr, seg_start_ptr, seg_slot_ptr, v_ptr,
                   vsum_ptr, cnt_ptr, K, T, n_slots, n_segs, n_ks, stride_x, budget,
                   N_SLICES: tl.constexpr, SEG_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_K: tl.constexpr, RANK_BLOCK: tl.constexpr,
                   DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr,
                   USE_PDL: tl.constexpr, RANK_SPLIT: tl.constexpr, REDUCE: tl.constexpr,
                   KS_MAX: tl.constexpr, ALIGN: tl.constexpr):
    _shrink_items(tl.program_id(0), tl.num_programs(0), x_ptr, pool_ptr, a_off_ptr, ranks_ptr,
                  seg_start_ptr, seg_slot_ptr, v_ptr, vsum_ptr, cnt_ptr, K, T, n_slots, n_segs,
                  n_ks, stride_x, budget, N_SLICES, SEG_BLOCK, BLOCK_M, BLOCK_K, RANK_BLOCK,
                  DOT_PREC, UPCAST, STAGES, USE_PDL, RANK_SPLIT, REDUCE, KS_MAX, ALIGN)


@triton.jit(do_not_specialize=PER_STEP)
def _expand_kernel(y_ptr, pool_ptr, b_off_ptr, ranks_ptr, scales_ptr, seg_start_ptr,
                   seg_slot_ptr, v_ptr, vsum_ptr, col_ptr, T, n_slots, n_segs, n_ks,
                   max_col_blocks, stride_y, stride_v, budget, s0, s1, s2, s3, s4,
                   N_SLICES: tl.constexpr, SEG_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, RANK_BLOCK: tl.constexpr, DOT_PREC: tl.constexpr,
                   UPCAST: tl.constexpr, KS_MAX: tl.constexpr, USE_PDL: tl.constexpr,
                   REDUCE: tl.constexpr, ALIGN: tl.constexpr, COLS: tl.constexpr):
    _expand_items(tl.program_id(0), tl.num_programs(0), y_ptr, pool_ptr, b_off_ptr, ranks_ptr,
                  scales_ptr, seg_start_ptr, seg_slot_ptr, v_ptr, vsum_ptr, col_ptr, T, n_slots,
                  n_segs, n_ks, max_col_blocks, stride_y, stride_v, budget, s0, s1, s2, s3, s4,
                  N_SLICES, SEG_BLOCK, BLOCK_M, BLOCK_N, RANK_BLOCK, DOT_PREC, UPCAST, KS_MAX,
                  USE_PDL, REDUCE, ALIGN, COLS)


@triton.jit(do_not_specialize=tuple(a for a in PER_STEP if a != "budget"))
def _one_launch_kernel(y_ptr, x_ptr, pool_ptr, a_off_ptr, b_off_ptr, ranks_ptr, scales_ptr,
                       seg_start_ptr, seg_slot_ptr, v_ptr, bar_ptr, K, T, n_slots, n_segs,
                       n_ks, max_col_blocks, stride_x, stride_y, s0, s1, s2, s3, s4,
                       N_SLICES: tl.constexpr, SEG_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                       RANK_BLOCK: tl.constexpr, DOT_PREC: tl.constexpr,
                       UPCAST: tl.constexpr, STAGES: tl.constexpr, KS_MAX: tl.constexpr,
                       SPIN_LIMIT: tl.constexpr, USE_PDL: tl.constexpr, ALIGN: tl.constexpr):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    _shrink_items(pid, nprog, x_ptr, pool_ptr, a_off_ptr, ranks_ptr, seg_start_ptr,
                  seg_slot_ptr, v_ptr, v_ptr, bar_ptr, K, T, n_slots, n_segs, n_ks, stride_x,
                  nprog, N_SLICES, SEG_BLOCK, BLOCK_M, BLOCK_K, RANK_BLOCK, DOT_PREC, UPCAST,
                  STAGES, USE_PDL, 1, False, KS_MAX, ALIGN)
    _grid_sync(bar_ptr, nprog, SPIN_LIMIT)
    _expand_items(pid, nprog, y_ptr, pool_ptr, b_off_ptr, ranks_ptr, scales_ptr, seg_start_ptr,
                  seg_slot_ptr, v_ptr, v_ptr, ranks_ptr, T, n_slots, n_segs, n_ks,
                  max_col_blocks, stride_y, 0, nprog, s0, s1, s2, s3, s4, N_SLICES, SEG_BLOCK,
                  BLOCK_M, BLOCK_N, RANK_BLOCK, DOT_PREC, UPCAST, KS_MAX, USE_PDL, False, ALIGN,
                  False)
