"""Which SGMV kernel runs a call and with which rank tile: the per-call choices, in one place.

`choose_kernel` picks a call's kernel from its shape (kernels.sgmv's module docstring says how);
`rank_tile` is the rank block the kernels tile an adapter's rank by, which a captured decode
graph bakes in (the worker keys its graphs by it); `seg_block` the block the kernels read the
segment table in. Plain Python and numpy: no torch, no triton.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Which kernel: the split-K one at decode sizes and whenever segments are long; the fused one
# when many adapters each cover few rows of a large batch (it reads each adapter's A and B once
# per row tile, where the split kernel's expand re-reads partials per column block), and above
# SPLIT_MAX_ROWS. The measurements: bench/PERF_NOTES.md, "Why the defaults".
SPLIT_MAX_ROWS = 2048
MIN_ROWS_PER_SEGMENT = 32    # 256 < T <= SPLIT_MAX_ROWS: split only with segments this long
CUBLAS_MIN_RANK = 33          # a single live segment at this rank or more: cuBLAS pairs
IMPLS = ("auto", "triton", "split", "torch", "cublas")


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


def rank_tile(rank: int) -> int:
    """The rank tile (the kernels' RANK_BLOCK) that serves adapters up to this rank: the next
    power of two, at least 16. A captured decode graph bakes one in."""
    return max(16, 1 << max(0, int(rank) - 1).bit_length())


def seg_block(n_segs: int) -> int:
    """The block the kernels read a segment table of n_segs entries in (their SEG_BLOCK): the
    next power of two, at least 16. Each is a specialization of its own."""
    return max(16, 1 << max(0, int(n_segs) - 1).bit_length())


def use_split(t_rows: int, n_segs: int, max_rank: int) -> bool:
    """The split-K kernel for T rows in n_segs segments (padded ones included), else fused."""
    if t_rows <= 256:           # decode: split, but rank 64 with ~2 rows an adapter goes fused
        return not (max_rank > 32 and t_rows >= 256 and n_segs > t_rows // 4)
    return t_rows <= SPLIT_MAX_ROWS and t_rows // max(n_segs, 1) >= MIN_ROWS_PER_SEGMENT


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


def choose_kernel(t_rows: int, n_segs: int, max_rank: int, on_cuda: bool,
                  host: HostSegments | None = None, impl: str = "auto") -> str:
    """The kernel of one SGMV call: "cublas" (GEMM pairs on the only live segment), "split",
    "fused" or "torch". impl other than "auto" forces one ("triton": the fused kernel)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "cublas" or (impl == "auto" and on_cuda):
        if cublas_segment(host) is not None:
            return "cublas"
        if impl == "cublas":
            raise ValueError("impl='cublas' needs host tables with one live segment of rank "
                             f">= {CUBLAS_MIN_RANK}")
    if impl == "auto":
        if not on_cuda:
            return "torch"
        return "split" if use_split(t_rows, n_segs, max_rank) else "fused"
    return {"triton": "fused"}.get(impl, impl)
