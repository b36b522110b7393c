"""LoRA expands inside the launch that consumes the projection's output (decode steps).

The split SGMV (kernels.sgmv_split) runs a LoRA'd projection as two launches after the base
GEMM: shrink (v = x @ A.T, K split over programs, fp32 partials) and expand (y += scale * v @
Bt). At decode sizes the expand is a short launch whose cost is mostly its own latency (on the
H200 at batch 64 with 32 rank-16 adapters, the qkv and o expands take 12.1 us a layer, about
6% of the step). Its output y feeds exactly one launch, and that launch reads y row by row:
- o (and down): the residual add + RMS norm (`add_rms_norm_lora`);
- q/k/v: rope + the KV-cache write (`qkv_rope_write_kv_`).
Each of these launches, given the shrink's partials (`DeferredLora`), adds the LoRA delta to
its rows itself, and the expand launch goes. Adapter weights (Bt) and the tables are read
before the PDL wait (they were written before the step), the partials and activations after it.

Semantics: exactly `sgmv_split.expand(...)` followed by the plain op (kernels.fused), with
one difference: `add_rms_norm_lora` does not write the projection's output back with the
delta added (nothing reads it after the norm). Up to the order of the rank sum in fp32, the
values are the same: the delta is (scale * sum of partials) rounded to the pool's dtype, times
Bt, accumulated in fp32, added to y and rounded to y's dtype, as the expand does.

Both kernels take the whole rank tile of one row in registers: they serve rank tiles of 16
(the model only defers there; at 32 a row's Bt would spill on the H200).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fused import _triton, add_rms_norm, rope_write_kv_
from kernels.pdl import launch_args, wait_then_release
from kernels.sgmv_split import Shrunk, SplitConfig, _b_block, _k_split, expand
from kernels.sgmv_triton import _live_tiles


@dataclass
class DeferredLora:
    """A projection's LoRA after its shrink: what adds its delta to the output later.
    b_off [n_slices, n_slots] is the layer's table; slice_starts the projection's columns."""
    shrunk: Shrunk
    pool: torch.Tensor
    b_off: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    slice_starts: list[int]
    seg_start: torch.Tensor
    seg_slot: torch.Tensor
    max_rank: int
    align: int = 1
    config: SplitConfig | None = None    # the shrink's; the expand fallback takes it too

    def expand_into(self, y: torch.Tensor) -> torch.Tensor:
        """The unfused path: the expand launch, y += delta in place."""
        return expand(y, self.shrunk, self.pool, self.b_off, self.ranks, self.scales,
                      self.slice_starts, self.seg_start, self.seg_slot, self.max_rank,
                      self.config, align=self.align)

    def table_args(self) -> tuple:
        s = self.shrunk
        return (s.v, s.vsum if s.vsum is not None else s.v, self.pool, self.b_off, self.ranks,
                self.scales, self.seg_start, self.seg_slot)

    def consts(self) -> dict:
        s = self.shrunk
        return dict(RANK_BLOCK=s.v.shape[3], SEG_BLOCK=s.seg_block, BLOCK_M=s.block_m,
                    KS_MAX=s.v.shape[0], REDUCE=s.vsum is not None, ALIGN=self.align)


# Launch shapes. The norm holds a row's whole Bt tile ([16, 4096] at hidden 4096) in
# registers: with 8 warps ptxas gives it 254 registers a thread (a whole SM's file), with 16
# warps 128 (Triton 3.6 spills 50-58 bytes in both). The rope kernel takes chunks of up to
# rope_heads heads. On the H200 (batch 64, 32 adapters, 32 + 32 + 32 heads of 128, chained
# shrink + rope) 2 warps and 4 heads were fastest: 21.6 us, against 23.0-51.1 for 2-8 warps
# and 1-8 heads (8 and 8: 46.8; the shrink + expand + rope it replaces: 23.1).
# LORAFLEET_LORA_FUSED="norm_warps=8,rope_warps=4,rope_heads=4" sets them (A/B runs).
LAUNCH_FIELDS = ("norm_warps", "rope_warps", "rope_heads")


@functools.lru_cache(maxsize=8)
def _parse_launch(text: str) -> dict:
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, val = (part.strip() for part in item.partition("="))
        if key not in LAUNCH_FIELDS or not val.isdigit() or int(val) < 1 or (
                int(val) & (int(val) - 1)):
            raise ValueError(f"LORAFLEET_LORA_FUSED: {item!r} is not one of {LAUNCH_FIELDS} "
                             f"= a power of two")
        out[key] = int(val)
    return out


def launch_shape(hidden: int, rank_block: int) -> dict:
    """norm_warps, rope_warps, rope_heads: the defaults for this hidden size and rank tile,
    with LORAFLEET_LORA_FUSED over them."""
    tile = hidden * rank_block                  # the norm's Bt elements a program holds
    shape = dict(norm_warps=16 if tile >= 1 << 16 else 8 if tile >= 1 << 14 else 4,
                 rope_warps=2, rope_heads=4)
    shape.update(_parse_launch(os.environ.get("LORAFLEET_LORA_FUSED", "")))
    return shape


# ---------------------------------------------------------------- shared pieces
@triton.jit
def _row_slot(row, seg_start_ptr, seg_slot_ptr, n_segs, n_ks, budget, N_SLICES: tl.constexpr,
              SEG_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """(adapter slot of the row's segment, -1 for base-only rows; the K chunks the shrink
    used, computed from the live tiles as its own programs did)."""
    si, lo, hi, slot, tiles, tiles_end = _live_tiles(seg_start_ptr, seg_slot_ptr, n_segs,
                                                     SEG_BLOCK, BLOCK_M)
    mine = (lo <= row) & (row < hi)            # one segment at most (padded ones are empty)
    return tl.max(tl.where(mine, slot, -1), axis=0), _k_split(tiles, n_ks, budget, N_SLICES)


@triton.jit
def _row_v(v_ptr, vsum_ptr, row, j, T, n_ks, live, N_SLICES: tl.constexpr,
           RANK_BLOCK: tl.constexpr, KS_MAX: tl.constexpr, REDUCE: tl.constexpr):
    """The row's v for slice j (fp32 [RANK_BLOCK]; zeros where not live): the shrink's sum
    (REDUCE) or its partials summed in chunk order, as the expand sums them."""
    rr = tl.arange(0, RANK_BLOCK)
    ok = rr < tl.where(live, RANK_BLOCK, 0)    # (a tensor mask: the interpreter wants one)
    if REDUCE:
        return tl.load(vsum_ptr + (j * T + row) * RANK_BLOCK + rr, mask=ok, other=0.0,
                       cache_modifier=".cg")
    v = tl.zeros((RANK_BLOCK,), dtype=tl.float32)
    for ks in tl.static_range(KS_MAX):
        v += tl.load(v_ptr + ((ks * N_SLICES + j) * T + row) * RANK_BLOCK + rr,
                     mask=ok & (rr * 0 + ks < n_ks), other=0.0, cache_modifier=".cg")
    return v


@triton.jit
def _adapter(row, j, seg_start_ptr, seg_slot_ptr, b_off_ptr, ranks_ptr, scales_ptr, n_slots,
             n_segs, n_ks, budget, N_SLICES: tl.constexpr, SEG_BLOCK: tl.constexpr,
             BLOCK_M: tl.constexpr):
    """(Bt offset, rank, scale, live, K chunks) of the row's adapter for slice j."""
    slot, n_ks = _row_slot(row, seg_start_ptr, seg_slot_ptr, n_segs, n_ks, budget, N_SLICES,
                           SEG_BLOCK, BLOCK_M)
    s = tl.maximum(slot, 0)
    b_o = tl.load(b_off_ptr + j * n_slots + s)
    live = (slot >= 0) & (b_o >= 0)
    return b_o, tl.load(ranks_ptr + s), tl.load(scales_ptr + s), live, n_ks


# ---------------------------------------------------------------- residual add + norm
@triton.jit
def _lora_norm_kernel(h_ptr, d_ptr, w_ptr, out_ptr, v_ptr, vsum_ptr, pool_ptr, b_off_ptr,
                      ranks_ptr, scales_ptr, seg_start_ptr, seg_slot_ptr, H, stride_h, stride_d,
                      stride_o, T, n_slots, n_segs, n_ks, budget, eps,
                      BLOCK: tl.constexpr, RANK_BLOCK: tl.constexpr, SEG_BLOCK: tl.constexpr,
                      BLOCK_M: tl.constexpr, KS_MAX: tl.constexpr, REDUCE: tl.constexpr,
                      ALIGN: tl.constexpr, USE_PDL: tl.constexpr):
    """One row: d' = d + scale * v @ Bt (rounded to d's dtype), h += d' (in place), out =
    rms_norm(h) * w."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    b_o, rank, scale, live, n_ks = _adapter(row, 0, seg_start_ptr, seg_slot_ptr, b_off_ptr,
                                            ranks_ptr, scales_ptr, n_slots, n_segs, n_ks,
                                            budget, 1, SEG_BLOCK, BLOCK_M)
    bt = _b_block(pool_ptr, b_o, rank, H, 0, live, BLOCK, RANK_BLOCK, ALIGN)  # [RB, BLOCK]
    wait_then_release(USE_PDL)
    v = _row_v(v_ptr, vsum_ptr, row, 0, T, n_ks, live, 1, RANK_BLOCK, KS_MAX, REDUCE)
    v = (v * scale).to(pool_ptr.dtype.element_ty).to(tl.float32)
    delta = tl.sum(v[:, None] * bt.to(tl.float32), axis=0)
    d = tl.load(d_ptr + row * stride_d + cols, mask=ok, other=0.0)
    d = (d.to(tl.float32) + delta).to(h_ptr.dtype.element_ty)
    x = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0)
    x = (x.to(tl.float32) + d.to(tl.float32)).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + row * stride_h + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    normed = (xf * inv).to(h_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm_lora(h, delta, w, eps: float, lora: DeferredLora | None,
                      impl: str = "auto") -> torch.Tensor:
    """kernels.fused.add_rms_norm(h, delta + the deferred LoRA's delta, w, eps): h updated in
    place, the normed rows returned. `delta` is not written. lora None: the plain op."""
    if lora is None:
        return add_rms_norm(h, delta, w, eps, impl=impl)
    if not _triton(h, impl) or len(lora.slice_starts) != 2:
        return add_rms_norm(h, lora.expand_into(delta), w, eps, impl=impl)
    t, hid = h.shape
    out = torch.empty_like(h)
    if t == 0:
        return out
    s = lora.shrunk
    _lora_norm_kernel[(t,)](h, delta, w, out, *lora.table_args(), hid, h.stride(0),
                            delta.stride(0), out.stride(0), t, lora.ranks.shape[0],
                            lora.seg_slot.shape[0], s.v.shape[0], s.budget, eps,
                            BLOCK=triton.next_power_of_2(hid), **lora.consts(),
                            num_warps=launch_shape(hid, s.v.shape[3])["norm_warps"],
                            **launch_args(h.device))
    return out


# ---------------------------------------------------------------- rope + KV write
@triton.jit
def _lora_rope_kv_kernel(x_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, v_ptr,
                         vsum_ptr, pool_ptr, b_off_ptr, ranks_ptr, scales_ptr, seg_start_ptr,
                         seg_slot_ptr, stride_row, n_q, n_kv, T, n_slots, n_segs, n_ks, budget,
                         HALF: tl.constexpr, CH: tl.constexpr, RANK_BLOCK: tl.constexpr,
                         SEG_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                         KS_MAX: tl.constexpr, REDUCE: tl.constexpr, ALIGN: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """Program (row, chunk of CH heads of one slice of the row's q | k | v): add the LoRA delta
    to those heads, rotate them if they are q or k heads, store them in place, and write k and
    v heads to the row's cache slot (none when it is negative)."""
    row = tl.program_id(0).to(tl.int64)
    head0 = tl.program_id(1) * CH
    D: tl.constexpr = 2 * HALF
    j = (head0 >= n_q).to(tl.int32) + (head0 >= n_q + n_kv).to(tl.int32)   # q, k or v
    first = tl.where(j == 0, 0, tl.where(j == 1, n_q, n_q + n_kv))         # slice's 1st head
    width = tl.where(j == 0, n_q, n_kv) * D
    hs = tl.arange(0, CH)
    ds = tl.arange(0, HALF)
    rr = tl.arange(0, RANK_BLOCK)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    kv_slot = tl.load(slot_ptr + row).to(tl.int64)
    c = tl.load(cos_ptr + pos * HALF + ds).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * HALF + ds).to(tl.float32)[None, :]
    b_o, rank, scale, live, n_ks = _adapter(row, j, seg_start_ptr, seg_slot_ptr, b_off_ptr,
                                            ranks_ptr, scales_ptr, n_slots, n_segs, n_ks,
                                            budget, 3, SEG_BLOCK, BLOCK_M)
    b_o = (b_o // ALIGN) * ALIGN                # the same value, with its alignment visible
    b_cols = (head0 - first) * D + hs[:, None] * D + ds[None, :]          # [CH, HALF]
    b_ptrs = pool_ptr + b_o + rr[:, None, None] * width + b_cols[None, :, :]
    r_ok = (rr < tl.where(live, rank, 0))[:, None, None]
    bt1 = tl.load(b_ptrs, mask=r_ok, other=0.0)                           # [RB, CH, HALF]
    bt2 = tl.load(b_ptrs + HALF, mask=r_ok, other=0.0)
    wait_then_release(USE_PDL)
    v = _row_v(v_ptr, vsum_ptr, row, j, T, n_ks, live, 3, RANK_BLOCK, KS_MAX, REDUCE)
    v = (v * scale).to(pool_ptr.dtype.element_ty).to(tl.float32)[:, None, None]
    base = x_ptr + row * stride_row + (head0 + hs)[:, None] * D + ds[None, :]
    dt = x_ptr.dtype.element_ty
    x1 = tl.load(base).to(tl.float32) + tl.sum(v * bt1.to(tl.float32), axis=0)
    x2 = tl.load(base + HALF).to(tl.float32) + tl.sum(v * bt2.to(tl.float32), axis=0)
    x1 = x1.to(dt).to(tl.float32)               # y += delta, stored: the expand's rounding
    x2 = x2.to(dt).to(tl.float32)
    if j < 2:                                   # q or k heads: rotate
        y1 = (x1 * c - x2 * s).to(dt)
        y2 = (x2 * c + x1 * s).to(dt)
    else:
        y1 = x1.to(dt)
        y2 = x2.to(dt)
    tl.store(base, y1)
    tl.store(base + HALF, y2)
    if (kv_slot >= 0) & (j > 0):
        dst = kv_slot * (n_kv * D) + (head0 - first + hs)[:, None] * D + ds[None, :]
        if j == 1:
            tl.store(kc_ptr + dst, y1.to(kc_ptr.dtype.element_ty))
            tl.store(kc_ptr + dst + HALF, y2.to(kc_ptr.dtype.element_ty))
        else:
            tl.store(vc_ptr + dst, y1.to(vc_ptr.dtype.element_ty))
            tl.store(vc_ptr + dst + HALF, y2.to(vc_ptr.dtype.element_ty))


def head_chunk(n_q: int, n_kv: int, most: int = 8) -> int:
    """Heads a rope program takes: the largest power of two up to `most` that divides both
    head counts (a chunk never straddles the q | k | v boundaries)."""
    ch = most
    while n_q % ch or n_kv % ch:
        ch //= 2
    return ch


def qkv_rope_write_kv_(qkv, n_q: int, n_kv: int, cos, sin, positions, k_cache, v_cache,
                       slot_mapping, lora: DeferredLora | None = None,
                       impl: str = "auto") -> torch.Tensor:
    """The engine's attention input step on its qkv rows [T, (n_q + 2 n_kv) * D]: add the
    deferred LoRA's delta (lora None: none) in place, then kernels.fused.rope_write_kv_ on the
    q, k and v heads (q, k rotated in place; k, v written to their cache slots). Returns the
    q view [T, n_q, D]. With a LoRA, one launch on CUDA (rows x chunks of heads); where that
    kernel does not fit (caches in another layout, an odd head dim) the expand and the plain
    op."""
    t = qkv.shape[0]
    d = qkv.shape[1] // (n_q + 2 * n_kv)
    if qkv.stride(1) != 1 or qkv.shape[1] != (n_q + 2 * n_kv) * d:
        raise ValueError(f"qkv rows must be contiguous [T, (n_q + 2 n_kv) * D], got "
                         f"{tuple(qkv.shape)} with strides {qkv.stride()}")
    q = qkv[:, :n_q * d].view(t, n_q, d)
    k = qkv[:, n_q * d:(n_q + n_kv) * d].view(t, n_kv, d)
    v = qkv[:, (n_q + n_kv) * d:].view(t, n_kv, d)
    fits = lora is not None and (
        _triton(qkv, impl) and k_cache.is_contiguous() and v_cache.is_contiguous()
        and tuple(k_cache.shape[2:]) == (n_kv, d) and v_cache.shape == k_cache.shape
        and k_cache.dtype == v_cache.dtype and d % 2 == 0
        and triton.next_power_of_2(d // 2) == d // 2
        and list(lora.slice_starts) == [0, n_q * d, (n_q + n_kv) * d, (n_q + 2 * n_kv) * d])
    if not fits:
        if lora is not None:
            lora.expand_into(qkv)
        rope_write_kv_(q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping, impl=impl)
        return q
    if t == 0:
        return q
    s = lora.shrunk
    shape = launch_shape(qkv.shape[1], s.v.shape[3])
    ch = head_chunk(n_q, n_kv, shape["rope_heads"])
    _lora_rope_kv_kernel[(t, (n_q + 2 * n_kv) // ch)](
        qkv, k_cache, v_cache, cos, sin, positions, slot_mapping, *lora.table_args(),
        qkv.stride(0), n_q, n_kv, t, lora.ranks.shape[0], lora.seg_slot.shape[0], s.v.shape[0],
        s.budget, HALF=d // 2, CH=ch, **lora.consts(), num_warps=shape["rope_warps"],
        **launch_args(qkv.device))
    return q
