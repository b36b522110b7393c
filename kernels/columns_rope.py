"""Column LoRA's q/k/v expand with rope and the KV-cache write in its epilogue: one launch where
the column path runs two (kernels.sgmv_split.expand_columns, then kernels.fused.rope_write_kv_).

Opt-in (LORAFLEET_COLUMNS_ROPE=1, services/worker/model.py) until it is measured on a GPU. The
question it answers: the twelfth session's fused rope lost because each program took one row
and read the row's adapter weights itself (an adapter's Bt read once a row, from DRAM in the
step). Here a work item is a row tile of one segment (one adapter) and one head, as the split
expand's items are, so Bt is read once a tile; the rope and the cache write ride on the y tile
the expand already holds. What it can save: the rope launch, 2.5 us a layer at batch 64 with 32
adapters (bench/results/ab/timeline-decode-cols-h200.txt).

Semantics, for qkv [T, (n_q + 2 n_kv) * D] (q, k, v heads side by side, as the engine's q/k/v
GEMM writes them) and every row covered by a segment (base-only segments included):
  1. expand_columns(qkv, ...): rows of a segment whose slot has a column block get their LoRA;
  2. rope_write_kv_(q, k, v, ...): q rotated in place; the rotated k and the v written to the
     cache slot of the row (none where the slot is negative).
Unlike step 2 run alone, the k and v columns of qkv are left as the GEMM wrote them (the cache
holds the result), and rows outside every segment (a captured graph's padding rows) are not
touched. Each value takes the roundings the two launches give it: y + delta rounded to qkv's
dtype, then the rotation in fp32, rounded again.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_args, wait_then_release
from kernels.sgmv_split import _progs
from kernels.sgmv_triton import _live_tiles, _locate

RANK_BLOCK = 16         # the column blocks' rank tile (services.worker.lora_columns.RANK_TILE)


@triton.jit
def _columns_rope_kernel(y_ptr, vcol_ptr, col_ptr, pool_ptr, b_off_ptr, ranks_ptr, scales_ptr,
                         seg_start_ptr, seg_slot_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr,
                         pos_ptr, slot_ptr, n_slots, n_segs, stride_y, stride_v, n_q, n_kv,
                         SEG_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, HALF: tl.constexpr,
                         HALF_PAD: tl.constexpr, RANK_BLOCK: tl.constexpr,
                         DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
                         ALIGN: tl.constexpr):
    """Work items (row tile, head): the head's two halves get the tile's LoRA (if its slot has
    a column block and the adapter targets the head's slice), then q heads are rotated in
    place, k heads rotated into the cache, v heads copied into it. Under PDL the tables, Bt,
    the rows' positions, cache slots and angles are read before the wait; qkv after it."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    # base-only segments too: their rows need the rope and the cache write
    si, lo, hi, slot, tiles, tiles_end = _live_tiles(seg_start_ptr, seg_slot_ptr, n_segs,
                                                     SEG_BLOCK, BLOCK_M, True)
    n_heads = n_q + 2 * n_kv
    kv_elems = n_kv * 2 * HALF
    total = tl.sum(tiles) * n_heads
    rm = tl.arange(0, BLOCK_M)
    ds = tl.arange(0, HALF_PAD)
    d_ok = ds < HALF
    rr = tl.arange(0, RANK_BLOCK)
    for w in range(pid, total, nprog):
        h = w % n_heads
        tile = w // n_heads
        s, row0, m_len = _locate(tile, si, lo, hi, slot, tiles, tiles_end, BLOCK_M)
        j = (h >= n_q).to(tl.int32) + (h >= n_q + n_kv).to(tl.int32)       # q, k or v
        head0 = tl.where(j == 0, 0, tl.where(j == 1, n_q, n_q + n_kv))
        width = tl.where(j == 0, n_q, n_kv) * 2 * HALF                     # the slice's columns
        c_in = (h - head0) * 2 * HALF                                      # the head's, in it
        s_c = tl.maximum(s, 0)
        b_o = tl.load(b_off_ptr + j * n_slots + s_c)
        c_o = tl.load(col_ptr + s_c)
        rank = tl.load(ranks_ptr + s_c)
        scale = tl.load(scales_ptr + s_c)
        live = (s >= 0) & (b_o >= 0) & (c_o >= 0)
        b_al = (tl.maximum(b_o, 0) // ALIGN) * ALIGN   # the same value, alignment visible
        bt_ok = (rr < tl.where(live, rank, 0))[:, None] & d_ok[None, :]
        bt_ptrs = pool_ptr + b_al + rr[:, None] * width + (c_in + ds)[None, :]
        bt1 = tl.load(bt_ptrs, mask=bt_ok, other=0.0)
        bt2 = tl.load(bt_ptrs + HALF, mask=bt_ok, other=0.0)
        rows = (row0 + rm).to(tl.int64)
        row_ok = rm < m_len
        pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        kv_slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
        io = row_ok[:, None] & d_ok[None, :]
        c = tl.load(cos_ptr + pos[:, None] * HALF + ds[None, :], mask=io, other=0.0)
        sn = tl.load(sin_ptr + pos[:, None] * HALF + ds[None, :], mask=io, other=0.0)
        wait_then_release(USE_PDL)
        y_ptrs = y_ptr + rows[:, None] * stride_y + (h * 2 * HALF + ds)[None, :]
        y1 = tl.load(y_ptrs, mask=io, other=0.0)
        y2 = tl.load(y_ptrs + HALF, mask=io, other=0.0)
        if live:                             # x @ A.T from the GEMM's extra columns
            v = tl.load(vcol_ptr + rows[:, None] * stride_v
                        + ((c_o * 3 + j) * RANK_BLOCK + rr)[None, :],   # 3 slices
                        mask=row_ok[:, None], other=0.0).to(tl.float32)
            v = (v * scale).to(pool_ptr.dtype.element_ty)
            if UPCAST:                       # (the interpreter cannot multiply bf16)
                d1 = tl.dot(v.to(tl.float32), bt1.to(tl.float32), input_precision=DOT_PREC)
                d2 = tl.dot(v.to(tl.float32), bt2.to(tl.float32), input_precision=DOT_PREC)
            else:
                d1 = tl.dot(v, bt1, input_precision=DOT_PREC)
                d2 = tl.dot(v, bt2, input_precision=DOT_PREC)
            y1 = (y1.to(tl.float32) + d1).to(y_ptr.dtype.element_ty)
            y2 = (y2.to(tl.float32) + d2).to(y_ptr.dtype.element_ty)
        to_cache = (row_ok & (kv_slot >= 0))[:, None] & d_ok[None, :]
        if j == 2:                           # v: into the cache as it is
            vh = h - n_q - n_kv
            vp = vc_ptr + kv_slot[:, None] * kv_elems + (vh * 2 * HALF + ds)[None, :]
            tl.store(vp, y1.to(vc_ptr.dtype.element_ty), mask=to_cache)
            tl.store(vp + HALF, y2.to(vc_ptr.dtype.element_ty), mask=to_cache)
        else:                                # q or k: rotated (as kernels.fused._rotate_row)
            x1 = y1.to(tl.float32)
            x2 = y2.to(tl.float32)
            cf = c.to(tl.float32)
            sf = sn.to(tl.float32)
            o1 = (x1 * cf - x2 * sf).to(y_ptr.dtype.element_ty)
            o2 = (x2 * cf + x1 * sf).to(y_ptr.dtype.element_ty)
            if j == 0:
                tl.store(y_ptrs, o1, mask=io)
                tl.store(y_ptrs + HALF, o2, mask=io)
            else:
                kp = kc_ptr + kv_slot[:, None] * kv_elems + ((h - n_q) * 2 * HALF + ds)[None, :]
                tl.store(kp, o1.to(kc_ptr.dtype.element_ty), mask=to_cache)
                tl.store(kp + HALF, o2.to(kc_ptr.dtype.element_ty), mask=to_cache)
    wait_then_release(USE_PDL)               # a program without items waits too


def columns_rope_write_kv_(qkv, v_cols, col_slot, pool, b_off, ranks, scales, slice_starts,
                           seg_start, seg_slot, n_q: int, n_kv: int, cos, sin, positions,
                           k_cache, v_cache, slot_mapping, impl: str = "auto",
                           align: int = 1) -> None:
    """The column LoRA's expand into qkv, then rope on q and k and the k/v cache write (see the
    module docstring). qkv [T, (n_q + 2 n_kv) * D] with unit column stride; v_cols [T, >=
    n_blocks * 3 * 16] (the GEMM's extra columns); col_slot int32 [n_slots]; b_off [3, n_slots]
    (the layer's q/k/v Bt offsets); slice_starts (0, n_q D, (n_q + n_kv) D, (n_q + 2 n_kv) D);
    cos, sin [max_pos, D / 2]; positions, slot_mapping [T]; caches [NB, BS, n_kv, D]
    contiguous. impl: "triton" (the kernel; the interpreter too), "torch" (the two ops'
    references), "auto" (the kernel on CUDA). No host syncs."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be auto, triton or torch, got {impl!r}")
    t_rows, width = qkv.shape
    d = width // (n_q + 2 * n_kv)
    if tuple(slice_starts) != (0, n_q * d, (n_q + n_kv) * d, width) or d % 2:
        raise ValueError(f"q/k/v slices {tuple(slice_starts)} are not {n_q} q and {n_kv} k/v "
                         f"heads of an even size side by side")
    if qkv.stride(1) != 1 or v_cols.stride(1) != 1:
        raise ValueError("qkv and v_cols need unit column stride")
    if impl == "torch" or (impl == "auto" and not qkv.is_cuda):
        from kernels.fused import rope_write_kv_
        from kernels.sgmv_ref import expand_columns_ref
        expand_columns_ref(qkv, v_cols, col_slot, pool, b_off, ranks, scales, slice_starts,
                           seg_start, seg_slot, RANK_BLOCK)
        q = qkv[:, :n_q * d].view(t_rows, n_q, d)
        k = qkv[:, n_q * d:(n_q + n_kv) * d].view(t_rows, n_kv, d)
        v = qkv[:, (n_q + n_kv) * d:].view(t_rows, n_kv, d)
        rope_write_kv_(q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping,
                       impl="torch")
        return None
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.shape[2:] == (n_kv, d) and v_cache.shape == k_cache.shape):
        raise ValueError("caches must be contiguous [NB, BS, n_kv, D]")
    if not (cos.is_contiguous() and sin.is_contiguous() and cos.shape[1] == d // 2):
        raise ValueError("cos and sin must be contiguous [max_pos, D / 2]")
    n_segs = seg_slot.shape[0]
    if t_rows == 0 or n_segs == 0:
        return None
    interp = not qkv.is_cuda
    _columns_rope_kernel[(_progs(qkv.device),)](     # four programs an SM
        qkv, v_cols, col_slot, pool, b_off, ranks, scales, seg_start, seg_slot, k_cache,
        v_cache, cos, sin, positions, slot_mapping, b_off.shape[1], n_segs, qkv.stride(0),
        v_cols.stride(0), n_q, n_kv, SEG_BLOCK=max(16, triton.next_power_of_2(n_segs)),
        BLOCK_M=16, HALF=d // 2, HALF_PAD=max(16, triton.next_power_of_2(d // 2)),
        RANK_BLOCK=RANK_BLOCK, DOT_PREC="ieee" if qkv.dtype == torch.float32 else "tf32",
        UPCAST=interp and qkv.dtype == torch.bfloat16, ALIGN=max(1, align),
        **launch_args(qkv.device))
    return None
