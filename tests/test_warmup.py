"""The warm-up a worker runs before SERVING (services.worker.startup.warmup): every prompt length
class alone and beside decode rows, for the base model and zero adapters, through the real engine,
leaving the pool, the scheduler and the KV cache as they were; and the compile watch that
counts the kernel specializations needed after it."""
from __future__ import annotations

import types

from services.worker import metrics
from services.worker.config import EngineOptions
from services.worker.startup.factory import build_engine
from services.worker.startup.warmup import Warmup, token_counts
from tests.support import MODEL_DIR


def test_token_counts_cover_each_specialization_class():
    counts = token_counts(300)
    assert counts[:8] == [1, 2, 3, 7, 8, 15, 16, 17]
    assert {31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 300} <= set(counts)
    assert max(counts) == 300 and 511 not in counts


def test_the_warm_up_runs_every_shape_and_leaves_the_engine_as_it_was():
    built = build_engine(MODEL_DIR, EngineOptions(max_batch_tokens=80, pool_bytes=64 << 20))
    engine, pool = built.engine, built.pool
    free, seen = pool.free_bytes, []
    run = engine.runner.run

    def recording(batch):
        seen.append((sum(1 for b in batch if b.seq.num_computed >= len(b.seq.prompt)),
                     sum(b.num_tokens for b in batch), {b.seq.slot for b in batch}))
        return run(batch)
    engine.runner.run = recording
    layers = []
    forward = engine.runner.model.forward
    engine.runner.model.forward = lambda *a: (layers.append(engine.runner.model.layer_limit),
                                              forward(*a))[1]
    report = Warmup(engine, pool, built.spec, 80, max_rank=32, max_running=40).run()
    del engine.runner.model.forward
    assert set(layers) == {1} and engine.runner.model.layer_limit is None   # one layer, then all
    assert report.steps == len(seen) > 0
    prefill_only = {t for d, t, _ in seen if d == 0}
    assert set(token_counts(80)) <= prefill_only              # every length alone
    mixed = {(d, t - d) for d, t, _ in seen if d and t > d}
    for rows in (7, 15):                                       # and beside decode rows
        assert {(rows, n) for n in token_counts(80) if n + rows <= 80} <= mixed
    assert any(len(slots - {-1}) >= 3 for _, _, slots in seen)  # several adapters in a step
    distinct = {len(slots - {-1}) for d, t, slots in seen if d and t > d}
    # k decode rows on k adapters beside a prompt on one more, k of each class up to the rows
    assert {k + 1 for k in token_counts(39)} <= distinct
    assert -1 in {s for _, _, slots in seen for s in slots}     # and the base model
    assert pool.free_bytes == free and pool.slot_of("warmup-r16") is None
    sched = engine.scheduler
    assert not sched.running and not sched.waiting and sched.blocks.used_fraction == 0.0
    assert not engine._sinks


def test_the_compile_watch_counts_by_phase_and_keeps_an_earlier_hook():
    from triton import knobs
    from kernels import compile_watch
    calls, new = [], []
    saved = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda **kw: calls.append(kw["repr"])
    try:
        assert compile_watch.install(new.append)
        attrs = {(1,): [["tt.divisibility", 16]]}
        fn = types.SimpleNamespace(name="k", jit_function=types.SimpleNamespace(
            arg_names=["x_ptr", "T", "n_segs", "BLOCK"]))
        kwargs = dict(key=1, fn=fn, is_manual_warmup=False, already_compiled=False,
                      compile={"constants": {(3,): 64}, "configs": [attrs]})
        assert knobs.runtime.jit_cache_hook(repr="k[a: i32]", **kwargs) is None
        assert new == ["k constexprs={'BLOCK': 64} attrs={'T': [['tt.divisibility', 16]]}"]
        assert calls == ["k[a: i32]"]                             # the earlier hook still runs
    finally:
        knobs.runtime.jit_cache_hook = saved
    start = metrics.KERNEL_COMPILES.labels("start")._value.get()
    serving = metrics.KERNEL_COMPILES.labels("serving")._value.get()
    try:
        metrics.count_compile("k")
        metrics.Phase.name = "serving"
        metrics.count_compile("k")
    finally:
        metrics.Phase.name = "start"
    assert metrics.KERNEL_COMPILES.labels("start")._value.get() == start + 1
    assert metrics.KERNEL_COMPILES.labels("serving")._value.get() == serving + 1


def test_the_kernel_cache_directory_is_where_triton_writes(tmp_path):
    from triton import knobs
    from kernels import kernel_cache
    saved = knobs.cache.dir
    try:
        (tmp_path / "k" / "abc123").mkdir(parents=True)          # one kernel already cached
        assert kernel_cache.use(str(tmp_path / "k")) == 1
        assert knobs.cache.dir == str((tmp_path / "k").resolve())
        assert kernel_cache.use(str(tmp_path / "new" / "dir")) == 0       # created
        assert (tmp_path / "new" / "dir").is_dir()
    finally:
        knobs.cache.dir = saved


def test_beside_decode_rows_the_warm_up_runs_the_capped_chunks_not_every_length():
    """With a cap on prompt tokens beside decode rows (the scheduler's
    max_prefill_with_decode), mixed steps hold at most that many prompt tokens: the warm-up
    runs each length class up to it beside the rows, and a whole-budget prompt that the
    scheduler takes in chunks over its growing context; alone, every length."""
    built = build_engine(MODEL_DIR, EngineOptions(max_batch_tokens=80, pool_bytes=64 << 20,
                                                  max_prefill_with_decode=20))
    engine, seen = built.engine, []
    run = engine.runner.run

    def recording(batch):
        seen.append([(b.seq.num_computed >= len(b.seq.prompt), b.num_tokens, b.seq.num_computed)
                     for b in batch])
        return run(batch)
    engine.runner.run = recording
    Warmup(engine, built.pool, built.spec, 80, max_rank=16, max_running=40,
           prefill_with_decode=20).run()
    mixed = [step for step in seen if any(d for d, _, _ in step) and not all(d for d, _, _ in step)]
    assert mixed and all(sum(n for d, n, _ in step if not d) <= 20 for step in mixed)
    lengths = {sum(n for d, n, _ in step if not d) for step in mixed}
    assert {n for n in token_counts(80) if n <= 20} <= lengths
    assert any(c > 0 for step in mixed for d, _, c in step if not d)   # a chunk after context
    alone = {sum(n for _, n, _ in step) for step in seen if not any(d for d, _, _ in step)}
    assert set(token_counts(80)) <= alone


def test_with_column_blocks_the_warm_up_also_runs_steps_of_adapters_without_them():
    """q/k/v run as column LoRA only while every adapter of a step has column blocks; a step
    with one that got none runs q/k/v through SGMV, so the warm-up runs its many-adapter
    steps both ways: with blocks, and (up to a couple more adapters than there are blocks)
    without."""
    from services.worker.perf_config import PerfConfig
    built = build_engine(MODEL_DIR, EngineOptions(max_batch_tokens=48, max_running=24,
                                                  pool_bytes=64 << 20, pool_slots=16,
                                                  perf=PerfConfig(lora_columns=4)))
    pool, placed = built.pool, []
    place = pool.place
    pool.place = lambda key, staged, columns=True: (placed.append((key, columns)),
                                                    place(key, staged, columns))[1]
    warm = Warmup(built.engine, pool, built.spec, 48, max_rank=16, max_running=24)
    labels = [label for label, _ in warm.adapter_sets()]
    assert "many adapters without columns" in labels
    warm.run()
    without = [k for k, c in placed if k.startswith("warmup-many-nc-")]
    assert len(without) == 4 + 2 and not any(c for k, c in placed if k in without)
    assert any(c for k, c in placed if k.startswith("warmup-many-") and k not in without)
    assert pool.free_bytes == pool.capacity_bytes
