"""LoRA shrink into column blocks: each row's x @ A.T in its adapter's block, zeros elsewhere.

Semantics (kernels.shrink_blocks.shrink_blocks_ref): out [T, W] with W = n_blocks * RB; for
every segment i (rows R = seg_start[i]:seg_start[i+1]) with slot s = seg_slot[i], block
c = col_slot[s] (-1 when s < 0) and A = pool[a_off[s]:][:r * K].view(r, K), r = ranks[s]:
    out[R, :] = 0
    out[R, c * RB : c * RB + r] = (scales[s] * x[R] @ A.T)        when c >= 0 and a_off[s] >= 0
Shapes: out [T, W] and x [T, K] (unit column stride, any row stride: views of one wider
buffer); pool [P]; a_off int64 [n_slots]; ranks int32 [n_slots] (<= RB); scales fp32
[n_slots]; col_slot int32 [n_slots]; seg_start int32 [S+1]; seg_slot int32 [S]. Rows after
the last segment's end (a captured graph's padding rows) get zeros, so a GEMM over the buffer
reads no stale values there; rows before seg_start[0] are not written.

What it is for: the expand side of column LoRA (services.worker.model.lora_columns). With every
block's Bt stacked under the base weight in K ([K + W, N]), one GEMM over [x | out] gives
x @ W plus each row's expand, so a projection's LoRA is this launch and no expand launch. The
shrink must then finish its reduction over K itself: a program takes one row and one of
`parts` shares of the rank tile, finds the row's segment (a binary search of the segment
table, before the PDL wait), reads its share of A whole (no split over K) and writes zeros
over its share of the other blocks' columns, so the programs of a row write each of its
columns once. The premise is measured by bench/shrink_in_gemm.py (group o, the `row`
variants); the engine's row LoRA (services.worker.model.lora_columns, PerfConfig.lora_rows) uses it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sgmv_ref import BLOCK_COLS as RB   # a block's columns (lora_columns.RANK_TILE)
from kernels.pdl import SGMV_MAX_ROWS, launch_args, wait_then_release
from kernels.sgmv_ref import shrink_blocks_ref  # noqa: F401  (the torch reference)

MAX_BLOCK_K = 4096   # the one-pass chunk (4 rank parts x 4096 of A: 128 values a thread at 4 warps)
SEARCH = 9       # steps of a program's binary search for its row's segment: < 512 segments


@triton.jit(do_not_specialize=("n_segs",))     # per step
def _shrink_blocks_kernel(out_ptr, x_ptr, pool_ptr, a_off_ptr, ranks_ptr, scales_ptr,
                          col_ptr, seg_start_ptr, seg_slot_ptr, n_segs, K, out_rs, x_rs,
                          W: tl.constexpr, RB: tl.constexpr, PARTS: tl.constexpr,
                          BLOCK_K: tl.constexpr, SEARCH: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (row, part): the row's share `part` of the block columns (its adapter's rank
    rows part * RP .. + RP) and zeros over its share of the others."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    RP: tl.constexpr = RB // PARTS          # this program's rank rows
    ZW: tl.constexpr = W // PARTS           # and its share of the columns to zero
    # the row's segment: the last i < n_segs with seg_start[i] <= row (a binary search over
    # the step's table, SEARCH >= log2 of its length)
    lo = row * 0
    hi = lo + n_segs
    for _ in tl.static_range(SEARCH):
        mid = (lo + hi) // 2
        go = tl.load(seg_start_ptr + mid) <= row
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    first = tl.load(seg_start_ptr)
    end = tl.load(seg_start_ptr + n_segs)
    slot = tl.where(row < end, tl.load(seg_slot_ptr + lo), -1)   # after the last: zeros
    safe = tl.maximum(slot, 0)
    blk = tl.where(slot >= 0, tl.load(col_ptr + safe), -1)
    a_off = tl.where(blk >= 0, tl.load(a_off_ptr + safe), -1)
    rank = tl.where(a_off >= 0, tl.load(ranks_ptr + safe), 0)
    scale = tl.load(scales_ptr + safe)
    rr = part * RP + tl.arange(0, RP)                    # rank rows / block columns
    kk = tl.arange(0, BLOCK_K)
    k_live = tl.where(rank > part * RP, K, 0)           # x's length, 0: no rank rows here
    a_rows = pool_ptr + tl.maximum(a_off, 0) + rr[:, None].to(tl.int64) * K
    # the first chunk of A before the wait (adapter weights: written before the step)
    at = tl.load(a_rows + kk[None, :], mask=(rr < rank)[:, None] & (kk < K)[None, :],
                 other=0.0)
    wait_then_release(USE_PDL)              # x is the previous kernel's output
    if row >= first:
        zc = part * ZW + tl.arange(0, ZW)
        o_row = out_ptr + row.to(tl.int64) * out_rs
        tl.store(o_row + zc, tl.zeros((ZW,), out_ptr.dtype.element_ty),
                 mask=(zc < blk * RB) | (zc >= blk * RB + RB))   # blk -1: every column
        if blk >= 0:
            x_row = x_ptr + row.to(tl.int64) * x_rs
            xt = tl.load(x_row + kk, mask=kk < k_live, other=0.0).to(tl.float32)
            acc = tl.sum(at.to(tl.float32) * xt[None, :], axis=1)
            for k0 in range(BLOCK_K, K, BLOCK_K):        # K > BLOCK_K only
                kmask = (k0 + kk) < K
                xt = tl.load(x_row + k0 + kk, mask=(k0 + kk) < k_live, other=0.0).to(tl.float32)
                at = tl.load(a_rows + (k0 + kk)[None, :],
                             mask=(rr < rank)[:, None] & kmask[None, :], other=0.0)
                acc += tl.sum(at.to(tl.float32) * xt[None, :], axis=1)
            tl.store(o_row + blk * RB + rr, (acc * scale).to(out_ptr.dtype.element_ty))


def shrink_blocks(out: torch.Tensor, x: torch.Tensor, pool: torch.Tensor, a_off: torch.Tensor,
                  ranks: torch.Tensor, scales: torch.Tensor, col_slot: torch.Tensor,
                  seg_start: torch.Tensor, seg_slot: torch.Tensor, parts: int = 4,
                  block_k: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """The semantics above, in one launch of (rows, parts) programs: a program's work is one
    row's share of its adapter's A whatever the segments (one adapter over every row costs
    what 32 do). block_k: the K chunk a program loads at a time (default all of K up to
    MAX_BLOCK_K: one pass, its A loaded before the PDL wait). Returns out. Reads no device
    memory on the host (graph-capturable)."""
    _check(out, x, pool, a_off, ranks, scales, col_slot, seg_start, seg_slot, parts)
    n_segs, t_rows = seg_slot.shape[0], out.shape[0]
    block_k = block_k or min(triton.next_power_of_2(x.shape[1]), MAX_BLOCK_K)
    if t_rows == 0:
        return out
    if n_segs == 0:
        return out.zero_()
    _shrink_blocks_kernel[(t_rows, parts)](
        out, x, pool, a_off, ranks, scales, col_slot, seg_start, seg_slot, n_segs,
        x.shape[1], out.stride(0), x.stride(0), W=out.shape[1], RB=RB, PARTS=parts,
        BLOCK_K=block_k, SEARCH=SEARCH, num_warps=num_warps,
        **launch_args(x.device, t_rows <= SGMV_MAX_ROWS))
    return out


def _check(out, x, pool, a_off, ranks, scales, col_slot, seg_start, seg_slot, parts) -> None:
    w = out.shape[1]
    if parts not in (1, 2, 4, 8, 16) or w % RB or (w // parts) & (w // parts - 1):
        raise ValueError(f"out's width {w} must be blocks of {RB} whose share a part "
                         f"(parts={parts}, one of 1, 2, 4, 8, 16) is a power of two")
    if out.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("out and x need unit column strides")
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"out has {out.shape[0]} rows and x {x.shape[0]}")
    if a_off.dim() != 1 or a_off.dtype != torch.int64:
        raise ValueError("a_off is int64 [n_slots] (one slice)")
    n = a_off.shape[0]
    for name, t, dt in (("ranks", ranks, torch.int32), ("scales", scales, torch.float32),
                        ("col_slot", col_slot, torch.int32)):
        if t.dtype != dt or t.shape != (n,):
            raise ValueError(f"{name} must be {dt} [{n}], got {t.dtype} {tuple(t.shape)}")
    if seg_start.shape[0] != seg_slot.shape[0] + 1:
        raise ValueError("seg_start needs one more entry than seg_slot")
    if seg_slot.shape[0] >= 1 << SEARCH:
        raise ValueError(f"at most {(1 << SEARCH) - 1} segments, got {seg_slot.shape[0]}")
    if not (out.device == x.device == pool.device == a_off.device):
        raise ValueError("out, x, pool and the tables must be on one device")
