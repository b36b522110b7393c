"""The warm-up's many-adapter steps at every rank tile: a step's largest adapter rank is the
kernels' RANK_BLOCK, so the segment-count classes a step of many distinct adapters makes must be
run with an adapter of each tile among them. (The H100 saturation run of 2026-12-07 compiled 14
rank-64 SGMV specializations while serving 140 mixed-rank adapters: the warm-up had run many
adapters only at the rank-16 tile.)"""
from __future__ import annotations

from services.worker.config import EngineOptions
from services.worker.startup.factory import build_engine
from services.worker.startup.warmup import Warmup, token_counts
from tests.support import MODEL_DIR


def test_many_adapter_steps_run_at_every_rank_tile():
    built = build_engine(MODEL_DIR, EngineOptions(max_batch_tokens=32, max_running=12,
                                                  pool_bytes=64 << 20, pool_slots=16))
    engine, pool = built.engine, built.pool
    slot_of, steps = {}, []
    place, run = pool.place, engine.runner.run

    def placing(key, staged, columns=True):
        slot = place(key, staged, columns)
        slot_of[key] = (slot, int(staged.config["r"]))
        return slot

    def recording(batch):
        steps.append({b.seq.slot for b in batch} - {-1})
        return run(batch)
    pool.place, engine.runner.run = placing, recording
    warm = Warmup(engine, pool, built.spec, 32, max_rank=64, max_running=12)
    labels = [label for label, _ in warm.adapter_sets()]
    assert {"many adapters, rank 32 among them", "many adapters, rank 64 among them"} <= set(labels)
    warm.run()
    most = min(pool.max_slots, 12 + 1) - 1
    for tile in (32, 64):
        slot, rank = slot_of[f"warmup-many-r{tile}-0"]
        assert rank == tile
        distinct = {len(s) for s in steps if slot in s}
        # k decode rows on k adapters (the rank-`tile` one among them) beside a prompt on one more
        assert {k + 1 for k in token_counts(min(most, 11)) if k <= min(most, 11)} <= distinct, \
            (tile, sorted(distinct))
    assert pool.free_bytes == pool.capacity_bytes
