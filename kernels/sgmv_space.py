"""Which Triton specializations a worker's LoRA calls can need: calls in classes that launch the
same ones, and, over every step a worker can form, each class with its smallest call.

A LoRA call (kernels.sgmv: a projection group's SGMV, column LoRA's expand, row LoRA's shrink)
launches kernels whose constexprs follow from the group's shape (K and the slices: the model's),
the dtype, PDL, the rank bound's tile, and the batch: its rows T and its segments n, through the
choices each call makes (choose_kernel's split or fused kernel, their configs pick_split_config
and pick_config, the segment table's block seg_block, PDL up to SGMV_MAX_ROWS rows, the split
shrink's `reduces`). `batch_class` is what a call's specializations depend on: calls of one
class launch the same ones (tests/test_warmup_kernels.py checks it against the launchers).

`witnesses` walks the steps a worker can form (T up to its token budget, n up to its sequences
and the pool's adapters plus the base rows' segment, every rank tile up to the warm-up's rank)
at the sizes where the choices change (`size_classes`: each power of two and its neighbours,
T and n crossed) and keeps the first call of each class: the warm-up launches those
(services.worker.startup.kernel_warmup). A step's T and n are independent there, unlike in the
warm-up's engine steps, whose decode rows and prompt lengths reach only some (T, n) (at rank 64,
256 rows in more than 64 segments go fused, and 33-64 segments of 1,056-2,048 rows take the
split kernel in 64-row tiles at SEG_BLOCK 64: the engine steps reach neither). The CPU tests
scan every (T, n) of some configurations and find no class more than the size classes do.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from kernels.pdl import SGMV_MAX_ROWS
from kernels.sgmv_choice import choose_kernel, rank_tile, seg_block
from kernels.sgmv_split_config import pick_split_config, reduces
from kernels.sgmv_triton import pick_config

PATHS = ("sgmv", "columns", "rows")
_NO_DEVICE = torch.device("meta")       # pick_config's device only sizes the grid


@dataclass(frozen=True)
class Space:
    """The LoRA calls a worker's steps can make."""
    max_tokens: int                 # a step's rows: the token budget
    max_segs: int                   # a step's segments: its sequences, the pool's slots + base
    max_rank: int                   # the largest adapter rank served without compiling
    groups: tuple[tuple[str, int, int], ...]    # (group, K, slices) of each SGMV group
    dtype: torch.dtype
    pdl: bool                       # whether the kernels launch with PDL on this device
    columns: tuple[int, int] = (0, 0)   # column LoRA's expand: (slices, its rank tile); 0: none
    rows: int = 0                   # row LoRA's shrink in steps of up to this many rows; 0: none


@dataclass(frozen=True)
class Witness:
    """One call: path (PATHS), the projection group, rows T, segments n, rank bound."""
    path: str
    group: str
    rows: int
    segs: int
    rank: int


def size_classes(bound: int) -> list[int]:
    """1, 2, 3, 7, 8, 15, 16, 17, each power of two from 32 with its neighbours, and bound, up
    to bound: a size on each side of every power-of-two rule."""
    out = {1, 2, 3, 7, 8, 15, 16, 17, bound}
    p = 32
    while p <= bound:
        out |= {p - 1, p, p + 1}
        p *= 2
    return sorted(t for t in out if 1 <= t <= bound)


def rank_tiles(max_rank: int) -> list[int]:
    """The rank tiles of ranks 1..max_rank: 16, 32, ... up to rank_tile(max_rank)."""
    tiles = [16]
    while tiles[-1] < rank_tile(max_rank):
        tiles.append(2 * tiles[-1])
    return tiles


def batch_class(path: str, t_rows: int, n_segs: int, max_rank: int, k: int, n_slices: int,
                dtype: torch.dtype, pdl: bool) -> tuple:
    """What the specializations of a LoRA call of this path, group shape (K, slices), dtype and
    PDL depend on in its batch (T rows, n segments, the rank bound), as the launchers decide
    it: calls of one class launch the same kernels with the same constexprs. An SGMV call on
    cuBLAS (one live segment of a rank-33+ adapter, eager steps only) launches none; a call of
    the same shape with several live segments does, so the class is the Triton one."""
    pdl_rows = pdl and t_rows <= SGMV_MAX_ROWS
    segs = seg_block(n_segs)
    if path == "rows":                     # kernels.shrink_blocks: one kernel, whatever T, n
        return (path, pdl_rows)
    if path == "columns":                  # kernels.sgmv_split.expand_columns
        return (path, rank_tile(max_rank), segs, pdl_rows,
                pick_split_config(t_rows, max_rank, n_segs=n_segs))
    kind = choose_kernel(t_rows, n_segs, max_rank, True)
    rb = rank_tile(max_rank)
    if kind == "fused":                    # kernels.sgmv_triton.sgmv_triton
        return (kind, rb, segs, pdl_rows, _fused_config(t_rows, k, max_rank, dtype))
    cfg = pick_split_config(t_rows, max_rank, pdl_rows, n_segs)     # kernels.sgmv_split
    return (kind, rb, segs, pdl_rows, cfg, reduces(cfg, t_rows, n_segs, n_slices, rb))


@functools.lru_cache(maxsize=256)
def _fused_config(t_rows: int, k: int, max_rank: int, dtype: torch.dtype):
    """The fused kernel's config (its grid size aside): the same for every n of a T."""
    return dataclasses.replace(pick_config(t_rows, k, max_rank, dtype, _NO_DEVICE),
                               num_programs=0)


def calls(space: Space, rows: Iterable[int], segs: Callable[[int], Iterable[int]]
          ) -> Iterator[tuple[str, str, int, int, int, int, int]]:
    """(path, group, K, slices, T, n, rank) of every call of the space at these row counts and,
    for T rows, the segment counts segs(min(T, space.max_segs)) (none above that bound)."""
    tiles = rank_tiles(space.max_rank)
    col_slices, col_rank = space.columns
    for t in rows:
        for n in segs(min(t, space.max_segs)):
            for r in tiles:
                for g, k, s in space.groups:
                    yield ("sgmv", g, k, s, t, n, r)
            if col_slices:
                yield ("columns", "qkv", 0, col_slices, t, n, col_rank)
            if t <= space.rows:
                yield ("rows", "o", 0, 1, t, n, col_rank)


def witnesses(space: Space) -> list[Witness]:
    """The first call of each class (batch_class, per path and group) among the space's calls
    at size_classes of T and of n: the one of fewest rows, then fewest segments."""
    found: dict[tuple, Witness] = {}
    for path, group, k, n_slices, t, n, rank in calls(space, size_classes(space.max_tokens),
                                                      size_classes):
        key = (path, group, batch_class(path, t, n, rank, k, n_slices, space.dtype, space.pdl))
        if key not in found:
            found[key] = Witness(path, group, t, n, rank)
    return list(found.values())
