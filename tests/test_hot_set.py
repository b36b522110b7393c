"""The router's hot set (services/router/hot_set.py): decayed request counts that rank the
fleet's adapters, and the share of them a joining worker is warmed with (the adapters the
placement would send it). Torch-free."""
from __future__ import annotations

import pytest

from services.common.gen.lorafleet.v1 import worker_pb2 as wpb
from services.router.hot_set import HotSet, warm_choice
from services.router.placement import WorkerView, rendezvous_order

pytestmark = pytest.mark.policy


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def ref(adapter_id: str, version: str = "v1", tenant: str = "t") -> wpb.AdapterRef:
    return wpb.AdapterRef(id=adapter_id, version=version, tenant=tenant, owner=tenant)


def test_counts_rank_adapters_and_halve_every_half_life():
    clock = Clock()
    hot = HotSet(half_life_s=10.0, clock=clock)
    for _ in range(8):
        hot.saw(ref("old"))
    assert hot.rate("old") == pytest.approx(8.0)
    clock.t += 10.0
    assert hot.rate("old") == pytest.approx(4.0)
    for _ in range(5):
        hot.saw(ref("new"))
    # 5 requests now outrank 8 made a half-life ago (4 by now)
    assert [r.id for r in hot.top(2)] == ["new", "old"]
    clock.t += 30.0
    assert hot.rate("old") == pytest.approx(0.5) and hot.rate("new") == pytest.approx(0.625)
    assert hot.rate("never") == 0.0


def test_the_latest_reference_is_kept_and_a_deleted_adapter_forgotten():
    hot = HotSet(clock=Clock())
    hot.saw(ref("a", version="v1", tenant="x"))
    hot.saw(ref("a", version="v2", tenant="y"))
    hot.saw(ref("b"))
    (first, second) = hot.top(5)
    assert (first.id, first.version, first.tenant) == ("a", "v2", "y") and second.id == "b"
    hot.forget("a")
    assert [r.id for r in hot.top(5)] == ["b"]


def test_scores_survive_their_rebase_over_long_uptimes():
    clock = Clock()
    hot = HotSet(half_life_s=1.0, clock=clock)
    hot.saw(ref("a"))
    hot.saw(ref("a"))
    for step in range(100):          # 100 half-lives apart: 2^100 would overflow the ranking
        clock.t += 1.0
        hot.saw(ref(f"x{step}"))
    clock.t += 1.0
    hot.saw(ref("b"))
    ids = [r.id for r in hot.top(3)]
    assert ids[0] == "b" and ids[1] == "x99" and hot.rate("b") == pytest.approx(1.0)
    assert hot.rate("a") == pytest.approx(0.0, abs=1e-12)


def test_the_set_is_bounded_and_drops_its_coldest():
    clock = Clock()
    hot = HotSet(half_life_s=100.0, max_entries=20, clock=clock)
    for i in range(20):
        for _ in range(i + 1):
            hot.saw(ref(f"a{i:02d}"))
    hot.saw(ref("new"))
    assert len(hot) == 19
    kept = {r.id for r in hot.top(100)}
    assert "new" in kept and "a19" in kept and "a00" not in kept and "a01" not in kept


def test_a_joining_worker_gets_what_placement_would_send_it_hottest_first():
    hot = HotSet(clock=Clock())
    ids = [f"ad{i:03d}" for i in range(60)]
    for n, a in enumerate(ids):
        for _ in range(60 - n):           # ad000 hottest
            hot.saw(ref(a))
    views = {"w0": WorkerView(resident=frozenset(ids[:40])), "w1": WorkerView(),
             "w2": WorkerView(resident=frozenset(ids[40:50]))}
    live = list(views)
    chosen = [r.id for r in warm_choice(hot, "w1", views, 100)]
    # every adapter no other worker holds (ad050..ad059), and of the held ones those whose
    # rendezvous owner is w1; nothing else
    expected = [a for a in ids if a in ids[50:] or rendezvous_order(a, live)[0] == "w1"]
    assert chosen == expected
    assert set(ids[50:]) <= set(chosen) and len(chosen) < len(ids)
    assert chosen == sorted(chosen)        # hottest first
    assert [r.id for r in warm_choice(hot, "w1", views, 3)] == expected[:3]


def test_no_warm_up_for_what_the_worker_holds_nor_for_a_draining_one():
    hot = HotSet(clock=Clock())
    for a in ("a", "b"):
        hot.saw(ref(a))
    views = {"w0": WorkerView(resident=frozenset({"a"}), loading=frozenset({"b"}))}
    assert warm_choice(hot, "w0", views, 10) == []
    views = {"w0": WorkerView(draining=True)}
    assert warm_choice(hot, "w0", views, 10) == []
    assert warm_choice(hot, "gone", views, 10) == []


class RecordingStub:
    """Stands for a worker's stub: records the Prefetch requests the warmer sends (the real
    RPC through real processes: tests/test_fleet_warm.py)."""

    def __init__(self):
        self.requests = []

    async def Prefetch(self, request, timeout=None, metadata=None):
        self.requests.append(request)
        return wpb.PrefetchResponse(queued=len(request.adapters))


def _warm(adapters: int, empty: bool = True) -> list:
    import asyncio
    from services.router.hot_set import Warmer
    hot = HotSet(clock=Clock())
    for n in range(20):
        for _ in range(20 - n):
            hot.saw(ref(f"a{n:02d}"))
    stub = RecordingStub()

    async def run():
        warmer = Warmer(hot, lambda: {"w0": WorkerView()}, adapters=adapters, batch=8)
        warmer.joined("w0", stub, empty=empty)
        await asyncio.gather(*warmer._tasks)
    asyncio.run(run())
    return stub.requests


def test_the_warmer_sends_the_hottest_in_warm_batches_and_nothing_when_off():
    requests = _warm(adapters=20)
    assert [len(r.adapters) for r in requests] == [8, 8, 4] and all(r.warm for r in requests)
    assert [a.id for r in requests for a in r.adapters] == [f"a{n:02d}" for n in range(20)]
    assert [len(r.adapters) for r in _warm(adapters=5)] == [5]
    assert _warm(adapters=0) == []                       # --warm-adapters 0
    assert _warm(adapters=20, empty=False) == []         # a worker that holds adapters
