"""Triton SGMV for decode-sized batches: split-K shrink, then expand — two short launches, or
one launch with a grid barrier between the phases.

Semantics are kernels.sgmv_ref.sgmv_ref's. At decode sizes the work is latency-bound: one
program walking all of K for its rows is a long dependent chain. Here the shrink spreads K over
programs, each writing a partial v = x[rows, Kc] @ A[:, Kc].T into a scratch buffer (fp32, no
atomics, no memset; its K loop software-pipelined), and the expand sums the partials (all loads
in flight together) and adds (scale * v) @ Bt to one column block of y. Both phases walk work
items of live segments only (base-only and padded segments cost nothing); nothing reads device
memory on the host, so a call can be captured in a CUDA graph.

One launch or two (SplitConfig.one_launch; pick_split_config chooses from an H200 sweep). The
one-launch form runs both phases in one persistent launch whose programs meet at a grid barrier
(`_grid_sync`: an arrival counter and a generation word, reset by the last program to arrive, so
the state needs no memset between calls). A barrier inside one launch is only safe when every
program of the grid is resident at once: the first launch of each compiled variant takes one
program per SM, later launches as many as its registers and shared memory allow (at most 4).
A stream must not run two such launches concurrently (each device has one barrier word). On the
H200 the barrier saves a launch but runs fewer programs; it wins only at rank 64 with many
adapters, and only where the two launches go without programmatic dependent launch (before
Hopper, or LORAFLEET_PDL=0): with it they win everywhere. Under TRITON_INTERPRET=1, where
programs run one after another, it runs as one program.

Shapes: as sgmv_ref. Scratch: v [KS, n_slices, T, RANK_BLOCK] fp32, KS = cdiv(K, k_chunk); the
kernels use only as many K chunks (<= KS) as fill the grid once: few live tiles (one adapter,
decode) take many short chunks, many segments take fewer, longer ones. At rank 64+ a shrink item
takes part of the rank tile (SplitConfig.shrink_rank), and with few segments the last K chunk
of each (tile, slice, part) to finish sums the partials into vsum [n_slices, T, RANK_BLOCK]
(SplitConfig.reduce; per-device arrival counters that each call leaves zero), so the expand
reads one partial.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import launch_args, wait_then_release
from kernels.sgmv_ref import rank_tile
from kernels.sgmv_triton import _live_tiles, _locate, _slice_bounds

SPIN_LIMIT = 1 << 22          # barrier polls before a program gives up and flags a timeout


@dataclass(frozen=True)
class SplitConfig:
    """Tiles and launch shape of the split kernel; pick_split_config chooses them."""
    block_m: int = 16         # rows per tile
    block_n: int = 64         # columns per expand step
    k_chunk: int = 256        # the shortest K chunk a shrink item takes
    num_warps: int = 4
    stages: int = 3           # software pipelining of the shrink's K loop
    one_launch: bool = False  # both phases in one launch with a grid barrier (GPU only)
    progs_per_sm: int = 4     # two-launch grids: programs per SM
    block_k: int = 0          # the shrink's K step (0: 128 at rank <= 32, else 64)
    # the rank rows of A one shrink item takes (0: the whole rank tile). Narrower items give
    # more, shorter chains: rank 64 in four 16-row items, with its own grid of
    # shrink_progs_per_sm programs an SM (0: progs_per_sm), as many as rank 16's
    shrink_rank: int = 0
    shrink_progs_per_sm: int = 0
    # the shrink's last K chunk of a (tile, slice, rank part) to finish sums the partials
    # (an arrival counter), so that the expand reads one partial, not one a K chunk
    reduce: bool = False
    # 0: trust the caller's `align` (every A and Bt offset a multiple of that many elements);
    # N > 0: at most N of it (align=1 turns the vector loads of adapter weights off, for A/B)
    align: int = 0


_OVERRIDES: dict = {}        # set_overrides: the engine's PerfConfig.sgmv_split


def set_overrides(text: str) -> None:
    """Fields of SplitConfig set over what pick_split_config chooses, "k_chunk=512,
    progs_per_sm=2" (the engine's build sets its PerfConfig.sgmv_split; A/B runs)."""
    global _OVERRIDES
    _OVERRIDES = parse_overrides(text)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@functools.lru_cache(maxsize=8)
def parse_overrides(text: str) -> dict:
    fields = {f.name: f.type for f in dataclasses.fields(SplitConfig)}
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, val = (part.strip() for part in item.partition("="))
        if key not in fields:
            raise ValueError(f"LORAFLEET_SGMV_SPLIT: unknown field {key!r} ({sorted(fields)})")
        if not eq or not val:
            raise ValueError(f"LORAFLEET_SGMV_SPLIT: {key!r} needs a value ({key}=...)")
        if fields[key] in (bool, "bool"):
            if val.lower() not in _TRUE + _FALSE:
                raise ValueError(f"LORAFLEET_SGMV_SPLIT: {key}={val!r} is not a boolean")
            out[key] = val.lower() in _TRUE
        else:
            try:
                out[key] = int(val)
            except ValueError:
                raise ValueError(f"LORAFLEET_SGMV_SPLIT: {key}={val!r} is not an integer") \
                    from None
    return out


REDUCE_MAX_SEGS = 16     # rank 64+ decode calls with at most this many segments: `reduce`


def pick_split_config(t_rows: int, max_rank: int, pdl_on: bool = True,
                      n_segs: int | None = None, overrides: dict | None = None) -> SplitConfig:
    """The config for T rows and this rank tile (_pick), with the overrides over it (default:
    set_overrides'). pdl_on: whether the two-launch form would launch with programmatic
    dependent launch. n_segs: the length of the call's segment table (live, base-only and
    padded segments: a bound on the adapters present), when the caller knows it."""
    cfg = _pick(t_rows, max_rank, pdl_on, n_segs)
    over = _OVERRIDES if overrides is None else overrides
    return dataclasses.replace(cfg, **over) if over else cfg


def _pick(t_rows: int, max_rank: int, pdl_on: bool, n_segs: int | None = None) -> SplitConfig:
    """The launch shape for T rows at this rank tile. Up to 256 rows: 16-row tiles, 256-wide K
    chunks and 128-column expand steps; grids of as many programs an SM as the registers leave
    resident (tests/test_sgmv.py checks it with ptxas): four at rank 16, three at 32, two at
    64+; above 16 rows the one-launch form only where two launches would go without PDL. At
    rank 64+ the shrink cuts the rank tile in items of 32 rows of A on a grid of four programs
    an SM; with at most REDUCE_MAX_SEGS segments it also sums the partials (`reduce`), and
    segments of 24+ rows on average take 32-row tiles. Above 256 rows: 64-row tiles, 512-wide K
    chunks, two launches. The measurements: bench/PERF_NOTES.md, "Why the defaults"."""
    big_rank = max_rank > 32
    if t_rows > 256:                 # prefill-sized: 64-row tiles, K in 512-wide chunks
        return SplitConfig(block_m=64, block_n=128 if big_rank else 256, k_chunk=512)
    if not big_rank:     # the rank-32 expand holds 166 registers a thread: three an SM
        return SplitConfig(block_n=128, progs_per_sm=4 if max_rank <= 16 else 3)
    # rank 64+: the shrink takes 32 rows of A an item, four programs an SM; with few segments
    # it sums the partials too
    if n_segs is not None and n_segs <= REDUCE_MAX_SEGS:
        narrow = t_rows <= 64
        return SplitConfig(block_m=32 if t_rows // n_segs >= 24 else 16, block_n=128,
                           progs_per_sm=2, one_launch=t_rows > 16 and not pdl_on,
                           shrink_rank=16 if narrow else 32,
                           shrink_progs_per_sm=4 if narrow else 3, reduce=True)
    return SplitConfig(block_n=128, progs_per_sm=2, one_launch=t_rows > 16 and not pdl_on,
                       shrink_rank=32, shrink_progs_per_sm=4)


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
# mid-serving, whenever a step met a new one (20-60 such compiles in a served run).
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


@triton.jit
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


@functools.lru_cache(maxsize=None)
def _sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_BARRIERS: dict[tuple[str, int | None], torch.Tensor] = {}
_PER_SM: dict[tuple, int] = {}     # (device, constexprs) -> one-launch programs resident per SM
N_COUNTERS = 8192       # (tile, slice, rank part) arrival counters a device keeps for `reduce`
_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


def _device_words(table: dict, device: torch.device, n: int, what: str) -> torch.Tensor:
    """The device's n int32 words in `table`, zeroed once, allocated on first use, which must
    not be inside a CUDA-graph capture (warm up first)."""
    key = _device_key(device)
    words = table.get(key)
    if words is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"sgmv_split: call it once before capturing a CUDA graph "
                               f"(the {what} is allocated on first use)")
        words = table[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return words


def barrier_state(device: torch.device) -> torch.Tensor:
    """The device's barrier words [count, generation, timeout flag, unused] (int32, zeroed once;
    allocated on first use, not inside a capture)."""
    return _device_words(_BARRIERS, device, 4, "barrier state")


def arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's N_COUNTERS arrival counters of the reducing shrink (int32, zeroed once; each
    call leaves them zero; allocated on first use, not inside a capture). Like the barrier, one
    set a device: two reducing shrinks must not run at once (a stream runs one kernel at a
    time; a second stream would need its own set)."""
    return _device_words(_COUNTERS, device, N_COUNTERS, "arrival counter set")


def barrier_timeouts(device: torch.device) -> bool:
    """Whether a one-launch call on this device ever gave up waiting at its grid barrier (its
    output was then wrong). Reads device memory: a sync, so not for the step path."""
    state = _BARRIERS.get(_device_key(device))
    return bool(state is not None and state[2].item())


def _device_key(device: torch.device) -> tuple[str, int | None]:
    """cuda and cuda:N name one device when N is the current one."""
    if device.type == "cuda" and device.index is None:
        return device.type, torch.cuda.current_device()
    return device.type, device.index


def _resident_per_sm(compiled, num_warps: int) -> int:
    """How many programs of a compiled kernel an SM holds at once (Hopper: 64K registers, 227 KB
    shared memory, 64 warps), at most 4; 1 when the compiled kernel says nothing."""
    regs, shared = getattr(compiled, "n_regs", None), getattr(
        getattr(compiled, "metadata", None), "shared", None)
    if not regs:
        return 1
    threads = 32 * num_warps
    by_regs = 65536 // (((regs + 7) // 8 * 8) * threads)
    by_smem = (227 * 1024) // shared if shared else 32
    return max(1, min(4, by_regs, by_smem, 64 // num_warps))


def _align(cfg: SplitConfig, align: int) -> int:
    """The offsets' alignment the kernels assume: the caller's promise, capped by cfg.align."""
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    return align if cfg.align == 0 else math.gcd(cfg.align, align)


def _block_k(cfg: SplitConfig, rank_block: int) -> int:
    return min(cfg.k_chunk, cfg.block_k or (128 if rank_block <= 32 else 64))


def _progs(device: torch.device, per_sm: int = 4) -> int:
    """Programs of a two-launch call's grid: per_sm per SM (4 under TRITON_INTERPRET=1)."""
    if device.type != "cuda":
        return 4
    return per_sm * _sms(device.index if device.index is not None else
                         torch.cuda.current_device())


def _rank_split(cfg: SplitConfig, rank_block: int) -> int:
    """How many items a shrink cuts the rank tile into (parts of at least 16 rows of A)."""
    part = min(rank_block, max(16, cfg.shrink_rank or rank_block))
    return rank_block // part


def _launch_shrink(x, pool, a_off, ranks, seg_start, seg_slot, v, vsum, tiles_bound, block_k,
                   cfg: SplitConfig, common) -> int:
    """The shrink phase alone: v[ks, slice, rows] partials (and, given vsum, their sum there).
    Returns the `budget` that the reader of v passes so that it sums the same number of K
    chunks: the grid size, over the rank parts (each K chunk of a tile and slice is that many
    items)."""
    n_ks, n_slices = v.shape[0], v.shape[1]
    split = _rank_split(cfg, v.shape[3])
    per_sm = cfg.shrink_progs_per_sm or cfg.progs_per_sm
    grid = max(1, min(_progs(x.device, per_sm), tiles_bound * n_slices * n_ks * split))
    budget = max(1, grid // split)
    reduce = vsum is not None
    _shrink_kernel[(grid,)](
        x, pool, a_off, ranks, seg_start, seg_slot, v, vsum if reduce else v,
        arrival_counters(x.device) if reduce else v, x.shape[1], x.shape[0], ranks.shape[0],
        seg_slot.shape[0], n_ks, x.stride(0), budget, BLOCK_K=block_k, STAGES=cfg.stages,
        RANK_SPLIT=split, REDUCE=reduce, KS_MAX=n_ks, **common,
        **launch_args(x.device, x.shape[0] <= pdl.SGMV_MAX_ROWS))
    return budget


@dataclass
class Shrunk:
    """The output of `shrink`: what an expand (or a GEMM epilogue) needs to read v."""
    v: torch.Tensor        # fp32 [KS, n_slices, T, RANK_BLOCK] partial sums over K chunks
    budget: int            # from the shrink's grid size: fixes how many chunks are live
    block_m: int           # the shrink's row tile
    seg_block: int
    vsum: torch.Tensor | None = None   # fp32 [n_slices, T, RANK_BLOCK]: their sum (reduce)


def shrink(x, pool, a_off, ranks, seg_start, seg_slot, n_slices: int, max_rank: int,
           config: SplitConfig | None = None, align: int = 1) -> Shrunk:
    """Only the shrink phase of sgmv_split, for a consumer that applies Bt itself
    (a GEMM epilogue). Arguments as sgmv_split's; no device reads."""
    t_rows, k = x.shape
    n_segs = seg_slot.shape[0]
    cfg = config or pick_split_config(t_rows, max_rank, n_segs=n_segs)
    rb = rank_tile(max_rank)
    n_ks = triton.cdiv(k, cfg.k_chunk)
    v = torch.empty((n_ks, n_slices, t_rows, rb), dtype=torch.float32, device=x.device)
    seg_block = max(16, triton.next_power_of_2(n_segs))
    common = dict(N_SLICES=n_slices, SEG_BLOCK=seg_block, BLOCK_M=cfg.block_m, RANK_BLOCK=rb,
                  DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
                  UPCAST=x.dtype == torch.bfloat16 and not x.is_cuda, ALIGN=_align(cfg, align),
                  num_warps=cfg.num_warps, num_stages=1)
    tiles_bound = triton.cdiv(t_rows, cfg.block_m) + n_segs
    vsum = None
    if cfg.reduce and tiles_bound * n_slices * _rank_split(cfg, rb) <= N_COUNTERS:
        vsum = torch.empty((n_slices, t_rows, rb), dtype=torch.float32, device=x.device)
    budget = _launch_shrink(x, pool, a_off, ranks, seg_start, seg_slot, v, vsum, tiles_bound,
                            _block_k(cfg, rb // _rank_split(cfg, rb)), cfg, common)
    return Shrunk(v, budget, cfg.block_m, seg_block, vsum)


def expand(y, shrunk: Shrunk, pool, b_off, ranks, scales, slice_starts, seg_start, seg_slot,
           max_rank: int, config: SplitConfig | None = None, align: int = 1) -> torch.Tensor:
    """The expand phase of sgmv_split over the partials of an earlier `shrink` call with the
    same segments: y[rows, slice] += scale * v @ Bt, in place. No device reads."""
    t_rows = y.shape[0]
    n_segs = seg_slot.shape[0]
    if t_rows == 0 or n_segs == 0:
        return y
    cfg = config or pick_split_config(t_rows, max_rank, n_segs=n_segs)
    v = shrunk.v
    reduce = shrunk.vsum is not None
    return _launch_expand(y, pool, b_off, ranks, scales, slice_starts, seg_start, seg_slot, cfg,
                          align, v=v, vsum=shrunk.vsum if reduce else v, col_slot=ranks,
                          stride_v=0, n_ks=v.shape[0], budget=shrunk.budget,
                          block_m=shrunk.block_m, seg_block=shrunk.seg_block,
                          rank_block=v.shape[3], reduce=reduce, cols=False)


def _launch_expand(y, pool, b_off, ranks, scales, slice_starts, seg_start, seg_slot,
                   cfg: SplitConfig, align: int, *, v, vsum, col_slot, stride_v: int, n_ks: int,
                   budget: int | None, block_m: int, seg_block: int, rank_block: int,
                   reduce: bool, cols: bool) -> torch.Tensor:
    """The expand kernel's launch for expand (partials) and expand_columns (GEMM columns);
    budget None: the grid size."""
    t_rows, n_segs = y.shape[0], seg_slot.shape[0]
    n_slices = len(slice_starts) - 1
    widths = [slice_starts[i + 1] - slice_starts[i] for i in range(n_slices)]
    max_col_blocks = triton.cdiv(max(widths), cfg.block_n)
    tiles_bound = triton.cdiv(t_rows, block_m) + n_segs
    s = list(slice_starts) + [slice_starts[-1]] * (5 - len(slice_starts))
    grid = max(1, min(_progs(y.device, cfg.progs_per_sm),
                      tiles_bound * n_slices * max_col_blocks))
    _expand_kernel[(grid,)](
        y, pool, b_off, ranks, scales, seg_start, seg_slot, v, vsum, col_slot, t_rows,
        ranks.shape[0], n_segs, n_ks, max_col_blocks, y.stride(0), stride_v,
        grid if budget is None else budget, *s, BLOCK_N=cfg.block_n, KS_MAX=n_ks,
        REDUCE=reduce, COLS=cols, ALIGN=_align(cfg, align), N_SLICES=n_slices,
        SEG_BLOCK=seg_block, BLOCK_M=block_m, RANK_BLOCK=rank_block,
        DOT_PREC="ieee" if y.dtype == torch.float32 else "tf32",
        UPCAST=y.dtype == torch.bfloat16 and not y.is_cuda, num_warps=cfg.num_warps,
        num_stages=1, **launch_args(y.device, t_rows <= pdl.SGMV_MAX_ROWS))
    return y


def expand_columns(y, v_cols, col_slot, pool, b_off, ranks, scales, slice_starts, seg_start,
                   seg_slot, max_rank: int, config: SplitConfig | None = None,
                   align: int = 1) -> torch.Tensor:
    """The split expand with v read from columns of the base GEMM's output instead of the
    shrink's partials (the engine's column LoRA: each adapter's A sits as extra rows of the
    base weight, so x @ [W; A...].T gives y and every x @ A.T at once). For a segment with slot
    s and c = col_slot[s] >= 0, slice j's v is v_cols[rows, (c * n_slices + j) * RANK_BLOCK:
    + RANK_BLOCK] (RANK_BLOCK = rank_tile(max_rank); columns past the adapter's rank hold
    zeros); segments whose slot has no column block get nothing. Then y[rows, slice j] +=
    (scale * v) @ Bt as expand does. v_cols [T, >= n_col_slots * n_slices * RANK_BLOCK] (a
    strided view is fine: unit column stride); col_slot int32 [n_slots]. No device reads."""
    t_rows = y.shape[0]
    n_segs = seg_slot.shape[0]
    if t_rows == 0 or n_segs == 0:
        return y
    if v_cols.stride(1) != 1 or v_cols.shape[0] != t_rows:
        raise ValueError("v_cols must be [T, columns] with unit column stride")
    cfg = config or pick_split_config(t_rows, max_rank, n_segs=n_segs)
    return _launch_expand(y, pool, b_off, ranks, scales, slice_starts, seg_start, seg_slot, cfg,
                          align, v=v_cols, vsum=v_cols, col_slot=col_slot,
                          stride_v=v_cols.stride(0), n_ks=1, budget=None,
                          block_m=cfg.block_m, seg_block=max(16, triton.next_power_of_2(n_segs)),
                          rank_block=rank_tile(max_rank), reduce=False, cols=True)


def sgmv_split(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start, seg_slot,
               max_rank: int, config: SplitConfig | None = None, *, k_chunk: int | None = None,
               block_n: int | None = None, align: int = 1) -> torch.Tensor:
    """Same contract as kernels.sgmv_ref.sgmv_ref (checked by the caller); returns y.

    config defaults to pick_split_config(T, max_rank, n_segs=len(seg_slot)); k_chunk and
    block_n override its fields. align: the caller's promise that every offset in a_off and
    b_off (>= 0) is a multiple of this many elements (the worker's pool: 8). The kernels then
    load A and Bt in 16-byte vectors; without it the compiler, which cannot see the alignment
    of an offset read from memory, loads them an element at a time (bench/PERF_NOTES.md,
    "Why the defaults").
    """
    t_rows, k = x.shape
    n_segs = seg_slot.shape[0]
    if t_rows == 0 or n_segs == 0:
        return y
    cfg = config or pick_split_config(
        t_rows, max_rank, pdl.enabled(x.device) and t_rows <= pdl.SGMV_MAX_ROWS, n_segs)
    cfg = dataclasses.replace(cfg, k_chunk=k_chunk or cfg.k_chunk, block_n=block_n or cfg.block_n)
    n_slices = len(slice_starts) - 1
    if not cfg.one_launch:
        shrunk = shrink(x, pool, a_off, ranks, seg_start, seg_slot, n_slices, max_rank, cfg,
                        align)
        return expand(y, shrunk, pool, b_off, ranks, scales, slice_starts, seg_start, seg_slot,
                      max_rank, cfg, align)
    # One launch, without PDL (on the H200 PDL made it 1.2 us slower at rank 64, 64-256 rows).
    # The grid barrier needs every program resident at once: the first launch of a
    # compiled variant takes one program per SM (always resident), later ones as many as its
    # registers and shared memory allow (at most 4 per SM). The interpreter runs programs one
    # by one, so there the grid is one program.
    k_chunk, block_n, on_gpu = cfg.k_chunk, cfg.block_n, x.is_cuda
    rb = rank_tile(max_rank)
    block_m = cfg.block_m
    block_k = _block_k(cfg, rb)
    n_ks = triton.cdiv(k, k_chunk)
    v = torch.empty((n_ks, n_slices, t_rows, rb), dtype=torch.float32, device=x.device)
    widths = [slice_starts[i + 1] - slice_starts[i] for i in range(n_slices)]
    max_col_blocks = triton.cdiv(max(widths), block_n)
    tiles_bound = triton.cdiv(t_rows, block_m) + n_segs
    seg_block = max(16, triton.next_power_of_2(n_segs))
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    upcast = x.dtype == torch.bfloat16 and not on_gpu
    s = list(slice_starts) + [slice_starts[-1]] * (5 - len(slice_starts))
    common = dict(N_SLICES=n_slices, SEG_BLOCK=seg_block, BLOCK_M=block_m, RANK_BLOCK=rb,
                  DOT_PREC=prec, UPCAST=upcast, num_warps=cfg.num_warps, num_stages=1)
    dev_index = x.device.index if x.device.index is not None else (
        torch.cuda.current_device() if on_gpu else 0)
    consts = dict(common, BLOCK_K=block_k, BLOCK_N=block_n, STAGES=cfg.stages, KS_MAX=n_ks,
                  SPIN_LIMIT=SPIN_LIMIT, ALIGN=_align(cfg, align))
    key = (dev_index, x.dtype, tuple(sorted(consts.items())))
    bound = tiles_bound * n_slices * max(n_ks, max_col_blocks)
    per_sm = _PER_SM.get(key, 1)
    grid = max(1, min(per_sm * _sms(dev_index), bound)) if on_gpu else 1
    compiled = _one_launch_kernel[(grid,)](
        y, x, pool, a_off, b_off, ranks, scales, seg_start, seg_slot, v,
        barrier_state(x.device), k, t_rows, ranks.shape[0], n_segs, n_ks, max_col_blocks,
        x.stride(0), y.stride(0), *s, **consts, USE_PDL=False, launch_pdl=False)
    if on_gpu and key not in _PER_SM:
        _PER_SM[key] = _resident_per_sm(compiled, cfg.num_warps)
    return y
