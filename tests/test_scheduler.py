"""Scheduler and block manager alone (plain Python, no torch): token budget, decode-first order,
chunked prefill, preemption of the newest, no starvation, blocks freed on finish."""
from __future__ import annotations

import random
import subprocess
import sys

import pytest

from services.worker.engine.block_manager import BlockManager
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.sequence import Sequence, Status, Stopping

pytestmark = pytest.mark.policy     # torch-free: `make test-policy`


def seq(rid: str, n_prompt: int, arrival: float, max_new: int = 4) -> Sequence:
    return Sequence(rid, list(range(2, 2 + n_prompt)), arrival=arrival,
                    stopping=Stopping(max_new_tokens=max_new))


def advance(sched: Scheduler, batch) -> list[Sequence]:
    """What the engine does after a step: count computed tokens, append samples, finish."""
    done = []
    sampled = [b.samples for b in batch]
    for b, samples in zip(batch, sampled):
        b.seq.num_computed += b.num_tokens
        if samples:
            b.seq.tokens.append(7)
            if b.seq.num_output >= b.seq.stopping.max_new_tokens:
                sched.remove(b.seq)
                done.append(b.seq)
    return done


def test_block_manager_grows_fails_cleanly_and_frees():
    bm = BlockManager(num_blocks=5, block_size=4)
    a, b = seq("a", 1, 0), seq("b", 1, 1)
    assert bm.blocks_for(0) == 0 and bm.blocks_for(4) == 1 and bm.blocks_for(5) == 2
    assert bm.ensure(a, 9) and len(a.block_table) == 3
    assert bm.ensure(a, 12) and len(a.block_table) == 3      # already enough
    assert not bm.ensure(b, 12) and b.block_table == []      # 3 needed, 2 free: no change
    assert bm.ensure(b, 8) and bm.free_blocks == 0
    assert set(a.block_table).isdisjoint(b.block_table)
    bm.free(a)
    assert a.block_table == [] and bm.free_blocks == 3 and bm.used_fraction == pytest.approx(0.4)
    with pytest.raises(ValueError):
        BlockManager(0, 4)


def test_token_budget_and_max_running_are_respected():
    sched = Scheduler(BlockManager(1000, 4), max_batch_tokens=32, max_running=5)
    rng = random.Random(0)
    for i in range(12):
        sched.add(seq(f"s{i}", rng.randint(1, 50), i, max_new=rng.randint(1, 6)))
    finished = 0
    while sched.has_work():
        batch = sched.schedule()
        assert batch and sum(b.num_tokens for b in batch) <= 32
        assert len(sched.running) <= 5 and len({id(b.seq) for b in batch}) == len(batch)
        finished += len(advance(sched, batch))
    assert finished == 12 and sched.blocks.free_blocks == 1000


def test_decode_rows_go_first_and_prefill_is_chunked():
    """An older sequence still prefilling (e.g. resumed after a preemption) runs after younger
    decode rows, in chunks that fill what the budget leaves."""
    sched = Scheduler(BlockManager(100, 4), max_batch_tokens=10, max_running=8)
    decoders = [seq(f"d{i}", 3, 1 + i, max_new=20) for i in range(3)]
    for d in decoders:
        sched.add(d)
    advance(sched, sched.schedule())            # 3 prompts of 3 tokens, each samples
    assert all(d.is_decoding for d in decoders)
    old_long = seq("long", 40, 0, max_new=2)
    sched.add(old_long)
    chunks = []
    for step in range(7):
        batch = sched.schedule()
        ids = [b.seq.request_id for b in batch]
        # decoding, long goes first (oldest); prefilling, after every decode row
        assert ids == (["long", "d0", "d1", "d2"] if step == 6 else ["d0", "d1", "d2", "long"])
        assert sum(b.num_tokens for b in batch) <= 10
        chunks += [(b.num_tokens, b.samples) for b in batch if b.seq is old_long]
        advance(sched, batch)
    assert chunks == [(7, False)] * 5 + [(5, True), (1, True)]
    assert old_long.status is Status.FINISHED and sum(n for n, _ in chunks) == 40 + 1


def test_blocks_are_freed_on_finish_and_remove():
    sched = Scheduler(BlockManager(20, 4), max_batch_tokens=64, max_running=8)
    a, b = seq("a", 9, 0, max_new=1), seq("b", 5, 1, max_new=3)
    sched.add(a)
    sched.add(b)
    done = advance(sched, sched.schedule())
    assert done == [a] and a.block_table == [] and a.status is Status.FINISHED
    assert sched.blocks.free_blocks == 20 - len(b.block_table)
    sched.remove(b)                              # cancel
    assert sched.blocks.free_blocks == 20 and not sched.has_work()


def test_preempts_newest_and_requeues_it_ahead_of_younger():
    """Two sequences fill the cache; growing the older one preempts the newer, which goes back
    to waiting (num_computed 0) ahead of a sequence that arrived after it."""
    sched = Scheduler(BlockManager(4, 4), max_batch_tokens=64, max_running=8)
    old, new = seq("old", 8, 0, max_new=8), seq("new", 7, 1, max_new=8)
    sched.add(old)
    sched.add(new)
    advance(sched, sched.schedule())            # 2 blocks each, both sampled a token
    late = seq("late", 2, 2)
    sched.add(late)
    batch = sched.schedule()                    # old needs a 3rd block: new is the victim
    assert [b.seq.request_id for b in batch] == ["old"]
    assert sched.preemptions == 1 and new.preemptions == 1 and new.num_computed == 0
    assert new.block_table == [] and [s.request_id for s in sched.waiting] == ["new", "late"]
    assert new.output == [7]                    # generated tokens are kept and recomputed


@pytest.mark.parametrize("seed", range(5))
def test_no_starvation_under_kv_pressure(seed):
    """Random load through a cache much smaller than the demand: every request finishes."""
    rng = random.Random(seed)
    sched = Scheduler(BlockManager(16, 4), max_batch_tokens=24, max_running=6)
    seqs = []
    for step in range(400):
        if len(seqs) < 30 and rng.random() < 0.3:
            s = seq(f"s{len(seqs)}", rng.randint(1, 30), step, max_new=rng.randint(1, 30))
            seqs.append(s)
            sched.add(s)
        if not sched.has_work() and len(seqs) == 30:
            break
        batch = sched.schedule()
        assert sum(b.num_tokens for b in batch) <= 24
        advance(sched, batch)
        held = [b for s in sched.running for b in s.block_table]
        assert len(held) == len(set(held)) and sched.blocks.free_blocks + len(held) == 16
    assert all(s.status is Status.FINISHED for s in seqs), [s.request_id for s in seqs
                                                            if s.status is not Status.FINISHED]
    assert sched.preemptions > 0 and sched.blocks.free_blocks == 16


def test_bookkeeping_imports_no_torch():
    """The scheduler, block manager and sequences are plain Python (the simulator reuses them)."""
    code = ("import sys, services.worker.engine.scheduler, services.worker.engine.block_manager; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def admission_order(fair: bool) -> list[str]:
    """Ten requests of a heavy tenant, then one of a light one, two rows at a time: the order
    in which the scheduler admits them (each generates 5 tokens, then finishes)."""
    sched = Scheduler(BlockManager(1000, 4), max_batch_tokens=64, max_running=2, fair=fair)
    seqs = [Sequence(f"h{i}", list(range(8)), tenant="heavy", arrival=i) for i in range(10)]
    seqs.append(Sequence("l0", list(range(8)), tenant="light", arrival=10))
    for s in seqs:
        sched.add(s)
    order = []
    for _ in range(200):
        if not sched.has_work():
            break
        for b in sched.schedule():
            if b.seq.request_id not in order:
                order.append(b.seq.request_id)
            b.seq.num_computed += b.num_tokens
            if b.samples:
                b.seq.tokens.append(1)
                if b.seq.num_output >= 5:
                    sched.remove(b.seq)
    return order


def test_the_worker_admits_a_light_tenant_before_a_heavy_ones_backlog():
    """VTC order, as the router's fair queue: the light tenant's one request takes the next
    free row (the heavy tenant was charged its first request's prompt), not the last one after
    the heavy tenant's backlog (arrival order: last of eleven)."""
    assert admission_order(fair=False).index("l0") == 10
    assert admission_order(fair=True).index("l0") == 1
    fair = admission_order(fair=True)
    assert [r for r in fair if r.startswith("h")] == [f"h{i}" for i in range(10)]  # in order


def test_prompt_tokens_beside_decode_rows_are_capped_so_a_burst_does_not_stall_streams():
    """While any row decodes, a step takes at most max_prefill_with_decode prompt tokens (new
    admissions and chunks of running prompts together); a step with nothing decoding takes the
    whole token budget; every prompt still completes and the decode rows run every step."""
    sched = Scheduler(BlockManager(4000, 4), max_batch_tokens=256, max_running=32,
                      max_prefill_with_decode=40)
    streams = [seq(f"d{i}", 3, i, max_new=60) for i in range(4)]
    for s in streams:
        sched.add(s)
    advance(sched, sched.schedule())
    assert all(s.is_decoding for s in streams)
    burst = [seq(f"b{i}", 100, 10 + i, max_new=1) for i in range(6)]
    for b in burst:
        sched.add(b)
    steps = 0
    while any(b.status is not Status.FINISHED for b in burst):
        batch = sched.schedule()
        prompt = sum(x.num_tokens for x in batch if not x.seq.is_decoding)
        decoding = {x.seq.request_id for x in batch if x.seq.is_decoding}
        assert prompt <= 40
        assert decoding == {s.request_id for s in streams}      # none of them skipped a step
        advance(sched, batch)
        steps += 1
    assert steps == -(-6 * 100 // 40)          # the burst's 600 tokens, 40 a step, no idle step
    # nothing decoding: a step takes the whole budget
    alone = Scheduler(BlockManager(4000, 4), max_batch_tokens=256, max_running=32,
                      max_prefill_with_decode=40)
    for b in [seq(f"c{i}", 100, i, max_new=1) for i in range(3)]:
        alone.add(b)
    assert sum(x.num_tokens for x in alone.schedule()) == 256
    with pytest.raises(ValueError):
        Scheduler(BlockManager(10, 4), 16, 4, max_prefill_with_decode=-1)
