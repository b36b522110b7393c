"""Torch references for SGMV (segmented gather matrix-vector) LoRA.

Pool layout (owned by the worker's adapter pool): one flat 1-D tensor `pool`; each adapter is one
contiguous blob inside it. For every (layer, slice) an adapter targets, the blob holds
  A  : [r, K]  (PEFT `lora_A.weight` as is)          at element offset a_off[slice, slot]
  Bt : [r, N_s] (PEFT `lora_B.weight` transposed)    at element offset b_off[slice, slot]
so a kernel reads both row-major with the long dimension contiguous. Offsets are -1 where the
adapter does not target that slice (or that layer): those rows get nothing added. The worker's
pool keeps every offset a multiple of 8 elements (services.worker.adapters.layout.OFFSET_ALIGN)
and says so to the kernels (`align=8`), which then load A and Bt in 16-byte vectors.

Rows of x are sorted so that each segment i (rows seg_start[i]:seg_start[i+1]) uses one slot
seg_slot[i]; a slot of -1 means base-only rows (no LoRA). Segments past the live ones are padded
with seg_start = T and seg_slot = -1, so the tensors keep a fixed size for CUDA graphs.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kernels.sgmv_choice import rank_tile


def sgmv_ref(y: torch.Tensor, x: torch.Tensor, pool: torch.Tensor, a_off: torch.Tensor,
             b_off: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
             slice_starts: Sequence[int], seg_start: torch.Tensor, seg_slot: torch.Tensor,
             max_rank: int) -> torch.Tensor:
    """Add each segment's LoRA delta to its rows of y, in place, and return y.

    Semantics, for every live segment i with slot s = seg_slot[i] >= 0 and every slice j with
    a_off[j, s] >= 0, rows R = seg_start[i]:seg_start[i+1], columns C = slice_starts[j]:[j+1]:
        y[R, C] += scales[s] * (x[R] @ A_{j,s}.T) @ Bt_{j,s}

    Shapes: y [T, N_total] (N_total = slice_starts[-1]); x [T, K]; pool [P]; a_off, b_off int64
    [n_slices, n_slots]; ranks int32 [n_slots]; scales float32 [n_slots]; seg_start int32 [S+1];
    seg_slot int32 [S]. The product runs in fp32 and is added in y's dtype.
    max_rank is unused here (kernels size their tiles with it).
    """
    del max_rank
    # read the small tables once (a per-element tensor read costs microseconds on CPU)
    starts, slots = seg_start.tolist(), seg_slot.tolist()
    a_tab, b_tab = a_off.tolist(), b_off.tolist()
    rank_of, scale_of = ranks.tolist(), scales.tolist()
    k = x.shape[1]
    for i, s in enumerate(slots):
        lo, hi = starts[i], starts[i + 1]
        if s < 0 or hi <= lo:
            continue
        r = rank_of[s]
        xs = x[lo:hi].float()
        for j in range(len(slice_starts) - 1):
            ao, bo = a_tab[j][s], b_tab[j][s]
            if ao < 0:
                continue
            c0, c1 = slice_starts[j], slice_starts[j + 1]
            a = pool[ao:ao + r * k].view(r, k).float()
            bt = pool[bo:bo + r * (c1 - c0)].view(r, c1 - c0).float()
            delta = (xs @ a.t()) @ bt
            y[lo:hi, c0:c1] += (delta * scale_of[s]).to(y.dtype)
    return y


def expand_columns_ref(y: torch.Tensor, v_cols: torch.Tensor, col_slot: torch.Tensor,
                       pool: torch.Tensor, b_off: torch.Tensor, ranks: torch.Tensor,
                       scales: torch.Tensor, slice_starts: Sequence[int], seg_start: torch.Tensor,
                       seg_slot: torch.Tensor, max_rank: int) -> torch.Tensor:
    """The LoRA expand with v = x @ A.T read from columns of the base GEMM's output (see
    kernels.sgmv_split.expand_columns), in place; returns y. For every live segment i with slot
    s = seg_slot[i] >= 0, c = col_slot[s] >= 0 and slice j with b_off[j, s] >= 0:
        v = v_cols[R, (c * n_slices + j) * RB : + rank_s]   (RB = the rank tile of max_rank)
        y[R, C_j] += (scales[s] * v) @ Bt_{j,s}
    The scaled v is rounded to the pool's dtype, as the kernel rounds it."""
    rb = rank_tile(max_rank)
    starts, slots = seg_start.tolist(), seg_slot.tolist()
    b_tab, cols = b_off.tolist(), col_slot.tolist()
    rank_of, scale_of = ranks.tolist(), scales.tolist()
    n_slices = len(slice_starts) - 1
    for i, s in enumerate(slots):
        lo, hi = starts[i], starts[i + 1]
        if s < 0 or hi <= lo or cols[s] < 0:
            continue
        r = rank_of[s]
        for j in range(n_slices):
            bo = b_tab[j][s]
            if bo < 0:
                continue
            c0, c1 = slice_starts[j], slice_starts[j + 1]
            v0 = (cols[s] * n_slices + j) * rb
            v = (v_cols[lo:hi, v0:v0 + r].float() * scale_of[s]).to(pool.dtype).float()
            bt = pool[bo:bo + r * (c1 - c0)].view(r, c1 - c0).float()
            y[lo:hi, c0:c1] += (v @ bt).to(y.dtype)
    return y


# the columns of one adapter's block in a row-LoRA buffer (kernels.shrink_blocks)
BLOCK_COLS = 16


def shrink_blocks_ref(out, x, pool, a_off, ranks, scales, col_slot, seg_start, seg_slot,
                      parts: int = 1, block_m: int = 4, block_k: int = 128) -> torch.Tensor:
    """kernels.shrink_blocks's semantics in torch (fp32 products, rounded to out's dtype); a
    segment at a time, host reads (a CPU engine's path and the kernel's reference)."""
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
        r, c = rank_of[s], cols[s] * BLOCK_COLS
        a = pool[offs[s]:offs[s] + r * k].view(r, k).float()
        out[lo:hi, c:c + r] = (x[lo:hi].float() @ a.t() * scale_of[s]).to(out.dtype)
    if slots:
        out[starts[len(slots)]:] = 0
    return out
