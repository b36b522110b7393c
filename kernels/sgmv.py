"""SGMV LoRA: apply each segment's adapter to its rows of a mixed batch in one call.

`sgmv` has the semantics and signature of `kernels.sgmv_ref.sgmv_ref` (read its docstring for the
pool layout). On CUDA tensors it runs a Triton kernel (split-K or fused, as `use_split` picks
from the shape); elsewhere the torch reference. `impl="triton"` forces the fused kernel and `impl="split"`
the split one (tests run them under TRITON_INTERPRET=1 on CPU); `impl="torch"` the reference.
"""
from __future__ import annotations

from kernels.sgmv_ref import sgmv_ref

# Which kernel, from the H200 runs (bench/results/kernels-h200.md, its fused and split columns;
# bench/results/sgmv-sweep-h200.json). The split-K kernel wins at decode sizes and whenever
# segments are long; the fused one when many adapters each cover few rows of a large batch (it
# reads each adapter's A and B once per row tile, where the split kernel's expand re-reads
# partials per column block): at 1024 rows and 128 adapters 32.6 us against 47.7 (rank 16),
# 50.6 against 106 (rank 64); and above SPLIT_MAX_ROWS.
SPLIT_MAX_ROWS = 2048
MIN_ROWS_PER_SEGMENT = 32    # 256 < T <= SPLIT_MAX_ROWS: split only with segments this long


def use_split(t_rows: int, n_segs: int, max_rank: int) -> bool:
    """The split-K kernel for T rows in n_segs segments (padded ones included), else fused."""
    if t_rows <= 256:           # decode: split, but rank 64 with ~2 rows an adapter goes fused
        return not (max_rank > 32 and t_rows >= 256 and n_segs > t_rows // 4)
    return t_rows <= SPLIT_MAX_ROWS and t_rows // max(n_segs, 1) >= MIN_ROWS_PER_SEGMENT


def sgmv(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start, seg_slot, max_rank,
         impl: str = "auto"):
    """y[rows of segment i, slice j] += scale_i * (x @ A_ij.T) @ Bt_ij; see sgmv_ref."""
    if impl not in ("auto", "triton", "split", "torch"):
        raise ValueError(f"impl must be auto, triton, split or torch, got {impl!r}")
    split = impl == "split" or (impl == "auto" and y.is_cuda and use_split(
        x.shape[0], seg_slot.shape[0], max_rank))
    if split:
        from kernels.sgmv_split import sgmv_split  # deferred: CPU-only engines skip triton
        from kernels.sgmv_triton import _check
        _check(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start, seg_slot)
        return sgmv_split(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start,
                          seg_slot, max_rank)
    if impl == "triton" or (impl == "auto" and y.is_cuda):
        from kernels.sgmv_triton import sgmv_triton
        return sgmv_triton(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start,
                           seg_slot, max_rank)
    return sgmv_ref(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start, seg_slot,
                    max_rank)
