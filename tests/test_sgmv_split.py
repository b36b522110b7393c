"""The split-K SGMV (kernels/sgmv_split.py) against the torch reference under the Triton
interpreter: mixed ranks, untargeted slices, several column blocks, ragged and chunked K, and
one-tile batches where the shrink spreads K over programs; both the two-launch form and the
one-launch form with its grid barrier (one program under the interpreter). (Run in a child process: the
interpreter must be switched on before triton loads.)"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def case(T, K, slices, ranks_list, seg_sizes, dtype, **knobs):
    out, ref = outputs(T, K, slices, ranks_list, seg_sizes, dtype, **knobs)
    return (out.float() - ref).abs().max().item()


def outputs(T, K, slices, ranks_list, seg_sizes, dtype, align=1, **knobs):
    """(sgmv_split's output, the fp32 reference) for one case. The pool here keeps every
    offset a multiple of 8 elements, as the worker's does, so align may be 8."""
    from kernels.sgmv_ref import sgmv_ref
    from kernels.sgmv_split import SplitConfig, sgmv_split
    c = tables(T, K, slices, ranks_list, seg_sizes, dtype)
    pool, x, y = c["pool"], c["x"], c["y"]
    args = c["args"]
    ref = sgmv_ref(y.clone().float(), x.float(), pool.float(), *args)
    cfg = SplitConfig(**dict(dict(block_m=16, block_n=32, k_chunk=64), **knobs))
    return sgmv_split(y.clone(), x, pool, *args, config=cfg, align=align), ref


def columns_outputs(T, K, slices, ranks_list, seg_sizes, dtype, col_slots):
    """expand_columns (interpreted), its torch reference, and the fp32 LoRA of the segments
    whose slot has a column block: v = x @ A.T laid out as the column LoRA's GEMM gives it
    (slot s's slice j at columns (col_slots[s] * n_slices + j) * 16, rounded to dtype)."""
    from kernels.sgmv_ref import expand_columns_ref, sgmv_ref
    from kernels.sgmv_split import SplitConfig, expand_columns
    c = tables(T, K, slices, ranks_list, seg_sizes, dtype)
    pool, x, y = c["pool"], c["x"], c["y"]
    a_off, b_off, ranks, scales, _, seg_start, seg_slot, max_rank = c["args"]
    ns, rb = len(slices) - 1, 16
    v_cols = torch.zeros(T, max(col_slots) * ns * rb + ns * rb + 8)[:, 3:].to(dtype)  # a view
    for s, col in enumerate(col_slots):
        for j in range(ns):
            if col >= 0 and a_off[j, s] >= 0:
                r, ao = int(ranks[s]), int(a_off[j, s])
                a = pool[ao:ao + r * K].view(r, K).float()
                v_cols[:, (col * ns + j) * rb:(col * ns + j) * rb + r] = (x.float() @ a.T).to(
                    dtype)
    col = torch.tensor(col_slots, dtype=torch.int32)
    args = (pool, b_off, ranks, scales, slices, seg_start, seg_slot, max_rank)
    got = expand_columns(y.clone(), v_cols, col, *args,
                         config=SplitConfig(block_m=16, block_n=32))
    ref = expand_columns_ref(y.clone(), v_cols, col, *args)
    only = torch.where(col[seg_slot.clamp(min=0).long()] >= 0, seg_slot, -1).to(torch.int32)
    fp32 = sgmv_ref(y.clone().float(), x.float(), pool.float(), a_off, b_off, ranks, scales,
                    slices, seg_start, only, max_rank)
    return got, ref, fp32


def tables(T, K, slices, ranks_list, seg_sizes, dtype) -> dict:
    """A random pool (offsets multiples of 8), x, y and the SGMV tables for one case."""
    torch.manual_seed(T * 1000 + K)
    parts, off, n_slots, ns = [], 0, len(ranks_list), len(slices) - 1
    a_off = torch.full((ns, n_slots), -1, dtype=torch.int64)
    b_off = a_off.clone()
    for s, r in enumerate(ranks_list):
        for j in range(ns):
            if (s + j) % 3 == 2:                         # some adapters skip some slices
                continue
            n = slices[j + 1] - slices[j]
            for table, size in ((a_off, r * K), (b_off, r * n)):
                table[j, s] = off
                parts += [torch.randn(size) * 0.1, torch.zeros((-(off + size)) % 8)]
                off += size + (-(off + size)) % 8
    pool = torch.cat(parts).to(dtype)
    x, y = torch.randn(T, K).to(dtype), torch.randn(T, slices[-1]).to(dtype)
    starts, slots = [0], []
    for size, sl in seg_sizes:
        starts.append(starts[-1] + size)
        slots.append(sl)
    seg_start = torch.tensor(starts + [T] * 3, dtype=torch.int32)     # 3 padded segments
    seg_slot = torch.tensor(slots + [-1] * 3, dtype=torch.int32)
    ranks = torch.tensor(ranks_list, dtype=torch.int32)
    scales = torch.rand(n_slots) + 0.5
    return dict(pool=pool, x=x, y=y, args=(a_off, b_off, ranks, scales, slices, seg_start,
                                           seg_slot, max(ranks_list)))


# the launch forms, a K step other than the one derived from the rank, and shrink items of
# part of the rank tile (rank 33's tile of 64 in parts of 16: the last part has no live row),
# and the offsets' alignment promised
VARIANTS = [{}, {"one_launch": True}, {"block_k": 32}, {"one_launch": True, "block_k": 32},
            {"shrink_rank": 16}, {"shrink_rank": 32, "block_k": 32},
            {"reduce": True}, {"reduce": True, "shrink_rank": 16},
            {"reduce": True, "block_m": 32},
            # offsets promised multiples of 8 (vector loads of A and Bt), in each form
            {"align": 8}, {"align": 8, "one_launch": True},
            {"align": 8, "reduce": True, "shrink_rank": 16}]
CASES = [
    (10, 96, (0, 40, 72, 104), [1, 8, 16, 33], [(3, 0), (1, 2), (4, -1), (2, 3)], 1e-3),
    (37, 128, (0, 64), [4, 64], [(20, 1), (17, 0)], 1e-3),
    (5, 64, (0, 128, 256), [16, 2], [(2, 0), (3, 1)], 1e-3),
    (3, 256, (0, 48), [8], [(3, 0)], 1e-3),
    (20, 200, (0, 48), [8, 4], [(3, 0), (17, 1)], 1e-3),
]


def test_split_kernel_matches_reference_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok") == len(VARIANTS) * len(CASES) + 3 + len(COLUMN_CASES)


# expand_columns: (T, K, slices, ranks, segments, dtype, column block of each slot (-1: none),
# tolerance). Slots without a block get nothing; untargeted slices none either.
COLUMN_CASES = [
    (10, 96, (0, 40, 72, 104), [1, 8, 16, 3], [(3, 0), (1, 2), (4, -1), (2, 3)],
     torch.float32, [2, -1, 0, 5], 1e-4),
    (20, 64, (0, 48), [8, 16], [(3, 0), (17, 1)], torch.bfloat16, [0, 1], 0.05),
    (7, 64, (0, 128, 256), [16, 2, 4], [(2, 0), (2, 1), (3, 2)], torch.float32, [-1, 3, 1],
     1e-4),
]


if __name__ == "__main__":
    for T, K, slices, ranks, segs, tol in CASES:
        for knobs in VARIANTS:
            err = case(T, K, slices, ranks, segs, torch.float32, **knobs)
            assert err < tol, (T, K, knobs, err)
            print("ok", T, K, knobs, err)
    for align in (1, 8):
        err = case(12, 96, (0, 40, 72, 104), [1, 8, 16, 33], [(3, 0), (1, 2), (6, 3), (2, 1)],
                   torch.bfloat16, align=align, block_k=32, shrink_rank=16, reduce=True)
        assert err < 0.05, (align, err)
        print("ok bf16", align, err)
    # the reducing shrink sums the partials in the expand's order: the very same bits
    args = (20, 200, (0, 48), [64, 4], [(3, 0), (17, 1)], torch.float32)
    plain, _ = outputs(*args, shrink_rank=16)
    reduced, _ = outputs(*args, shrink_rank=16, reduce=True)
    assert torch.equal(plain, reduced), (plain - reduced).abs().max()
    print("ok reduce bits")
    for T, K, slices, ranks, segs, dtype, cols, tol in COLUMN_CASES:
        got, ref, fp32 = columns_outputs(T, K, slices, ranks, segs, dtype, cols)
        err, err_ref = (got.float() - fp32).abs().max().item(), (got - ref).abs().max().item()
        assert err < tol and err_ref < tol, (T, K, err, err_ref)
        print("ok columns", T, K, err, err_ref)


def test_pick_takes_one_launch_only_for_big_ranks_without_pdl():
    """Rank 64 above 16 rows: the grid-barrier form only where the two launches would go
    without programmatic dependent launch; overrides (PerfConfig.sgmv_split, LORAFLEET_SGMV_SPLIT
    for a worker) set picked fields, and name no field that does not exist."""
    import pytest
    from kernels.sgmv_split import parse_overrides, pick_split_config, set_overrides
    set_overrides("")
    assert not pick_split_config(64, 64, pdl_on=True).one_launch
    assert pick_split_config(64, 64, pdl_on=False).one_launch
    assert not pick_split_config(16, 64, pdl_on=False).one_launch
    assert not pick_split_config(64, 16, pdl_on=False).one_launch
    assert not pick_split_config(1024, 64, pdl_on=False).one_launch
    # decode rank 64+: shrink items of 32 rows of A; rank 32 and below, and prefill: whole tile
    from kernels.sgmv_split import _rank_split
    for t, r, split in ((64, 64, 2), (256, 128, 4), (64, 32, 1), (64, 16, 1), (1024, 64, 1)):
        cfg = pick_split_config(t, r)
        assert _rank_split(cfg, max(16, r)) == split, (t, r, cfg)
    # few segments at rank 64+ decode: the shrink sums the partials; many, or unknown: not
    assert pick_split_config(64, 64, n_segs=9).reduce
    assert pick_split_config(256, 64, n_segs=9).block_m == 32      # ~28 rows a segment
    assert pick_split_config(256, 64, n_segs=16).block_m == 16
    assert not pick_split_config(64, 64, n_segs=33).reduce
    assert not pick_split_config(64, 64).reduce
    assert not pick_split_config(64, 16, n_segs=9).reduce
    assert not pick_split_config(1024, 64, n_segs=9).reduce
    over = parse_overrides("one_launch=0,k_chunk=512,progs_per_sm=2")
    cfg = pick_split_config(64, 64, pdl_on=False, overrides=over)
    assert (cfg.one_launch, cfg.k_chunk, cfg.progs_per_sm, cfg.block_n) == (False, 512, 2, 128)
    cfg = pick_split_config(64, 64, pdl_on=False,
                            overrides=parse_overrides(" one_launch = off , block_n=64 "))
    assert (cfg.one_launch, cfg.block_n) == (False, 64)
    set_overrides("one_launch=True")                          # the engine's build sets these
    try:
        assert pick_split_config(64, 64).one_launch
    finally:
        set_overrides("")
    for bad in ("blockn=64", "one_launch=maybe", "one_launch", "k_chunk=big"):
        with pytest.raises(ValueError, match=bad.split("=")[0]):
            parse_overrides(bad)
        from services.worker.perf_config import PerfConfig
        with pytest.raises(ValueError, match="LORAFLEET_SGMV_SPLIT"):
            PerfConfig.from_env({"LORAFLEET_SGMV_SPLIT": bad})
