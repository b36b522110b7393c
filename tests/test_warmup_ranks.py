"""The warm-up's LoRA calls at every rank tile. A step's largest adapter rank (the pool's, on the
eager path) is the kernels' RANK_BLOCK, and the segment classes a step of many distinct adapters
makes differ by tile: the H100 saturation run of 2026-12-07 (issue 42; bench/PERF_NOTES.md,
"Saturation on an H100, first run of the issue-42 suite": 140 adapters of ranks 8-64, q/k/v/o,
--max-running 256, --max-batch-tokens 4096, --warmup-max-rank 64) compiled 14 rank-64
specializations of `_sgmv_kernel`, `_shrink_kernel` and `_expand_kernel` at SEG_BLOCK 32, 64
and 128 with N_SLICES 1 and 3 while serving. The warm-up's kernel witnesses
(services.worker.startup.kernel_warmup) have a call of each such class; tests/test_warmup_kernels.py
compares every key on a CPU engine."""
from __future__ import annotations

import torch

from kernels.sgmv_space import Space, batch_class, witnesses
from services.worker.config import EngineOptions
from services.worker.startup import kernel_warmup
from services.worker.startup.factory import build_engine
from services.worker.startup.warmup import Warmup
from tests.support import MODEL_DIR

SEVEN_B_ATTENTION = (("qkv", 4096, 3), ("o", 4096, 1))


def test_the_saturation_runs_late_specializations_have_witnesses():
    """Its configuration (128 pool slots: a step has at most 129 segments), on an H100 (PDL):
    a witness of both kernels at rank tile 64 for SEG_BLOCK 16-256 and both slice
    counts."""
    space = Space(4096, 129, 64, SEVEN_B_ATTENTION, torch.bfloat16, True)
    shapes = {g: (k, s) for g, k, s in SEVEN_B_ATTENTION}
    seen = set()
    for w in witnesses(space):
        k, s = shapes[w.group]
        cls = batch_class(w.path, w.rows, w.segs, w.rank, k, s, space.dtype, space.pdl)
        seen.add((cls[0], cls[1], s, cls[2]))             # kernel, rank tile, slices, SEG_BLOCK
    for seg in (16, 32, 64, 128, 256):
        for slices in (1, 3):
            assert ("fused", 64, slices, seg) in seen and ("split", 64, slices, seg) in seen, \
                (seg, slices)


def test_the_warm_up_makes_witnesses_at_every_rank_tile_and_leaves_the_pool_empty():
    built = build_engine(MODEL_DIR, EngineOptions(max_batch_tokens=32, max_running=12,
                                                  pool_bytes=64 << 20, pool_slots=16))
    report = Warmup(built.engine, built.pool, built.spec, 32, max_rank=64, max_running=12).run()
    space = kernel_warmup.space_of(built.engine.runner.model, built.pool, 32, 12, 64)
    assert space.max_segs == 12 and len(space.groups) == 4
    assert {w.rank for w in witnesses(space)} == {16, 32, 64}
    assert report.witnesses == len(witnesses(space)) and report.steps > 0
    assert built.pool.free_bytes == built.pool.capacity_bytes
