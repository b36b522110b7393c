"""SGMV LoRA: apply each segment's adapter to its rows of a mixed batch in one call.

`sgmv` has the semantics and signature of `kernels.sgmv_ref.sgmv_ref` (read its docstring for the
pool layout). On CUDA tensors it runs a Triton kernel (split-K up to SPLIT_MAX_ROWS rows, fused
above); elsewhere the torch reference. `impl="triton"` forces the fused kernel and `impl="split"`
the split one (tests run them under TRITON_INTERPRET=1 on CPU); `impl="torch"` the reference.
"""
from __future__ import annotations

from kernels.sgmv_ref import sgmv_ref

# Up to this many rows (decode, mixed and short prefill steps) the split-K kernel
# (kernels.sgmv_split) wins on the H200; above it the fused kernel (kernels.sgmv_triton), which
# reads each adapter's A and B once per row tile (bench/results/sgmv-sweep-h200.json).
SPLIT_MAX_ROWS = 2048


def sgmv(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start, seg_slot, max_rank,
         impl: str = "auto"):
    """y[rows of segment i, slice j] += scale_i * (x @ A_ij.T) @ Bt_ij; see sgmv_ref."""
    if impl not in ("auto", "triton", "split", "torch"):
        raise ValueError(f"impl must be auto, triton, split or torch, got {impl!r}")
    if impl == "split" or (impl == "auto" and y.is_cuda and x.shape[0] <= SPLIT_MAX_ROWS):
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
