"""The split SGMV's launch shapes: SplitConfig, the pick from T rows and the rank tile, and the
overrides an engine's PerfConfig sets over it (kernels.sgmv_split runs them)."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class SplitConfig:
    """Tiles and launch shape of the split kernel; pick_split_config chooses them."""
    block_m: int = 16         # rows per tile
    block_n: int = 64         # columns per expand step
    k_chunk: int = 256        # the shortest K chunk a shrink item takes
    num_warps: int = 4
    stages: int = 3           # software pipelining of the shrink's K loop
    one_launch: bool = False  # both phases in one launch with a grid barrier (GPU only)
    progs_per_sm: int = 4     # two-launch grids: programs per SM
    block_k: int = 0          # the shrink's K step (0: 128 at rank <= 32, else 64)
    # the rank rows of A one shrink item takes (0: the whole rank tile). Narrower items give
    # more, shorter chains: rank 64 in four 16-row items, with its own grid of
    # shrink_progs_per_sm programs an SM (0: progs_per_sm), as many as rank 16's
    shrink_rank: int = 0
    shrink_progs_per_sm: int = 0
    # the shrink's last K chunk of a (tile, slice, rank part) to finish sums the partials
    # (an arrival counter), so that the expand reads one partial, not one a K chunk
    reduce: bool = False
    # 0: trust the caller's `align` (every A and Bt offset a multiple of that many elements);
    # N > 0: at most N of it (align=1 turns the vector loads of adapter weights off, for A/B)
    align: int = 0


_OVERRIDES: dict = {}        # set_overrides: the engine's PerfConfig.sgmv_split


def set_overrides(text: str) -> None:
    """Fields of SplitConfig set over what pick_split_config chooses, "k_chunk=512,
    progs_per_sm=2" (the engine's build sets its PerfConfig.sgmv_split; A/B runs)."""
    global _OVERRIDES
    _OVERRIDES = parse_overrides(text)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@functools.lru_cache(maxsize=8)
def parse_overrides(text: str) -> dict:
    fields = {f.name: f.type for f in dataclasses.fields(SplitConfig)}
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, val = (part.strip() for part in item.partition("="))
        if key not in fields:
            raise ValueError(f"LORAFLEET_SGMV_SPLIT: unknown field {key!r} ({sorted(fields)})")
        if not eq or not val:
            raise ValueError(f"LORAFLEET_SGMV_SPLIT: {key!r} needs a value ({key}=...)")
        if fields[key] in (bool, "bool"):
            if val.lower() not in _TRUE + _FALSE:
                raise ValueError(f"LORAFLEET_SGMV_SPLIT: {key}={val!r} is not a boolean")
            out[key] = val.lower() in _TRUE
        else:
            try:
                out[key] = int(val)
            except ValueError:
                raise ValueError(f"LORAFLEET_SGMV_SPLIT: {key}={val!r} is not an integer") \
                    from None
    return out


REDUCE_MAX_SEGS = 16     # rank 64+ decode calls with at most this many segments: `reduce`
N_COUNTERS = 8192       # (tile, slice, rank part) arrival counters a device keeps for `reduce`


def rank_split(cfg: SplitConfig, rank_block: int) -> int:
    """How many items a shrink cuts the rank tile into (parts of at least 16 rows of A)."""
    part = min(rank_block, max(16, cfg.shrink_rank or rank_block))
    return rank_block // part


def reduces(cfg: SplitConfig, t_rows: int, n_segs: int, n_slices: int, rank_block: int) -> bool:
    """Whether a two-launch shrink of this call sums its partials (cfg.reduce, when its
    (tile, slice, rank part) items fit the device's N_COUNTERS arrival counters)."""
    tiles_bound = -(-t_rows // cfg.block_m) + n_segs
    return cfg.reduce and tiles_bound * n_slices * rank_split(cfg, rank_block) <= N_COUNTERS


def pick_split_config(t_rows: int, max_rank: int, pdl_on: bool = True,
                      n_segs: int | None = None, overrides: dict | None = None) -> SplitConfig:
    """The config for T rows and this rank tile (_pick), with the overrides over it (default:
    set_overrides'). pdl_on: whether the two-launch form would launch with programmatic
    dependent launch. n_segs: the length of the call's segment table (live, base-only and
    padded segments: a bound on the adapters present), when the caller knows it."""
    cfg = _pick(t_rows, max_rank, pdl_on, n_segs)
    over = _OVERRIDES if overrides is None else overrides
    return dataclasses.replace(cfg, **over) if over else cfg


def _pick(t_rows: int, max_rank: int, pdl_on: bool, n_segs: int | None = None) -> SplitConfig:
    """The launch shape for T rows at this rank tile. Up to 256 rows: 16-row tiles, 256-wide K
    chunks and 128-column expand steps; grids of as many programs an SM as the registers leave
    resident (tests/test_sgmv.py checks it with ptxas): four at rank 16, three at 32, two at
    64+; above 16 rows the one-launch form only where two launches would go without PDL. At
    rank 64+ the shrink cuts the rank tile in items of 32 rows of A on a grid of four programs
    an SM; with at most REDUCE_MAX_SEGS segments it also sums the partials (`reduce`), and
    segments of 24+ rows on average take 32-row tiles. Above 256 rows: 64-row tiles, 512-wide K
    chunks, two launches. The measurements: bench/PERF_NOTES.md, "Why the defaults"."""
    big_rank = max_rank > 32
    if t_rows > 256:                 # prefill-sized: 64-row tiles, K in 512-wide chunks
        return SplitConfig(block_m=64, block_n=128 if big_rank else 256, k_chunk=512)
    if not big_rank:     # the rank-32 expand holds 166 registers a thread: three an SM
        return SplitConfig(block_n=128, progs_per_sm=4 if max_rank <= 16 else 3)
    # rank 64+: the shrink takes 32 rows of A an item, four programs an SM; with few segments
    # it sums the partials too
    if n_segs is not None and n_segs <= REDUCE_MAX_SEGS:
        narrow = t_rows <= 64
        return SplitConfig(block_m=32 if t_rows // n_segs >= 24 else 16, block_n=128,
                           progs_per_sm=2, one_launch=t_rows > 16 and not pdl_on,
                           shrink_rank=16 if narrow else 32,
                           shrink_progs_per_sm=4 if narrow else 3, reduce=True)
    return SplitConfig(block_n=128, progs_per_sm=2, one_launch=t_rows > 16 and not pdl_on,
                       shrink_rank=32, shrink_progs_per_sm=4)
