"""SGMV LoRA: apply each segment's adapter to its rows of a mixed batch in one call.

`sgmv` has the semantics and signature of `kernels.sgmv_ref.sgmv_ref` (read its docstring for the
pool layout). On CUDA tensors it runs a Triton kernel (split-K or fused, as `use_split` picks
from the shape); elsewhere the torch reference. `impl="triton"` forces the fused kernel and `impl="split"`
the split one (tests run them under TRITON_INTERPRET=1 on CPU); `impl="torch"` the reference.

A caller that also has the segment and offset tables on the host (an eager engine step: it
wrote them) passes them as `host=HostSegments(...)`. Then one live segment of a rank-64+
adapter runs as cuBLAS GEMM pairs on views of the pool (`impl="cublas"` forces that path):
on the H200 a cuBLAS pair beats our kernels there at every row count (rank 64, 1024 rows:
17.6 us against 28.9), and the kernels need no host tables. Captured decode graphs have no
host tables and always run the kernels (a view of one adapter's weights would be baked in).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kernels.sgmv_ref import sgmv_ref

# Which kernel: the split-K one at decode sizes and whenever segments are long; the fused one
# when many adapters each cover few rows of a large batch (it reads each adapter's A and B once
# per row tile, where the split kernel's expand re-reads partials per column block), and above
# SPLIT_MAX_ROWS. The measurements: bench/PERF_NOTES.md, "Why the defaults".
SPLIT_MAX_ROWS = 2048
MIN_ROWS_PER_SEGMENT = 32    # 256 < T <= SPLIT_MAX_ROWS: split only with segments this long


def use_split(t_rows: int, n_segs: int, max_rank: int) -> bool:
    """The split-K kernel for T rows in n_segs segments (padded ones included), else fused."""
    if t_rows <= 256:           # decode: split, but rank 64 with ~2 rows an adapter goes fused
        return not (max_rank > 32 and t_rows >= 256 and n_segs > t_rows // 4)
    return t_rows <= SPLIT_MAX_ROWS and t_rows // max(n_segs, 1) >= MIN_ROWS_PER_SEGMENT


CUBLAS_MIN_RANK = 33          # a single live segment at this rank or more: cuBLAS pairs


@dataclass(frozen=True)
class HostSegments:
    """Host copies of what the device tables hold for one call: the call's only live segment
    (see only_live_segment) and, for this layer and projection group, the pool's offset
    tables, ranks and scales."""
    live: tuple[int, int, int] | None   # (first row, end row, slot); None: none or several
    a_off: np.ndarray            # int64 [n_slices, n_slots], as a_off
    b_off: np.ndarray
    ranks: np.ndarray            # [n_slots]
    scales: np.ndarray           # [n_slots]


def only_live_segment(starts, slots) -> tuple[int, int, int] | None:
    """(first row, end row, slot) of the one segment with an adapter and rows, from host copies
    of seg_start [S+1] and seg_slot [S]; None when there are none or several. Once a step."""
    starts, slots = np.asarray(starts), np.asarray(slots)
    live = np.flatnonzero((slots >= 0) & (starts[1:] > starts[:-1]))
    if len(live) != 1:
        return None
    i = int(live[0])
    return int(starts[i]), int(starts[i + 1]), int(slots[i])


def cublas_segment(host: HostSegments | None) -> tuple[int, int, int] | None:
    """The call's only live segment when it should run on cuBLAS (its adapter's rank is at
    least CUBLAS_MIN_RANK); None otherwise."""
    if host is None or host.live is None or int(host.ranks[host.live[2]]) < CUBLAS_MIN_RANK:
        return None
    return host.live


def _cublas(y, x, pool, slice_starts, host: HostSegments, lo: int, hi: int, s: int):
    """One segment's delta as two GEMMs per targeted slice, on views of the pool."""
    r, k = int(host.ranks[s]), x.shape[1]
    xs = x[lo:hi]
    for j in range(len(slice_starts) - 1):
        ao, bo = int(host.a_off[j, s]), int(host.b_off[j, s])
        if ao < 0 or bo < 0:
            continue
        c0, c1 = slice_starts[j], slice_starts[j + 1]
        a = pool[ao:ao + r * k].view(r, k)
        bt = pool[bo:bo + r * (c1 - c0)].view(r, c1 - c0)
        y[lo:hi, c0:c1].addmm_(xs @ a.T, bt, alpha=float(host.scales[s]))
    return y


def sgmv(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start, seg_slot, max_rank,
         impl: str = "auto", host: HostSegments | None = None, align: int = 1):
    """y[rows of segment i, slice j] += scale_i * (x @ A_ij.T) @ Bt_ij; see sgmv_ref.
    host: the same tables on the host (see the module docstring); optional.
    align: the caller's promise that every offset (>= 0) in a_off and b_off is a multiple of
    this many elements (the worker's pool keeps 8); the split kernel then loads adapter weights
    in 16-byte vectors (see kernels.sgmv_split.sgmv_split). The fused kernel checks each
    offset itself."""
    if impl not in ("auto", "triton", "split", "torch", "cublas"):
        raise ValueError(f"impl must be auto, triton, split, torch or cublas, got {impl!r}")
    if impl == "cublas" or (impl == "auto" and y.is_cuda):
        seg = cublas_segment(host)
        if seg is not None:
            return _cublas(y, x, pool, slice_starts, host, *seg)
        if impl == "cublas":
            raise ValueError("impl='cublas' needs host tables with one live segment of rank "
                             f">= {CUBLAS_MIN_RANK}")
    split = impl == "split" or (impl == "auto" and y.is_cuda and use_split(
        x.shape[0], seg_slot.shape[0], max_rank))
    if split:
        from kernels.sgmv_split import sgmv_split  # deferred: CPU-only engines skip triton
        from kernels.sgmv_triton import _check
        _check(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start, seg_slot)
        return sgmv_split(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start,
                          seg_slot, max_rank, align=align)
    if impl == "triton" or (impl == "auto" and y.is_cuda):
        from kernels.sgmv_triton import sgmv_triton
        return sgmv_triton(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start,
                           seg_slot, max_rank)
    return sgmv_ref(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start, seg_slot,
                    max_rank)


def sgmv_expand_columns(y, v_cols, col_slot, pool, b_off, ranks, scales, slice_starts,
                        seg_start, seg_slot, max_rank, impl: str = "auto", align: int = 1):
    """The LoRA expand with v read from columns of the base GEMM's output (column LoRA, see
    services.worker.lora_columns and kernels.sgmv_ref.expand_columns_ref for the semantics):
    the split expand kernel on CUDA (impl="split" forces it, for the interpreter), else the
    torch reference."""
    if impl not in ("auto", "split", "torch"):
        raise ValueError(f"impl must be auto, split or torch, got {impl!r}")
    if impl == "split" or (impl == "auto" and y.is_cuda):
        from kernels.sgmv_split import expand_columns
        return expand_columns(y, v_cols, col_slot, pool, b_off, ranks, scales, slice_starts,
                              seg_start, seg_slot, max_rank, align=align)
    from kernels.sgmv_ref import expand_columns_ref
    return expand_columns_ref(y, v_cols, col_slot, pool, b_off, ranks, scales, slice_starts,
                              seg_start, seg_slot, max_rank)
