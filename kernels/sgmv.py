"""SGMV LoRA: apply each segment's adapter to its rows of a mixed batch in one call.

`sgmv` has the semantics and signature of `kernels.sgmv_ref.sgmv_ref` (read its docstring for the
pool layout). On CUDA tensors it runs the Triton kernel (kernels.sgmv_triton); elsewhere the torch
reference. `impl="triton"` forces the kernel (tests run it under TRITON_INTERPRET=1 on CPU);
`impl="torch"` forces the reference.
"""
from __future__ import annotations

from kernels.sgmv_ref import sgmv_ref


def sgmv(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start, seg_slot, max_rank,
         impl: str = "auto"):
    """y[rows of segment i, slice j] += scale_i * (x @ A_ij.T) @ Bt_ij; see sgmv_ref."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be auto, triton or torch, got {impl!r}")
    if impl == "triton" or (impl == "auto" and y.is_cuda):
        from kernels.sgmv_triton import sgmv_triton  # deferred: CPU-only engines skip triton
        return sgmv_triton(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start,
                           seg_slot, max_rank)
    return sgmv_ref(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start, seg_slot,
                    max_rank)
