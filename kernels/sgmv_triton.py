"""Triton SGMV LoRA: shrink and expand fused in one launch, over contiguous adapter segments.

Semantics (those of kernels.sgmv_ref.sgmv_ref): for every segment i with slot s = seg_slot[i] >= 0
and every slice j with a_off[j, s] >= 0, rows R = seg_start[i]:seg_start[i+1], C = slice j's columns
    y[R, C] += scales[s] * (x[R] @ A_js.T) @ Bt_js
    A_js = pool[a_off[j, s]:][:r * K].view(r, K);  Bt_js = pool[b_off[j, s]:][:r * N_j].view(r, N_j)
with r = ranks[s] <= max_rank. Shapes: y [T, N_total]; x [T, K]; pool [P]; a_off, b_off int64
[n_slices, n_slots]; ranks int32 [n_slots]; scales fp32 [n_slots]; seg_start int32 [S+1];
seg_slot int32 [S]; slice_starts: host ints (at most MAX_SLICES slices).

Design. One persistent launch; the grid is a fixed number of programs (a couple per SM, fewer when
the batch is small), never the pool size. Each program reads the segment table once, counts the
row tiles of live segments (BLOCK_M rows each; base-only and padded segments count zero, so they
cost nothing), and walks work items (row tile, slice, column split) in a grid-stride loop. A work
item computes the tile's shrink v = scale * x[rows] @ A.T in registers (fp32 accumulation over K;
the rank is padded to the constexpr RANK_BLOCK and masked by the slot's rank, so weights stay
rank-exact in memory), then expands v over its share of the slice's column blocks into y. The number
of column splits is chosen in the kernel from the live tile count: few tiles (decode, one adapter)
split the columns so every SM has work and only the small shrink is recomputed; many tiles get one
split so A and B are read once. Nothing in the wrapper reads device memory: it can be captured in
a CUDA graph.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import launch_args, wait_then_release
from kernels.sgmv_choice import rank_tile, seg_block

MAX_SLICES = 4
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _slice_bounds(j, s0, s1, s2, s3, s4, N_SLICES: tl.constexpr):
    """Column range [lo, hi) of slice j, picked from scalar arguments (no device table)."""
    lo = s0
    hi = s1
    if N_SLICES > 1:
        lo = tl.where(j == 1, s1, lo)
        hi = tl.where(j == 1, s2, hi)
    if N_SLICES > 2:
        lo = tl.where(j == 2, s2, lo)
        hi = tl.where(j == 2, s3, hi)
    if N_SLICES > 3:
        lo = tl.where(j == 3, s3, lo)
        hi = tl.where(j == 3, s4, hi)
    return lo, hi


@triton.jit
def _live_tiles(seg_start_ptr, seg_slot_ptr, n_segs, SEG_BLOCK: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """The segment table as row tiles: (segment index, first row, end row, slot, tiles of each
    live segment (0 for base-only and padded ones), their running sum)."""
    si = tl.arange(0, SEG_BLOCK)
    s_ok = si < n_segs
    lo = tl.load(seg_start_ptr + si, mask=s_ok, other=0)
    hi = tl.load(seg_start_ptr + si + 1, mask=s_ok, other=0)
    slot = tl.load(seg_slot_ptr + si, mask=s_ok, other=-1)
    tiles = tl.where(slot >= 0, (tl.maximum(hi - lo, 0) + BLOCK_M - 1) // BLOCK_M, 0)
    return si, lo, hi, slot, tiles, tl.cumsum(tiles, axis=0)


@triton.jit
def _locate(tile, si, lo, hi, slot, tiles, tiles_end, BLOCK_M: tl.constexpr):
    """(slot, first row, row count) of row tile `tile`, counting tiles of live segments only."""
    pick = si == tl.sum((tiles_end <= tile).to(tl.int32))        # the segment holding the tile
    s = tl.sum(tl.where(pick, slot, 0))
    first_tile = tl.sum(tl.where(pick, tiles_end - tiles, 0))
    row0 = tl.sum(tl.where(pick, lo, 0)) + (tile - first_tile) * BLOCK_M
    m_len = tl.minimum(tl.sum(tl.where(pick, hi, 0)) - row0, BLOCK_M)
    return s, row0, m_len


@triton.jit
def _lora_tile(y_ptr, x_ptr, pool_ptr, a_o, b_o, row0, m_len, K, width, col0, nb0, nb1, rank,
               scale, stride_x, stride_y,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               RANK_BLOCK: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr,
               UPCAST: tl.constexpr, STAGES: tl.constexpr):
    """y[row0:row0+m_len, col0 + cols of blocks nb0:nb1] += (scale * x[rows] @ A.T) @ Bt.

    UPCAST (interpreter only) feeds tl.dot fp32 copies of bf16 operands: the interpreter cannot
    multiply bf16 (it multiplies the stored bit patterns); the values are the same.
    """
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    rr = tl.arange(0, RANK_BLOCK)
    rn = tl.arange(0, BLOCK_N)
    row_ok = rm < m_len
    r_ok = rr < rank
    rows = (row0 + rm).to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * stride_x + rk[None, :]
    a_ptrs = pool_ptr + a_o + rr[:, None] * K + rk[None, :]
    acc = tl.zeros((BLOCK_M, RANK_BLOCK), dtype=tl.float32)       # v = x @ A.T, [BM, RB]
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            at = tl.load(a_ptrs, mask=r_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + rk) < K
            xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc = tl.dot(xt, tl.trans(at), acc, input_precision=DOT_PREC)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    v = (acc * scale).to(pool_ptr.dtype.element_ty)
    if UPCAST:
        v = v.to(tl.float32)
    b_ptrs = pool_ptr + b_o + rr[:, None] * width + rn[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_y + col0 + rn[None, :]
    for nb in range(nb0, nb1):       # not software-pipelined: it stores into y
        cols = nb * BLOCK_N + rn
        c_ok = cols < width
        bt = tl.load(b_ptrs + nb * BLOCK_N, mask=r_ok[:, None] & c_ok[None, :], other=0.0)
        if UPCAST:
            bt = bt.to(tl.float32)
        delta = tl.dot(v, bt, input_precision=DOT_PREC)           # [BM, BN] fp32
        io_ok = row_ok[:, None] & c_ok[None, :]
        old = tl.load(y_ptrs + nb * BLOCK_N, mask=io_ok, other=0.0)
        new = (old.to(tl.float32) + delta).to(y_ptr.dtype.element_ty)
        tl.store(y_ptrs + nb * BLOCK_N, new, mask=io_ok)


@triton.jit(do_not_specialize=("n_segs",))   # per step: see sgmv_split_kernels.PER_STEP
def _sgmv_kernel(y_ptr, x_ptr, pool_ptr, a_off_ptr, b_off_ptr, ranks_ptr, scales_ptr,
                 seg_start_ptr, seg_slot_ptr, K, n_slots, n_segs, max_col_blocks,
                 stride_x, stride_y, s0, s1, s2, s3, s4,
                 N_SLICES: tl.constexpr, SEG_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RANK_BLOCK: tl.constexpr,
                 EVEN_K: tl.constexpr, ALIGN: tl.constexpr, DOT_PREC: tl.constexpr,
                 UPCAST: tl.constexpr, STAGES: tl.constexpr, NARROW_N: tl.constexpr,
                 NARROW_K: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    si, lo, hi, slot, tiles, tiles_end = _live_tiles(seg_start_ptr, seg_slot_ptr, n_segs,
                                                     SEG_BLOCK, BLOCK_M)
    wait_then_release(USE_PDL)      # the step's tables before the wait (kernels.pdl), x after
    base = tl.sum(tiles) * N_SLICES
    # Column splits: enough work items to occupy the grid, at most one split per column block.
    n_split = tl.minimum(tl.maximum(nprog // tl.maximum(base, 1), 1), max_col_blocks)
    per_tile = N_SLICES * n_split
    for w in range(pid, base * n_split, nprog):
        tile = w // per_tile
        j = (w % per_tile) // n_split
        s, row0, m_len = _locate(tile, si, lo, hi, slot, tiles, tiles_end, BLOCK_M)
        col0, col1 = _slice_bounds(j, s0, s1, s2, s3, s4, N_SLICES)
        width = col1 - col0
        n_blocks = (width + BLOCK_N - 1) // BLOCK_N
        per_split = (n_blocks + n_split - 1) // n_split
        nb0 = (w % n_split) * per_split
        nb1 = tl.minimum(nb0 + per_split, n_blocks)
        a_o = tl.load(a_off_ptr + j * n_slots + s)
        b_o = tl.load(b_off_ptr + j * n_slots + s)
        if (a_o >= 0) & (nb0 < nb1):
            rank = tl.load(ranks_ptr + s)
            scale = tl.load(scales_ptr + s)
            # Offsets come from device memory, so the compiler cannot see their alignment. In
            # the aligned branch (o // ALIGN) * ALIGN == o, written so the compiler can prove
            # 16-byte alignment and load A and Bt in 16-byte vectors. (tl.multiple_of would tag
            # the load itself and wrongly apply to the unaligned branch too.)
            if ((a_o % ALIGN) == 0) & ((b_o % ALIGN) == 0) & ((width % ALIGN) == 0):
                _lora_tile(y_ptr, x_ptr, pool_ptr, (a_o // ALIGN) * ALIGN,
                           (b_o // ALIGN) * ALIGN, row0, m_len, K, (width // ALIGN) * ALIGN,
                           col0, nb0, nb1, rank, scale, stride_x, stride_y, BLOCK_M, BLOCK_N,
                           BLOCK_K, RANK_BLOCK, EVEN_K, DOT_PREC, UPCAST, STAGES)
            else:                 # rare: narrow unpipelined tiles keep register use down
                q = BLOCK_N // NARROW_N
                nn1 = tl.minimum(nb1 * q, (width + NARROW_N - 1) // NARROW_N)
                _lora_tile(y_ptr, x_ptr, pool_ptr, a_o, b_o, row0, m_len, K, width, col0,
                           nb0 * q, nn1, rank, scale, stride_x, stride_y, BLOCK_M, NARROW_N,
                           NARROW_K, RANK_BLOCK, EVEN_K, DOT_PREC, UPCAST, 1)


@dataclass(frozen=True)
class SgmvConfig:
    """Tile sizes and launch shape; pick_config chooses them from T, K, the rank bound, dtype."""
    block_m: int
    block_n: int
    block_k: int
    num_programs: int
    num_warps: int = 4
    num_stages: int = 2


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_config(t_rows: int, k: int, max_rank: int, dtype: torch.dtype,
                device: torch.device) -> SgmvConfig:
    """Decode-sized batches take 16-row tiles; long prefill batches take taller tiles. At rank
    <= 32 and up to 8192 rows, 64-row tiles with 128-wide K steps (H200 sweep, 4096 rows: 39.0
    us a call; with 256-wide K steps 57, with 32-row tiles 43)."""
    rb = rank_tile(max_rank)
    elem = 4 if dtype == torch.float32 else 2
    block_m = 16 if t_rows <= 1024 else (32 if t_rows <= 8192 else 64)
    block_k = max(32, min(256, 16384 // (rb * elem), triton.next_power_of_2(k)))
    if 1024 < t_rows <= 8192 and rb <= 32 and elem == 2:
        block_m, block_k = 64, min(block_k, 128)
    block_n = 128 if rb <= 64 else 64
    if device.type == "cuda":
        num_programs = 2 * _sm_count(device.index if device.index is not None else
                                     torch.cuda.current_device())
    else:                                                          # TRITON_INTERPRET=1
        num_programs = 4
    stages = 4 if elem == 2 else 3                  # 4 stages of 16-bit tiles: <= 80 KB smem
    return SgmvConfig(block_m, block_n, block_k, num_programs, num_stages=stages)


def _check(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start, seg_slot):
    """Shape, dtype, contiguity and device checks; metadata only, no device reads."""
    n_slices = len(slice_starts) - 1
    if not 1 <= n_slices <= MAX_SLICES:
        raise ValueError(f"need 1..{MAX_SLICES} slices, got {n_slices}")
    if list(slice_starts) != sorted(slice_starts) or slice_starts[0] != 0:
        raise ValueError(f"slice_starts must rise from 0: {list(slice_starts)}")
    if x.dim() != 2 or y.dim() != 2 or y.shape[0] != x.shape[0]:
        raise ValueError(f"x [T, K], y [T, N] expected: {tuple(x.shape)}, {tuple(y.shape)}")
    if y.shape[1] != slice_starts[-1]:
        raise ValueError(f"y has {y.shape[1]} columns, slices end at {slice_starts[-1]}")
    if x.dtype not in _DTYPES or y.dtype not in _DTYPES or pool.dtype != x.dtype:
        raise TypeError(f"x, pool: one float dtype; got {x.dtype}, {pool.dtype}, y {y.dtype}")
    if x.stride(1) != 1 or y.stride(1) != 1 or pool.dim() != 1 or not pool.is_contiguous():
        raise ValueError("x and y need unit column stride; pool must be contiguous 1-D")
    for name, t, dt in (("a_off", a_off, torch.int64), ("b_off", b_off, torch.int64),
                        ("ranks", ranks, torch.int32), ("scales", scales, torch.float32),
                        ("seg_start", seg_start, torch.int32),
                        ("seg_slot", seg_slot, torch.int32)):
        if t.dtype != dt or not t.is_contiguous() or t.device != x.device:
            raise TypeError(f"{name}: need contiguous {dt} on {x.device}, got {t.dtype} "
                            f"on {t.device}")
    n_slots = ranks.shape[0]
    if a_off.shape != (n_slices, n_slots) or b_off.shape != (n_slices, n_slots):
        raise ValueError(f"a_off/b_off must be [{n_slices}, {n_slots}], got {tuple(a_off.shape)}")
    if scales.shape != (n_slots,) or seg_start.shape != (seg_slot.shape[0] + 1,):
        raise ValueError("scales [n_slots], seg_start [S+1] and seg_slot [S] expected")
    if y.device != x.device or pool.device != x.device:
        raise ValueError("all tensors must be on one device")


def sgmv_triton(y: torch.Tensor, x: torch.Tensor, pool: torch.Tensor, a_off: torch.Tensor,
                b_off: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
                slice_starts: Sequence[int], seg_start: torch.Tensor, seg_slot: torch.Tensor,
                max_rank: int, config: SgmvConfig | None = None) -> torch.Tensor:
    """Add each segment's LoRA delta to its rows of y, in place, in one launch; returns y.

    Same semantics and arguments as kernels.sgmv_ref.sgmv_ref; max_rank bounds every slot's rank
    (it sizes the rank tile). No host syncs, so it can be captured in a CUDA graph.
    """
    _check(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start, seg_slot)
    t_rows, k = x.shape
    n_segs = seg_slot.shape[0]
    if t_rows == 0 or n_segs == 0:
        return y
    cfg = config or pick_config(t_rows, k, max_rank, x.dtype, x.device)
    n_slices = len(slice_starts) - 1
    widths = [slice_starts[j + 1] - slice_starts[j] for j in range(n_slices)]
    max_col_blocks = max(1, triton.cdiv(max(widths), cfg.block_n))
    # Upper bound on work items: live tiles <= cdiv(T, BM) + S, each split at most max_col_blocks.
    bound = (triton.cdiv(t_rows, cfg.block_m) + n_segs) * n_slices * max_col_blocks
    grid = (max(1, min(cfg.num_programs, bound)),)
    s = list(slice_starts) + [slice_starts[-1]] * (MAX_SLICES + 1 - len(slice_starts))
    _sgmv_kernel[grid](
        y, x, pool, a_off, b_off, ranks, scales, seg_start, seg_slot,
        k, ranks.shape[0], n_segs, max_col_blocks, x.stride(0), y.stride(0), *s,
        N_SLICES=n_slices, SEG_BLOCK=seg_block(n_segs),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        RANK_BLOCK=rank_tile(max_rank), EVEN_K=(k % cfg.block_k == 0),
        ALIGN=16 // pool.element_size(),
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=(x.dtype == torch.bfloat16 and not x.is_cuda), STAGES=cfg.num_stages,
        NARROW_N=max(16, cfg.block_n // 4), NARROW_K=max(16, cfg.block_k // 4),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_args(x.device, t_rows <= pdl.SGMV_MAX_ROWS))
    return y
