"""LoRA shrink into column blocks: each row's x @ A.T in its adapter's block, zeros elsewhere.

Semantics (kernels.shrink_blocks.shrink_blocks_ref): out [T, W] with W = n_blocks * RB; for
every segment i (rows R = seg_start[i]:seg_start[i+1]) with slot s = seg_slot[i], block
c = col_slot[s] (-1 when s < 0) and A = pool[a_off[s]:][:r * K].view(r, K), r = ranks[s]:
    out[R, :] = 0
    out[R, c * RB : c * RB + r] = (scales[s] * x[R] @ A.T)        when c >= 0 and a_off[s] >= 0
Shapes: out [T, W] and x [T, K] (unit column stride, any row stride: views of one wider
buffer); pool [P]; a_off int64 [n_slots]; ranks int32 [n_slots] (<= RB); scales fp32
[n_slots]; col_slot int32 [n_slots]; seg_start int32 [S+1]; seg_slot int32 [S]. Rows no
segment covers are not written.

What it is for: the expand side of column LoRA (services.worker.lora_columns). With every
block's Bt stacked under the base weight in K ([K + W, N]), one GEMM over [x | out] gives
x @ W plus each row's expand, so a projection's LoRA is this launch and no expand launch. The
shrink must then finish its reduction over K itself: a program takes one segment and one of
`parts` shares of the rank tile, and reads its share of A whole (no split over K), writing
zeros over its share of the other blocks' columns, so the programs of a segment write every
column of its rows once. The premise is measured by bench/shrink_in_gemm.py (group o, the
`row` variants) before the engine uses it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

RB = 16          # a block's columns: the rank tile of column LoRA (lora_columns.RANK_TILE)


@triton.jit
def _shrink_blocks_kernel(out_ptr, x_ptr, pool_ptr, a_off_ptr, ranks_ptr, scales_ptr,
                          col_ptr, seg_start_ptr, seg_slot_ptr, K, out_rs, x_rs,
                          W: tl.constexpr, RB: tl.constexpr, PARTS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    seg = tl.program_id(0)
    part = tl.program_id(1)
    RP: tl.constexpr = RB // PARTS          # this program's rank rows
    ZW: tl.constexpr = W // PARTS           # and its share of the columns to zero
    lo = tl.load(seg_start_ptr + seg)
    hi = tl.load(seg_start_ptr + seg + 1)
    slot = tl.load(seg_slot_ptr + seg)
    safe = tl.maximum(slot, 0)
    blk = tl.where(slot >= 0, tl.load(col_ptr + safe), -1)
    a_off = tl.where(blk >= 0, tl.load(a_off_ptr + safe), -1)
    rank = tl.where(a_off >= 0, tl.load(ranks_ptr + safe), 0)
    scale = tl.load(scales_ptr + safe)
    zc = part * ZW + tl.arange(0, ZW)
    zmask = (zc < blk * RB) | (zc >= blk * RB + RB)      # blk -1: every column
    rr = part * RP + tl.arange(0, RP)                    # rank rows of A / block columns
    kk = tl.arange(0, BLOCK_K)
    a_base = pool_ptr + tl.maximum(a_off, 0)
    for m0 in range(lo, hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < hi
        o_rows = out_ptr + rows[:, None].to(tl.int64) * out_rs
        tl.store(o_rows + zc[None, :], tl.zeros((BLOCK_M, ZW), out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & zmask[None, :])
        if blk >= 0:
            acc = tl.zeros((BLOCK_M, RP), dtype=tl.float32)
            x_rows = x_ptr + rows[:, None].to(tl.int64) * x_rs
            for k0 in range(0, K, BLOCK_K):
                kmask = (k0 + kk) < K
                xt = tl.load(x_rows + (k0 + kk)[None, :], mask=rmask[:, None] & kmask[None, :],
                             other=0.0).to(tl.float32)
                at = tl.load(a_base + rr[:, None].to(tl.int64) * K + (k0 + kk)[None, :],
                             mask=(rr < rank)[:, None] & kmask[None, :], other=0.0)
                acc += tl.sum(xt[:, None, :] * at.to(tl.float32)[None, :, :], axis=2)
            tl.store(o_rows + (blk * RB + rr)[None, :],
                     (acc * scale).to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def shrink_blocks(out: torch.Tensor, x: torch.Tensor, pool: torch.Tensor, a_off: torch.Tensor,
                  ranks: torch.Tensor, scales: torch.Tensor, col_slot: torch.Tensor,
                  seg_start: torch.Tensor, seg_slot: torch.Tensor, parts: int = 1,
                  block_m: int = 4, block_k: int = 128) -> torch.Tensor:
    """The semantics above, in one launch of (segments, parts) programs; returns out. Reads
    no device memory on the host (graph-capturable)."""
    _check(out, x, pool, a_off, ranks, scales, col_slot, seg_start, seg_slot, parts)
    n_segs = seg_slot.shape[0]
    if n_segs == 0 or out.shape[0] == 0:
        return out
    _shrink_blocks_kernel[(n_segs, parts)](
        out, x, pool, a_off, ranks, scales, col_slot, seg_start, seg_slot, x.shape[1],
        out.stride(0), x.stride(0), W=out.shape[1], RB=RB, PARTS=parts, BLOCK_M=block_m,
        BLOCK_K=block_k)
    return out


def _check(out, x, pool, a_off, ranks, scales, col_slot, seg_start, seg_slot, parts) -> None:
    w = out.shape[1]
    if parts not in (1, 2, 4, 8) or w % RB or (w // parts) & (w // parts - 1):
        raise ValueError(f"out's width {w} must be blocks of {RB} whose share a part "
                         f"(parts={parts}, one of 1, 2, 4, 8) is a power of two")
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
    if not (out.device == x.device == pool.device == a_off.device):
        raise ValueError("out, x, pool and the tables must be on one device")


def shrink_blocks_ref(out, x, pool, a_off, ranks, scales, col_slot, seg_start, seg_slot,
                      parts: int = 1, block_m: int = 4, block_k: int = 128) -> torch.Tensor:
    """The torch reference of shrink_blocks (fp32 products, rounded to out's dtype)."""
    del parts, block_m, block_k
    starts, slots = seg_start.tolist(), seg_slot.tolist()
    offs, rank_of, scale_of, cols = a_off.tolist(), ranks.tolist(), scales.tolist(), \
        col_slot.tolist()
    k = x.shape[1]
    for i, s in enumerate(slots):
        lo, hi = starts[i], starts[i + 1]
        if hi <= lo:
            continue
        out[lo:hi] = 0
        if s < 0 or cols[s] < 0 or offs[s] < 0:
            continue
        r, c = rank_of[s], cols[s] * RB
        a = pool[offs[s]:offs[s] + r * k].view(r, k).float()
        out[lo:hi, c:c + r] = (x[lo:hi].float() @ a.t() * scale_of[s]).to(out.dtype)
    return out
