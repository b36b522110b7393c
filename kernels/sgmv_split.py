"""Triton SGMV for decode-sized batches: split-K shrink, then expand — two short launches, or
one launch with a grid barrier between the phases.

Semantics are kernels.sgmv_ref.sgmv_ref's. At decode sizes the work is latency-bound: one
program walking all of K for its rows is a long dependent chain. Here the shrink spreads K over
programs, each writing a partial v = x[rows, Kc] @ A[:, Kc].T into a scratch buffer (fp32, no
atomics, no memset; its K loop software-pipelined), and the expand sums the partials (all loads
in flight together) and adds (scale * v) @ Bt to one column block of y. Both phases walk work
items of live segments only (base-only and padded segments cost nothing); nothing reads device
memory on the host, so a call can be captured in a CUDA graph.

One launch or two (SplitConfig.one_launch; pick_split_config chooses from an H200 sweep). The
one-launch form runs both phases in one persistent launch whose programs meet at a grid barrier
(`_grid_sync`: an arrival counter and a generation word, reset by the last program to arrive, so
the state needs no memset between calls). A barrier inside one launch is only safe when every
program of the grid is resident at once: the first launch of each compiled variant takes one
program per SM, later launches as many as its registers and shared memory allow (at most 4).
A stream must not run two such launches concurrently (each device has one barrier word). On the
H200 the barrier saves a launch but runs fewer programs; it wins only at rank 64 with many
adapters, and only where the two launches go without programmatic dependent launch (before
Hopper, or LORAFLEET_PDL=0): with it they win everywhere. Under TRITON_INTERPRET=1, where
programs run one after another, it runs as one program.

Shapes: as sgmv_ref. Scratch: v [KS, n_slices, T, RANK_BLOCK] fp32, KS = cdiv(K, k_chunk); the
kernels use only as many K chunks (<= KS) as fill the grid once: few live tiles (one adapter,
decode) take many short chunks, many segments take fewer, longer ones. At rank 64+ a shrink item
takes part of the rank tile (SplitConfig.shrink_rank), and with few segments the last K chunk
of each (tile, slice, part) to finish sums the partials into vsum [n_slices, T, RANK_BLOCK]
(SplitConfig.reduce; per-device arrival counters that each call leaves zero), so the expand
reads one partial.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import triton

from kernels import pdl
from kernels.pdl import launch_args
from kernels.sgmv_choice import rank_tile, seg_block as _seg_block
from kernels.sgmv_split_config import (N_COUNTERS, REDUCE_MAX_SEGS, SplitConfig,  # noqa: F401
                                       parse_overrides, pick_split_config, reduces,
                                       set_overrides)
from kernels.sgmv_split_config import rank_split as _rank_split
from kernels.sgmv_split_kernels import (PER_STEP, SPIN_LIMIT, _expand_kernel,  # noqa: F401
                                        _one_launch_kernel, _shrink_kernel)


@functools.lru_cache(maxsize=None)
def _sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_BARRIERS: dict[tuple[str, int | None], torch.Tensor] = {}
_PER_SM: dict[tuple, int] = {}     # (device, constexprs) -> one-launch programs resident per SM
_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


def _device_words(table: dict, device: torch.device, n: int, what: str) -> torch.Tensor:
    """The device's n int32 words in `table`, zeroed once, allocated on first use, which must
    not be inside a CUDA-graph capture (warm up first)."""
    key = _device_key(device)
    words = table.get(key)
    if words is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"sgmv_split: call it once before capturing a CUDA graph "
                               f"(the {what} is allocated on first use)")
        words = table[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return words


def barrier_state(device: torch.device) -> torch.Tensor:
    """The device's barrier words [count, generation, timeout flag, unused] (int32, zeroed once;
    allocated on first use, not inside a capture)."""
    return _device_words(_BARRIERS, device, 4, "barrier state")


def arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's N_COUNTERS arrival counters of the reducing shrink (int32, zeroed once; each
    call leaves them zero; allocated on first use, not inside a capture). Like the barrier, one
    set a device: two reducing shrinks must not run at once (a stream runs one kernel at a
    time; a second stream would need its own set)."""
    return _device_words(_COUNTERS, device, N_COUNTERS, "arrival counter set")


def barrier_timeouts(device: torch.device) -> bool:
    """Whether a one-launch call on this device ever gave up waiting at its grid barrier (its
    output was then wrong). Reads device memory: a sync, so not for the step path."""
    state = _BARRIERS.get(_device_key(device))
    return bool(state is not None and state[2].item())


def _device_key(device: torch.device) -> tuple[str, int | None]:
    """cuda and cuda:N name one device when N is the current one."""
    if device.type == "cuda" and device.index is None:
        return device.type, torch.cuda.current_device()
    return device.type, device.index


def _resident_per_sm(compiled, num_warps: int) -> int:
    """How many programs of a compiled kernel an SM holds at once (Hopper: 64K registers, 227 KB
    shared memory, 64 warps), at most 4; 1 when the compiled kernel says nothing."""
    regs, shared = getattr(compiled, "n_regs", None), getattr(
        getattr(compiled, "metadata", None), "shared", None)
    if not regs:
        return 1
    threads = 32 * num_warps
    by_regs = 65536 // (((regs + 7) // 8 * 8) * threads)
    by_smem = (227 * 1024) // shared if shared else 32
    return max(1, min(4, by_regs, by_smem, 64 // num_warps))


def _align(cfg: SplitConfig, align: int) -> int:
    """The offsets' alignment the kernels assume: the caller's promise, capped by cfg.align."""
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    return align if cfg.align == 0 else math.gcd(cfg.align, align)


def _block_k(cfg: SplitConfig, rank_block: int) -> int:
    return min(cfg.k_chunk, cfg.block_k or (128 if rank_block <= 32 else 64))


def _progs(device: torch.device, per_sm: int = 4) -> int:
    """Programs of a two-launch call's grid: per_sm per SM (4 under TRITON_INTERPRET=1)."""
    if device.type != "cuda":
        return 4
    return per_sm * _sms(device.index if device.index is not None else
                         torch.cuda.current_device())


def _launch_shrink(x, pool, a_off, ranks, seg_start, seg_slot, v, vsum, tiles_bound, block_k,
                   cfg: SplitConfig, common) -> int:
    """The shrink phase alone: v[ks, slice, rows] partials (and, given vsum, their sum there).
    Returns the `budget` that the reader of v passes so that it sums the same number of K
    chunks: the grid size, over the rank parts (each K chunk of a tile and slice is that many
    items)."""
    n_ks, n_slices = v.shape[0], v.shape[1]
    split = _rank_split(cfg, v.shape[3])
    per_sm = cfg.shrink_progs_per_sm or cfg.progs_per_sm
    grid = max(1, min(_progs(x.device, per_sm), tiles_bound * n_slices * n_ks * split))
    budget = max(1, grid // split)
    reduce = vsum is not None
    _shrink_kernel[(grid,)](
        x, pool, a_off, ranks, seg_start, seg_slot, v, vsum if reduce else v,
        arrival_counters(x.device) if reduce else v, x.shape[1], x.shape[0], ranks.shape[0],
        seg_slot.shape[0], n_ks, x.stride(0), budget, BLOCK_K=block_k, STAGES=cfg.stages,
        RANK_SPLIT=split, REDUCE=reduce, KS_MAX=n_ks, **common,
        **launch_args(x.device, x.shape[0] <= pdl.SGMV_MAX_ROWS))
    return budget


@dataclass
class Shrunk:
    """The output of `shrink`: what an expand (or a GEMM epilogue) needs to read v."""
    v: torch.Tensor        # fp32 [KS, n_slices, T, RANK_BLOCK] partial sums over K chunks
    budget: int            # from the shrink's grid size: fixes how many chunks are live
    block_m: int           # the shrink's row tile
    seg_block: int
    vsum: torch.Tensor | None = None   # fp32 [n_slices, T, RANK_BLOCK]: their sum (reduce)


def shrink(x, pool, a_off, ranks, seg_start, seg_slot, n_slices: int, max_rank: int,
           config: SplitConfig | None = None, align: int = 1) -> Shrunk:
    """Only the shrink phase of sgmv_split, for a consumer that applies Bt itself
    (a GEMM epilogue). Arguments as sgmv_split's; no device reads."""
    t_rows, k = x.shape
    n_segs = seg_slot.shape[0]
    cfg = config or pick_split_config(t_rows, max_rank, n_segs=n_segs)
    rb = rank_tile(max_rank)
    n_ks = triton.cdiv(k, cfg.k_chunk)
    v = torch.empty((n_ks, n_slices, t_rows, rb), dtype=torch.float32, device=x.device)
    seg_block = _seg_block(n_segs)
    common = dict(N_SLICES=n_slices, SEG_BLOCK=seg_block, BLOCK_M=cfg.block_m, RANK_BLOCK=rb,
                  DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
                  UPCAST=x.dtype == torch.bfloat16 and not x.is_cuda, ALIGN=_align(cfg, align),
                  num_warps=cfg.num_warps, num_stages=1)
    tiles_bound = triton.cdiv(t_rows, cfg.block_m) + n_segs
    vsum = None
    if reduces(cfg, t_rows, n_segs, n_slices, rb):
        vsum = torch.empty((n_slices, t_rows, rb), dtype=torch.float32, device=x.device)
    budget = _launch_shrink(x, pool, a_off, ranks, seg_start, seg_slot, v, vsum, tiles_bound,
                            _block_k(cfg, rb // _rank_split(cfg, rb)), cfg, common)
    return Shrunk(v, budget, cfg.block_m, seg_block, vsum)


def expand(y, shrunk: Shrunk, pool, b_off, ranks, scales, slice_starts, seg_start, seg_slot,
           max_rank: int, config: SplitConfig | None = None, align: int = 1) -> torch.Tensor:
    """The expand phase of sgmv_split over the partials of an earlier `shrink` call with the
    same segments: y[rows, slice] += scale * v @ Bt, in place. No device reads."""
    t_rows = y.shape[0]
    n_segs = seg_slot.shape[0]
    if t_rows == 0 or n_segs == 0:
        return y
    cfg = config or pick_split_config(t_rows, max_rank, n_segs=n_segs)
    v = shrunk.v
    reduce = shrunk.vsum is not None
    return _launch_expand(y, pool, b_off, ranks, scales, slice_starts, seg_start, seg_slot, cfg,
                          align, v=v, vsum=shrunk.vsum if reduce else v, col_slot=ranks,
                          stride_v=0, n_ks=v.shape[0], budget=shrunk.budget,
                          block_m=shrunk.block_m, seg_block=shrunk.seg_block,
                          rank_block=v.shape[3], reduce=reduce, cols=False)


def _launch_expand(y, pool, b_off, ranks, scales, slice_starts, seg_start, seg_slot,
                   cfg: SplitConfig, align: int, *, v, vsum, col_slot, stride_v: int, n_ks: int,
                   budget: int | None, block_m: int, seg_block: int, rank_block: int,
                   reduce: bool, cols: bool) -> torch.Tensor:
    """The expand kernel's launch for expand (partials) and expand_columns (GEMM columns);
    budget None: the grid size."""
    t_rows, n_segs = y.shape[0], seg_slot.shape[0]
    n_slices = len(slice_starts) - 1
    widths = [slice_starts[i + 1] - slice_starts[i] for i in range(n_slices)]
    max_col_blocks = triton.cdiv(max(widths), cfg.block_n)
    tiles_bound = triton.cdiv(t_rows, block_m) + n_segs
    s = list(slice_starts) + [slice_starts[-1]] * (5 - len(slice_starts))
    grid = max(1, min(_progs(y.device, cfg.progs_per_sm),
                      tiles_bound * n_slices * max_col_blocks))
    _expand_kernel[(grid,)](
        y, pool, b_off, ranks, scales, seg_start, seg_slot, v, vsum, col_slot, t_rows,
        ranks.shape[0], n_segs, n_ks, max_col_blocks, y.stride(0), stride_v,
        grid if budget is None else budget, *s, BLOCK_N=cfg.block_n, KS_MAX=n_ks,
        REDUCE=reduce, COLS=cols, ALIGN=_align(cfg, align), N_SLICES=n_slices,
        SEG_BLOCK=seg_block, BLOCK_M=block_m, RANK_BLOCK=rank_block,
        DOT_PREC="ieee" if y.dtype == torch.float32 else "tf32",
        UPCAST=y.dtype == torch.bfloat16 and not y.is_cuda, num_warps=cfg.num_warps,
        num_stages=1, **launch_args(y.device, t_rows <= pdl.SGMV_MAX_ROWS))
    return y


def expand_columns(y, v_cols, col_slot, pool, b_off, ranks, scales, slice_starts, seg_start,
                   seg_slot, max_rank: int, config: SplitConfig | None = None,
                   align: int = 1) -> torch.Tensor:
    """The split expand with v read from columns of the base GEMM's output instead of the
    shrink's partials (the engine's column LoRA: each adapter's A sits as extra rows of the
    base weight, so x @ [W; A...].T gives y and every x @ A.T at once). For a segment with slot
    s and c = col_slot[s] >= 0, slice j's v is v_cols[rows, (c * n_slices + j) * RANK_BLOCK:
    + RANK_BLOCK] (RANK_BLOCK = rank_tile(max_rank); columns past the adapter's rank hold
    zeros); segments whose slot has no column block get nothing. Then y[rows, slice j] +=
    (scale * v) @ Bt as expand does. v_cols [T, >= n_col_slots * n_slices * RANK_BLOCK] (a
    strided view is fine: unit column stride); col_slot int32 [n_slots]. No device reads."""
    t_rows = y.shape[0]
    n_segs = seg_slot.shape[0]
    if t_rows == 0 or n_segs == 0:
        return y
    if v_cols.stride(1) != 1 or v_cols.shape[0] != t_rows:
        raise ValueError("v_cols must be [T, columns] with unit column stride")
    cfg = config or pick_split_config(t_rows, max_rank, n_segs=n_segs)
    return _launch_expand(y, pool, b_off, ranks, scales, slice_starts, seg_start, seg_slot, cfg,
                          align, v=v_cols, vsum=v_cols, col_slot=col_slot,
                          stride_v=v_cols.stride(0), n_ks=1, budget=None,
                          block_m=cfg.block_m, seg_block=_seg_block(n_segs),
                          rank_block=rank_tile(max_rank), reduce=False, cols=True)


def sgmv_split(y, x, pool, a_off, b_off, ranks, scales, slice_starts, seg_start, seg_slot,
               max_rank: int, config: SplitConfig | None = None, *, k_chunk: int | None = None,
               block_n: int | None = None, align: int = 1) -> torch.Tensor:
    """Same contract as kernels.sgmv_ref.sgmv_ref (checked by the caller); returns y.

    config defaults to pick_split_config(T, max_rank, n_segs=len(seg_slot)); k_chunk and
    block_n override its fields. align: the caller's promise that every offset in a_off and
    b_off (>= 0) is a multiple of this many elements (the worker's pool: 8). The kernels then
    load A and Bt in 16-byte vectors; without it the compiler, which cannot see the alignment
    of an offset read from memory, loads them an element at a time (bench/PERF_NOTES.md,
    "Why the defaults").
    """
    t_rows, k = x.shape
    n_segs = seg_slot.shape[0]
    if t_rows == 0 or n_segs == 0:
        return y
    cfg = config or pick_split_config(
        t_rows, max_rank, pdl.enabled(x.device) and t_rows <= pdl.SGMV_MAX_ROWS, n_segs)
    cfg = dataclasses.replace(cfg, k_chunk=k_chunk or cfg.k_chunk, block_n=block_n or cfg.block_n)
    n_slices = len(slice_starts) - 1
    if not cfg.one_launch:
        shrunk = shrink(x, pool, a_off, ranks, seg_start, seg_slot, n_slices, max_rank, cfg,
                        align)
        return expand(y, shrunk, pool, b_off, ranks, scales, slice_starts, seg_start, seg_slot,
                      max_rank, cfg, align)
    # One launch, without PDL (on the H200 PDL made it 1.2 us slower at rank 64, 64-256 rows).
    # The grid barrier needs every program resident at once: the first launch of a
    # compiled variant takes one program per SM (always resident), later ones as many as its
    # registers and shared memory allow (at most 4 per SM). The interpreter runs programs one
    # by one, so there the grid is one program.
    k_chunk, block_n, on_gpu = cfg.k_chunk, cfg.block_n, x.is_cuda
    rb = rank_tile(max_rank)
    block_m = cfg.block_m
    block_k = _block_k(cfg, rb)
    n_ks = triton.cdiv(k, k_chunk)
    v = torch.empty((n_ks, n_slices, t_rows, rb), dtype=torch.float32, device=x.device)
    widths = [slice_starts[i + 1] - slice_starts[i] for i in range(n_slices)]
    max_col_blocks = triton.cdiv(max(widths), block_n)
    tiles_bound = triton.cdiv(t_rows, block_m) + n_segs
    seg_block = _seg_block(n_segs)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    upcast = x.dtype == torch.bfloat16 and not on_gpu
    s = list(slice_starts) + [slice_starts[-1]] * (5 - len(slice_starts))
    common = dict(N_SLICES=n_slices, SEG_BLOCK=seg_block, BLOCK_M=block_m, RANK_BLOCK=rb,
                  DOT_PREC=prec, UPCAST=upcast, num_warps=cfg.num_warps, num_stages=1)
    dev_index = x.device.index if x.device.index is not None else (
        torch.cuda.current_device() if on_gpu else 0)
    consts = dict(common, BLOCK_K=block_k, BLOCK_N=block_n, STAGES=cfg.stages, KS_MAX=n_ks,
                  SPIN_LIMIT=SPIN_LIMIT, ALIGN=_align(cfg, align))
    key = (dev_index, x.dtype, tuple(sorted(consts.items())))
    bound = tiles_bound * n_slices * max(n_ks, max_col_blocks)
    per_sm = _PER_SM.get(key, 1)
    grid = max(1, min(per_sm * _sms(dev_index), bound)) if on_gpu else 1
    compiled = _one_launch_kernel[(grid,)](
        y, x, pool, a_off, b_off, ranks, scales, seg_start, seg_slot, v,
        barrier_state(x.device), k, t_rows, ranks.shape[0], n_segs, n_ks, max_col_blocks,
        x.stride(0), y.stride(0), *s, **consts, USE_PDL=False, launch_pdl=False)
    if on_gpu and key not in _PER_SM:
        _PER_SM[key] = _resident_per_sm(compiled, cfg.num_warps)
    return y
