"""SGMV LoRA: apply each segment's adapter to its rows of a mixed batch in one call.

The model hands one projection's LoRA over as a `LoraArgs` (the pool, that layer's and group's
offset tables, ranks, scales, slice starts, the step's segments, the rank bound, the offsets'
alignment) to `lora` (`lora_expand_columns` for column LoRA, `lora_shrink_rows` for row
LoRA); the kernels below work on the tensors inside it. `sgmv` takes the same fields as
arguments, with the semantics of `kernels.sgmv_ref.sgmv_ref` (read its docstring for the pool
layout); tests and benchmarks call it.

Which kernel runs a call is decided in one place, `choose_kernel` (kernels.sgmv_choice, beside
`rank_tile`): on CUDA tensors a Triton kernel (split-K or fused, as `use_split` picks from the
shape), or, when the caller has the segment and offset tables on the host (an eager engine
step: it wrote them, `HostSegments`) and one live segment of a rank-33+ adapter, cuBLAS GEMM
pairs on views of the pool (they beat our kernels there at every row count; bench/PERF_NOTES.md);
elsewhere the torch reference.
`impl="triton"` forces the fused kernel and `impl="split"` the split one (tests run them under
TRITON_INTERPRET=1 on CPU); `impl="torch"` the reference, `impl="cublas"` the GEMM pairs.
Captured decode graphs have no host tables and always run the kernels (a view of one adapter's
weights would be baked in).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kernels.sgmv_choice import HostSegments, choose_kernel
from kernels.sgmv_ref import expand_columns_ref, sgmv_ref, shrink_blocks_ref

@dataclass(slots=True)
class LoraArgs:
    """One projection's LoRA for one call, as the model passes it to the kernels (shapes and
    semantics: kernels.sgmv_ref.sgmv_ref). align: the caller's promise that every offset (>= 0)
    in a_off and b_off is a multiple of this many elements (the worker's pool keeps 8); the
    split kernel then loads adapter weights in 16-byte vectors. host: the same tables on the
    host (optional; see the module docstring)."""
    pool: torch.Tensor           # [P] flat adapter storage
    a_off: torch.Tensor          # int64 [n_slices, n_slots]
    b_off: torch.Tensor          # int64 [n_slices, n_slots]
    ranks: torch.Tensor          # int32 [n_slots]
    scales: torch.Tensor         # float32 [n_slots]
    slice_starts: Sequence[int]  # host ints, the output's column slices
    seg_start: torch.Tensor      # int32 [S+1]
    seg_slot: torch.Tensor       # int32 [S], -1 = base only
    max_rank: int                # bound on every slot's rank (the kernels' rank tile)
    align: int = 1
    host: HostSegments | None = None

    def tensors(self) -> tuple:
        """(pool, a_off, b_off, ranks, scales, slice_starts, seg_start, seg_slot): the
        kernels' positional arguments, in their order."""
        return (self.pool, self.a_off, self.b_off, self.ranks, self.scales, self.slice_starts,
                self.seg_start, self.seg_slot)


def _cublas(y, x, a: LoraArgs, lo: int, hi: int, s: int):
    """One segment's delta as two GEMMs per targeted slice, on views of the pool."""
    host, pool, starts = a.host, a.pool, a.slice_starts
    r, k = int(host.ranks[s]), x.shape[1]
    xs = x[lo:hi]
    for j in range(len(starts) - 1):
        ao, bo = int(host.a_off[j, s]), int(host.b_off[j, s])
        if ao < 0 or bo < 0:
            continue
        c0, c1 = starts[j], starts[j + 1]
        at = pool[ao:ao + r * k].view(r, k)
        bt = pool[bo:bo + r * (c1 - c0)].view(r, c1 - c0)
        y[lo:hi, c0:c1].addmm_(xs @ at.T, bt, alpha=float(host.scales[s]))
    return y


def lora(y, x, a: LoraArgs, impl: str = "auto"):
    """y[rows of segment i, slice j] += scale_i * (x @ A_ij.T) @ Bt_ij, in place (see
    sgmv_ref), by the kernel choose_kernel picks; returns y."""
    kind = choose_kernel(x.shape[0], a.seg_slot.shape[0], a.max_rank, y.is_cuda, a.host, impl)
    if kind == "cublas":
        return _cublas(y, x, a, *a.host.live)
    if kind == "split":
        from kernels.sgmv_split import sgmv_split  # deferred: CPU-only engines skip triton
        from kernels.sgmv_triton import _check
        _check(y, x, *a.tensors())
        return sgmv_split(y, x, *a.tensors(), a.max_rank, align=a.align)
    if kind == "fused":
        from kernels.sgmv_triton import sgmv_triton
        return sgmv_triton(y, x, *a.tensors(), a.max_rank)
    return sgmv_ref(y, x, *a.tensors(), a.max_rank)


def lora_expand_columns(y, v_cols, col_slot, a: LoraArgs, impl: str = "auto"):
    """The LoRA expand with v read from columns of the base GEMM's output (column LoRA, see
    services.worker.model.lora_columns and kernels.sgmv_ref.expand_columns_ref for the semantics;
    a.a_off is not read): the split expand kernel on CUDA (impl="split" forces it, for the
    interpreter), else the torch reference."""
    if impl not in ("auto", "split", "torch"):
        raise ValueError(f"impl must be auto, split or torch, got {impl!r}")
    args = (y, v_cols, col_slot, a.pool, a.b_off, a.ranks, a.scales, a.slice_starts,
            a.seg_start, a.seg_slot, a.max_rank)
    if impl == "split" or (impl == "auto" and y.is_cuda):
        from kernels.sgmv_split import expand_columns
        return expand_columns(*args, align=a.align)
    return expand_columns_ref(*args)


def lora_shrink_rows(out, x, col_slot, a: LoraArgs, parts: int, impl: str = "auto"):
    """Row LoRA's shrink: each row's scaled x @ A.T into its adapter's column block of out,
    zeros elsewhere (kernels.shrink_blocks; a.a_off's one slice, a.b_off not read): the kernel
    on CUDA (impl="triton" forces it, for the interpreter), else the torch reference."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be auto, triton or torch, got {impl!r}")
    args = (out, x, a.pool, a.a_off[0], a.ranks, a.scales, col_slot, a.seg_start, a.seg_slot)
    if impl == "triton" or (impl == "auto" and out.is_cuda):
        from kernels.shrink_blocks import shrink_blocks
        return shrink_blocks(*args, parts=parts)
    return shrink_blocks_ref(*args)


def sgmv(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start, seg_slot, max_rank,
         impl: str = "auto", host: HostSegments | None = None, align: int = 1):
    """`lora` with LoraArgs' fields as arguments (sgmv_ref's, then impl, host, align)."""
    return lora(y, x, LoraArgs(pool, a_off, b_off, ranks, scales, slice_starts, seg_start,
                               seg_slot, max_rank, align, host), impl)


def sgmv_expand_columns(y, v_cols, col_slot, pool, b_off, ranks, scales, slice_starts,
                        seg_start, seg_slot, max_rank, impl: str = "auto", align: int = 1):
    """`lora_expand_columns` with LoraArgs' fields as arguments (a_off unused)."""
    return lora_expand_columns(y, v_cols, col_slot, LoraArgs(
        pool, b_off, b_off, ranks, scales, slice_starts, seg_start, seg_slot, max_rank, align),
        impl)

