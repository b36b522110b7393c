"""Decode GEMM: y = x @ W.T (+ bias) for few rows, with the LoRA expand in its epilogue.

At decode batch sizes (M <= 128 rows) a projection is a weight stream: W [N, K] is read once and
the tensor cores idle. cuBLAS serves some of these shapes well below the copy rate (on the H200 at
M = 64 the fused q/k/v GEMM runs split-K at 1.9 TB/s plus a reduce launch), and a LoRA batch adds
an expand launch after it. Here one launch streams W in [BLOCK_N, BLOCK_K] tiles (software
pipelined) over all M rows, optionally splits K across programs (the last program of a column
tile to finish sums the partials: an arrival counter per tile that resets itself, so no memset
and no second launch), and before storing adds each row's LoRA delta:

    y[m, cols] += scale[slot(m)] * v[m] @ Bt[slot(m), slice(cols)]

where v = x @ A.T comes from kernels.sgmv_split.shrink (its fp32 K partials are summed here) and
slot(m) is the adapter of row m's segment. Bt rows are gathered per row (rows of one segment hit
the same lines), rank by rank in an unrolled loop, so all loads are in flight together.

Semantics: `linear_lora(x, w, bias, lora)` equals F.linear(x, w, bias) followed by
sgmv_ref(y, x, *lora) (up to rounding: the delta is added before the single rounding to y's
dtype). Shapes: x [M, K] (unit column stride), w [N, K] contiguous, bias [N] or None; lora as
sgmv_ref's arguments. A column tile must lie within one slice: BLOCK_N divides every slice start
(`fits` says whether a config does). No host syncs: the call can be captured in a CUDA graph.
Split-K calls on one device share the arrival counters: run them on one stream.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from kernels.sgmv_split import _k_split, _live_tiles, shrink
from kernels.sgmv_triton import _check, _slice_bounds

MAX_ROWS = 128          # above this, cuBLAS is compute-efficient enough: use it
MAX_FUSED_RANK = 32     # the epilogue gathers Bt rank by rank; above this expand separately
_MAX_TILES = 1 << 14


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    stages: int = 4
    num_warps: int = 4


@dataclass(frozen=True)
class LoraArgs:
    """The sgmv_ref arguments, minus y and x (see kernels.sgmv_ref)."""
    pool: torch.Tensor
    a_off: torch.Tensor
    b_off: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    slice_starts: Sequence[int]
    seg_start: torch.Tensor
    seg_slot: torch.Tensor
    max_rank: int


def pick_config(m: int, n: int, k: int) -> SkinnyConfig:
    """Tiles by shape; split K when the column tiles alone would not fill the card."""
    cfg = SkinnyConfig()
    tiles = triton.cdiv(n, cfg.block_n)
    split = 1
    while tiles * split < 192 and split < 8 and k // (split * 2) >= 1024:
        split *= 2
    return SkinnyConfig(cfg.block_n, cfg.block_k, split, cfg.stages, cfg.num_warps)


def fits(config: SkinnyConfig, slice_starts: Sequence[int]) -> bool:
    """Whether every column tile of this config lies within one slice."""
    return all(s % config.block_n == 0 for s in slice_starts)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, bias_ptr, part_ptr, cnt_ptr,
                   M, N, K, stride_x, stride_y, k_per_split,
                   pool_ptr, a_off_ptr, b_off_ptr, ranks_ptr, scales_ptr, seg_start_ptr,
                   seg_slot_ptr, v_ptr, n_slots, n_segs, n_ks, budget, s0, s1, s2, s3, s4,
                   HAS_BIAS: tl.constexpr, LORA: tl.constexpr, SPLIT_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   STAGES: tl.constexpr, UPCAST: tl.constexpr,
                   N_SLICES: tl.constexpr, SEG_BLOCK: tl.constexpr, SHRINK_BM: tl.constexpr,
                   RANK_BLOCK: tl.constexpr, KS_MAX: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    rows = rm.to(tl.int64)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_base = x_ptr + rows[:, None] * stride_x
    w_base = w_ptr + rn.to(tl.int64)[:, None] * K
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        k_ok = (k0 + rk) < k_hi
        xt = tl.load(x_base + (k0 + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_base + (k0 + rk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(xt, tl.trans(wt), acc)

    last = pid_k == pid_k            # a tensor flag: does this program finish the tile?
    if SPLIT_K > 1:
        tile = pid_m * tl.num_programs(0) + pid_n
        io = rows[:, None] * N + rn[None, :]
        io_ok = m_ok[:, None] & n_ok[None, :]
        tl.store(part_ptr + pid_k * M * N + io, acc, mask=io_ok)
        tl.debug_barrier()           # every thread's partial is stored before the arrival
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        last = arrived == SPLIT_K - 1
        if last:
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")    # ready for the next call
            tl.debug_barrier()
            for ks in tl.static_range(SPLIT_K):
                other = (rm * 0 + ks) != pid_k
                acc += tl.load(part_ptr + ks * M * N + io, mask=io_ok & other[:, None],
                               other=0.0, cache_modifier=".cg")
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if LORA:
            acc = _lora_epilogue(acc, rm, rn, m_ok, n_ok, pid_n * BLOCK_N, M,
                                 pool_ptr, a_off_ptr, b_off_ptr, ranks_ptr, scales_ptr,
                                 seg_start_ptr, seg_slot_ptr, v_ptr, n_slots, n_segs, n_ks,
                                 budget, s0, s1, s2, s3, s4, N_SLICES, SEG_BLOCK, SHRINK_BM,
                                 BLOCK_M, RANK_BLOCK, KS_MAX)
        tl.store(y_ptr + rows[:, None] * stride_y + rn[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _lora_epilogue(acc, rm, rn, m_ok, n_ok, col0, T, pool_ptr, a_off_ptr, b_off_ptr, ranks_ptr,
                   scales_ptr, seg_start_ptr, seg_slot_ptr, v_ptr, n_slots, n_segs, n_ks,
                   budget, s0, s1, s2, s3, s4, N_SLICES: tl.constexpr,
                   SEG_BLOCK: tl.constexpr, SHRINK_BM: tl.constexpr, BLOCK_M: tl.constexpr,
                   RANK_BLOCK: tl.constexpr, KS_MAX: tl.constexpr):
    """acc[m, :] += scale * v[m] @ Bt for each row's adapter, over this tile's slice."""
    j = (col0 >= s1).to(tl.int32)    # the slice holding the tile (it lies within one)
    if N_SLICES > 2:
        j += (col0 >= s2).to(tl.int32)
    if N_SLICES > 3:
        j += (col0 >= s3).to(tl.int32)
    c_lo, c_hi = _slice_bounds(j, s0, s1, s2, s3, s4, N_SLICES)
    width = c_hi - c_lo
    # row -> segment -> slot, from the segment table (no per-row table on the host)
    si = tl.arange(0, SEG_BLOCK)
    seg_hi = tl.load(seg_start_ptr + si + 1, mask=si < n_segs, other=2147483647)
    row_seg = tl.sum((seg_hi[None, :] <= rm[:, None]).to(tl.int32), axis=1)
    in_seg = m_ok & (row_seg < n_segs)
    slot = tl.load(seg_slot_ptr + row_seg, mask=in_seg, other=-1)
    has = slot >= 0
    a_o = tl.load(a_off_ptr + j * n_slots + slot, mask=has, other=-1)
    b_o = tl.load(b_off_ptr + j * n_slots + slot, mask=has, other=-1)
    live = has & (a_o >= 0) & (b_o >= 0)
    rank = tl.load(ranks_ptr + slot, mask=live, other=0)
    scale = tl.load(scales_ptr + slot, mask=live, other=0.0)
    # the shrink's K partials: as many chunks as it used (the same count from the same table)
    _, _, _, _, tiles, _ = _live_tiles(seg_start_ptr, seg_slot_ptr, n_segs, SEG_BLOCK,
                                       SHRINK_BM)
    used = _k_split(tiles, n_ks, budget, N_SLICES)
    rr = tl.arange(0, RANK_BLOCK)
    v = tl.zeros((BLOCK_M, RANK_BLOCK), dtype=tl.float32)
    for ks in tl.static_range(KS_MAX):
        ok = live & ((rm * 0 + ks) < used)
        v_rows = ((ks * N_SLICES + j) * T + rm).to(tl.int64) * RANK_BLOCK
        v += tl.load(v_ptr + v_rows[:, None] + rr[None, :], mask=ok[:, None], other=0.0,
                     cache_modifier=".cg")
    v = v * scale[:, None]
    cols = (rn - c_lo).to(tl.int64)
    b_row = pool_ptr + b_o[:, None] + cols[None, :]
    for r in tl.static_range(RANK_BLOCK):
        ok = (live & (r < rank))[:, None] & n_ok[None, :]
        bt = tl.load(b_row + r * width, mask=ok, other=0.0).to(tl.float32)
        v_r = tl.sum(tl.where(rr[None, :] == r, v, 0.0), axis=1)
        acc += v_r[:, None] * bt
    return acc


_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """Per-tile arrival counters of split-K calls (int32, zeroed once; each call leaves them 0).
    Allocated on first use, which must not be inside a CUDA-graph capture."""
    key = (device.type, device.index if device.index is not None or device.type != "cuda"
           else torch.cuda.current_device())
    cnt = _COUNTERS.get(key)
    if cnt is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny: call it once before capturing a CUDA graph "
                               "(the split-K counters are allocated on first use)")
        cnt = _COUNTERS[key] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
    return cnt


def linear_lora(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                lora: LoraArgs | None = None, config: SkinnyConfig | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w.T (+ bias) (+ each segment's LoRA delta); see the module docstring."""
    m, k = x.shape
    n = w.shape[0]
    if x.stride(1) != 1 or not w.is_contiguous() or w.shape[1] != k or w.dtype != x.dtype:
        raise ValueError(f"x [M, K] with unit column stride and contiguous w [N, K] of one "
                         f"dtype expected: {tuple(x.shape)} {x.dtype}, {tuple(w.shape)} {w.dtype}")
    if m > MAX_ROWS:
        raise ValueError(f"skinny GEMM is for at most {MAX_ROWS} rows, got {m}")
    cfg = config or pick_config(m, n, k)
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m = max(16, triton.next_power_of_2(m))
    n_tiles = triton.cdiv(n, cfg.block_n)
    split = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    part = cnt = y                   # placeholders when not split
    if split > 1:
        if n_tiles > _MAX_TILES:
            raise ValueError(f"{n_tiles} column tiles exceed the counter table")
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        cnt = _counters(x.device)
    upcast = x.dtype == torch.bfloat16 and not x.is_cuda
    lo = dict(N_SLICES=1, SEG_BLOCK=16, SHRINK_BM=16, RANK_BLOCK=16, KS_MAX=1)
    largs = [y] * 8 + [0, 0, 0, 1, 0, n, n, n, n]
    if lora is not None:
        _check(y, x, lora.pool, lora.a_off, lora.b_off, lora.ranks, lora.scales,
               lora.slice_starts, lora.seg_start, lora.seg_slot)
        if lora.max_rank > MAX_FUSED_RANK or not fits(cfg, lora.slice_starts):
            raise ValueError(f"rank {lora.max_rank} > {MAX_FUSED_RANK} or slices "
                             f"{list(lora.slice_starts)} not multiples of {cfg.block_n}")
        n_slices = len(lora.slice_starts) - 1
        sh = shrink(x, lora.pool, lora.a_off, lora.ranks, lora.seg_start, lora.seg_slot,
                    n_slices, lora.max_rank)
        s = list(lora.slice_starts) + [lora.slice_starts[-1]] * (5 - len(lora.slice_starts))
        largs = [lora.pool, lora.a_off, lora.b_off, lora.ranks, lora.scales, lora.seg_start,
                 lora.seg_slot, sh.v, lora.ranks.shape[0], lora.seg_slot.shape[0],
                 sh.v.shape[0], sh.budget, *s]
        lo = dict(N_SLICES=n_slices, SEG_BLOCK=sh.seg_block, SHRINK_BM=sh.block_m,
                  RANK_BLOCK=sh.v.shape[3], KS_MAX=sh.v.shape[0])
    grid = (n_tiles, split, triton.cdiv(m, block_m))
    _skinny_kernel[grid](
        x, w, y, bias if bias is not None else y, part, cnt, m, n, k, x.stride(0), y.stride(0),
        k_per_split, *largs, HAS_BIAS=bias is not None, LORA=lora is not None, SPLIT_K=split,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.stages,
        UPCAST=upcast, num_warps=cfg.num_warps, num_stages=1, **lo)
    return y
