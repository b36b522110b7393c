"""The LoRA expand fused into the kernel that consumes a projection's output.

At decode sizes the split SGMV (kernels/sgmv_split.py) is two short launches per projection
group: the shrink v = x @ A.T and the expand y += scale * v @ Bt. The expand's bytes are small
(rank x N per adapter) but its launch, ramp and the read-modify-write of y cost about as much as
a small kernel. Every projection's output already goes through one elementwise kernel before
anything else reads it: q/k/v through rotary + KV-cache write, o and down through the residual
add + RMSNorm, gate/up through SiLU-gate. Here those kernels add each row's LoRA delta
themselves, from the shrink's partials:

    delta[row, cols] = round(scale[s] * v[row]) @ Bt[s, slice(cols)]      s = slot of row's segment

rounded into y's dtype with the projection output exactly as the separate expand would (so the
result is the same as expand-then-consume up to fp32 summation order). The row's slot comes from
the segment table (a search over at most SEG_BLOCK entries), the rank loop is unrolled so all of
Bt's row loads are in flight together; rows without an adapter (or whose adapter leaves this
slice out) get nothing.

`LoraDelta` carries a pending delta from the projection to its consumer. The consumers in
kernels.fused take it as `lora=`; where they cannot fuse (CPU, or a layout the fused kernel does
not handle) they call `apply_` first, which runs the separate expand (or the torch reference).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from kernels.sgmv_split import Shrunk, _k_split, _live_tiles, expand


@dataclass
class LoraDelta:
    """A projection's LoRA delta, shrunk but not yet expanded (see the module docstring)."""
    shrunk: Shrunk
    pool: torch.Tensor
    a_off: torch.Tensor          # int64 [n_slices, n_slots] (this layer's)
    b_off: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    slice_starts: Sequence[int]
    seg_start: torch.Tensor
    seg_slot: torch.Tensor
    max_rank: int

    def apply_(self, y: torch.Tensor) -> torch.Tensor:
        """The unfused path: y += delta with the separate expand kernel."""
        return expand(y, self.shrunk, self.pool, self.b_off, self.ranks, self.scales,
                      self.slice_starts, self.seg_start, self.seg_slot, self.max_rank)

    def args(self) -> tuple:
        """The kernels' runtime arguments (after their own), in _row_delta's order."""
        v = self.shrunk.v
        return (self.pool, self.a_off, self.b_off, self.ranks, self.scales, self.seg_start,
                self.seg_slot, v, v.shape[2], self.ranks.shape[0], self.seg_slot.shape[0],
                v.shape[0], self.shrunk.budget)

    def constexprs(self) -> dict:
        v = self.shrunk.v
        return dict(N_SLICES=v.shape[1], SEG_BLOCK=self.shrunk.seg_block,
                    SHRINK_BM=self.shrunk.block_m, RANK_BLOCK=v.shape[3], KS_MAX=v.shape[0])


@triton.jit
def _row_delta(row, j, cols, c_ok, width, pool_ptr, a_off_ptr, b_off_ptr, ranks_ptr,
               scales_ptr, seg_start_ptr, seg_slot_ptr, v_ptr, T, n_slots, n_segs, n_ks,
               budget, N_SLICES: tl.constexpr, SEG_BLOCK: tl.constexpr,
               SHRINK_BM: tl.constexpr, RANK_BLOCK: tl.constexpr, KS_MAX: tl.constexpr):
    """fp32 delta of one row over `cols` (any shape; columns within slice j, which is `width`
    wide); zero where the row has no adapter for slice j."""
    si = tl.arange(0, SEG_BLOCK)
    seg_hi = tl.load(seg_start_ptr + si + 1, mask=si < n_segs, other=2147483647)
    seg = tl.sum((seg_hi <= row).to(tl.int32))
    slot = tl.load(seg_slot_ptr + tl.minimum(seg, n_segs - 1))
    slot = tl.where(seg < n_segs, slot, -1)
    safe = tl.maximum(slot, 0)
    a_o = tl.load(a_off_ptr + j * n_slots + safe)
    b_o = tl.load(b_off_ptr + j * n_slots + safe)
    live = (slot >= 0) & (a_o >= 0) & (b_o >= 0)
    rank = tl.where(live, tl.load(ranks_ptr + safe), 0)
    scale = tl.load(scales_ptr + safe)
    # the shrink's K partials: as many chunks as it used (the same count from the same table)
    _, _, _, _, tiles, _ = _live_tiles(seg_start_ptr, seg_slot_ptr, n_segs, SEG_BLOCK,
                                       SHRINK_BM)
    used = _k_split(tiles, n_ks, budget, N_SLICES)
    b_row = pool_ptr + tl.maximum(b_o, 0) + cols
    delta = tl.zeros(cols.shape, dtype=tl.float32)
    for r in tl.static_range(RANK_BLOCK):       # masked, not branched: all loads in flight
        v_r = 0.0
        for ks in tl.static_range(KS_MAX):
            v_r += tl.load(v_ptr + ((ks * N_SLICES + j) * T + row) * RANK_BLOCK + r,
                           mask=(used > ks) & (rank > r), other=0.0, cache_modifier=".cg")
        # the separate expand rounds scale * v to the weights' dtype before its dot
        v_r = (v_r * scale).to(pool_ptr.dtype.element_ty).to(tl.float32)
        bt = tl.load(b_row + r * width, mask=c_ok & (cols * 0 + rank > r), other=0.0)
        bt = bt.to(tl.float32)
        delta += v_r * bt
    return delta


@triton.jit
def _with_delta(x, row, j, cols, c_ok, width, pool_ptr, a_off_ptr, b_off_ptr, ranks_ptr,
                scales_ptr, seg_start_ptr, seg_slot_ptr, v_ptr, T, n_slots, n_segs, n_ks,
                budget, N_SLICES: tl.constexpr, SEG_BLOCK: tl.constexpr,
                SHRINK_BM: tl.constexpr, RANK_BLOCK: tl.constexpr, KS_MAX: tl.constexpr):
    """x (loaded in y's dtype) plus its row's delta, rounded to y's dtype, returned in fp32."""
    d = _row_delta(row, j, cols, c_ok, width, pool_ptr, a_off_ptr, b_off_ptr, ranks_ptr,
                   scales_ptr, seg_start_ptr, seg_slot_ptr, v_ptr, T, n_slots, n_segs, n_ks,
                   budget, N_SLICES, SEG_BLOCK, SHRINK_BM, RANK_BLOCK, KS_MAX)
    return (x.to(tl.float32) + d).to(x.dtype).to(tl.float32)


# ---------------------------------------------------------------- consumers
@triton.jit
def _add_rms_lora_kernel(h_ptr, d_ptr, w_ptr, out_ptr, H, stride_h, stride_d, stride_o, eps,
                         pool_ptr, a_off_ptr, b_off_ptr, ranks_ptr, scales_ptr, seg_start_ptr,
                         seg_slot_ptr, v_ptr, T, n_slots, n_segs, n_ks, budget,
                         BLOCK: tl.constexpr, N_SLICES: tl.constexpr, SEG_BLOCK: tl.constexpr,
                         SHRINK_BM: tl.constexpr, RANK_BLOCK: tl.constexpr,
                         KS_MAX: tl.constexpr):
    """One row: h += round(d + delta); out = rms_norm(h) * w (kernels.fused._rms_kernel's
    arithmetic, with the o or down projection's LoRA delta added to d first)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    d = tl.load(d_ptr + row.to(tl.int64) * stride_d + cols, mask=ok, other=0.0)
    d = _with_delta(d, row, 0, cols, ok, H, pool_ptr, a_off_ptr, b_off_ptr, ranks_ptr,
                    scales_ptr, seg_start_ptr, seg_slot_ptr, v_ptr, T, n_slots, n_segs, n_ks,
                    budget, N_SLICES, SEG_BLOCK, SHRINK_BM, RANK_BLOCK, KS_MAX)
    hp = h_ptr + row.to(tl.int64) * stride_h + cols
    x = (tl.load(hp, mask=ok, other=0.0).to(tl.float32) + d).to(h_ptr.dtype.element_ty)
    tl.store(hp, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    normed = (xf * inv).to(h_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + cols,
             (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_lora_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_o,
                          pool_ptr, a_off_ptr, b_off_ptr, ranks_ptr, scales_ptr, seg_start_ptr,
                          seg_slot_ptr, v_ptr, T, n_slots, n_segs, n_ks, budget,
                          BLOCK: tl.constexpr, N_SLICES: tl.constexpr, SEG_BLOCK: tl.constexpr,
                          SHRINK_BM: tl.constexpr, RANK_BLOCK: tl.constexpr,
                          KS_MAX: tl.constexpr):
    """silu(gate + delta_gate) * (up + delta_up) over one block of one row's columns."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    base = gu_ptr + row.to(tl.int64) * stride_gu
    g = _with_delta(tl.load(base + cols, mask=ok, other=0.0), row, 0, cols, ok, inter,
                    pool_ptr, a_off_ptr, b_off_ptr, ranks_ptr, scales_ptr, seg_start_ptr,
                    seg_slot_ptr, v_ptr, T, n_slots, n_segs, n_ks, budget, N_SLICES,
                    SEG_BLOCK, SHRINK_BM, RANK_BLOCK, KS_MAX)
    u = _with_delta(tl.load(base + inter + cols, mask=ok, other=0.0), row, 1, cols, ok, inter,
                    pool_ptr, a_off_ptr, b_off_ptr, ranks_ptr, scales_ptr, seg_start_ptr,
                    seg_slot_ptr, v_ptr, T, n_slots, n_segs, n_ks, budget, N_SLICES,
                    SEG_BLOCK, SHRINK_BM, RANK_BLOCK, KS_MAX)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, (act * u).to(out_ptr.dtype.element_ty),
             mask=ok)


@triton.jit
def _rope_kv_lora_kernel(x_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
                         stride_row, n_q, n_kv, kv_elems,
                         pool_ptr, a_off_ptr, b_off_ptr, ranks_ptr, scales_ptr, seg_start_ptr,
                         seg_slot_ptr, v_ptr, T, n_slots, n_segs, n_ks, budget,
                         HALF: tl.constexpr, N_SLICES: tl.constexpr, SEG_BLOCK: tl.constexpr,
                         SHRINK_BM: tl.constexpr, RANK_BLOCK: tl.constexpr,
                         KS_MAX: tl.constexpr):
    """One head of one row of the packed q|k|v buffer: add the q/k/v LoRA delta, rotate q and k
    heads in place, write k and v heads to the row's KV slot (none when it is negative)."""
    row = tl.program_id(0)
    head = tl.program_id(1)                         # 0..n_q-1 q, then k, then v heads
    j = (head >= n_q).to(tl.int32) + (head >= n_q + n_kv).to(tl.int32)
    first = tl.where(j == 0, 0, tl.where(j == 1, n_q, n_q + n_kv))
    width = tl.where(j == 0, n_q, n_kv) * (2 * HALF)
    ds = tl.arange(0, HALF)
    in_slice = (head - first) * (2 * HALF) + ds     # columns within slice j
    ok = ds < HALF
    base = x_ptr + row.to(tl.int64) * stride_row + head * (2 * HALF) + ds
    x1 = _with_delta(tl.load(base), row, j, in_slice, ok, width, pool_ptr, a_off_ptr,
                     b_off_ptr, ranks_ptr, scales_ptr, seg_start_ptr, seg_slot_ptr, v_ptr, T,
                     n_slots, n_segs, n_ks, budget, N_SLICES, SEG_BLOCK, SHRINK_BM,
                     RANK_BLOCK, KS_MAX)
    x2 = _with_delta(tl.load(base + HALF), row, j, in_slice + HALF, ok, width, pool_ptr,
                     a_off_ptr, b_off_ptr, ranks_ptr, scales_ptr, seg_start_ptr, seg_slot_ptr,
                     v_ptr, T, n_slots, n_segs, n_ks, budget, N_SLICES, SEG_BLOCK, SHRINK_BM,
                     RANK_BLOCK, KS_MAX)
    if j < 2:                                       # q or k: rotate
        pos = tl.load(pos_ptr + row).to(tl.int64)
        c = tl.load(cos_ptr + pos * HALF + ds).to(tl.float32)
        s = tl.load(sin_ptr + pos * HALF + ds).to(tl.float32)
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
        x1 = y1.to(x_ptr.dtype.element_ty).to(tl.float32)
        x2 = y2.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(base, x1.to(x_ptr.dtype.element_ty))
    tl.store(base + HALF, x2.to(x_ptr.dtype.element_ty))
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if (slot >= 0) & (j > 0):
        cache = tl.where(j == 1, kc_ptr, vc_ptr)
        dst = cache + slot * kv_elems + (head - first) * (2 * HALF) + ds
        tl.store(dst, x1.to(kc_ptr.dtype.element_ty))
        tl.store(dst + HALF, x2.to(kc_ptr.dtype.element_ty))


def add_rms_norm_lora(h, delta, w, eps: float, lora: LoraDelta) -> torch.Tensor:
    """h += delta + lora's delta (in place); return rms_norm(h) * w. CUDA/Triton only."""
    out = torch.empty_like(h)
    t, hid = h.shape
    if t:
        _add_rms_lora_kernel[(t,)](h, delta, w, out, hid, h.stride(0), delta.stride(0),
                                   out.stride(0), eps, *lora.args(),
                                   BLOCK=triton.next_power_of_2(hid),
                                   num_warps=8 if hid >= 4096 else 4, **lora.constexprs())
    return out


def silu_mul_lora(gu, lora: LoraDelta, block: int = 1024) -> torch.Tensor:
    """silu(gate) * up of gu [T, 2I] after adding lora's delta (slices gate, up)."""
    t, two_i = gu.shape
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=gu.dtype, device=gu.device)
    if t:
        _silu_mul_lora_kernel[(t, triton.cdiv(inter, block))](
            gu, out, inter, gu.stride(0), out.stride(0), *lora.args(), BLOCK=block,
            **lora.constexprs())
    return out


def rope_write_kv_lora_(qkv, n_q: int, n_kv: int, head_dim: int, cos, sin, positions,
                        k_cache, v_cache, slot_mapping, lora: LoraDelta) -> None:
    """On the packed qkv buffer [T, (n_q + 2 n_kv) * D]: add lora's delta (slices q, k, v),
    rotate q and k, write k and v to their cache slots. Caches [NB, BS, n_kv, D] contiguous."""
    t = qkv.shape[0]
    if t:
        _rope_kv_lora_kernel[(t, n_q + 2 * n_kv)](
            qkv, k_cache, v_cache, cos, sin, positions, slot_mapping, qkv.stride(0), n_q, n_kv,
            n_kv * head_dim, *lora.args(), HALF=head_dim // 2, num_warps=1,
            **lora.constexprs())
