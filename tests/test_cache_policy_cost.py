"""CachePolicy(eviction="cost"): the GDSF order (cost, frequency, size, aging), and the caps,
footholds and pins kept exactly as in LRU mode (no torch)."""
from __future__ import annotations

import random

import pytest

from services.common.cache_policy import CachePolicy, NoRoom

pytestmark = pytest.mark.policy     # torch-free: `make test-policy`


def test_costly_entry_stays_though_least_recently_used() -> None:
    p = CachePolicy.plain_lru(2, eviction="cost")
    p.admit("slow", "t", 1, cost=10.0)        # from the source: slow to reload
    p.admit("fast", "t", 1, cost=1.0)         # still in the host tier: cheap
    assert p.admit("new", "t", 1, cost=1.0) == ["fast"]
    lru = CachePolicy.plain_lru(2)
    lru.admit("slow", "t", 1)
    lru.admit("fast", "t", 1)
    assert lru.admit("new", "t", 1) == ["slow"]


def test_frequent_entry_stays_though_older() -> None:
    p = CachePolicy.plain_lru(2, eviction="cost")
    p.admit("hot", "t", 1, cost=1.0)
    p.touch("hot")
    p.touch("hot")
    p.admit("once", "t", 1, cost=1.0)
    assert p.admit("new", "t", 1, cost=1.0) == ["once"]


def test_big_entry_goes_before_small_ones_of_equal_cost() -> None:
    p = CachePolicy.plain_lru(4, eviction="cost")
    p.admit("big", "t", 2, cost=1.0)
    p.admit("s1", "t", 1, cost=1.0)
    p.admit("s2", "t", 1, cost=1.0)
    assert p.admit("s3", "t", 1, cost=1.0) == ["big"]


def test_aging_lets_a_once_hot_entry_go() -> None:
    """The clock rises to each victim's priority, so new entries overtake an old hot one."""
    p = CachePolicy.plain_lru(2, eviction="cost")
    p.admit("a", "t", 1, cost=1.0)
    p.admit("b", "t", 1, cost=1.0)
    p.touch("a")                               # a: 2 uses, b: 1
    assert p.admit("c", "t", 1, cost=1.0) == ["b"]
    assert p.admit("d", "t", 1, cost=1.0) == ["a"]   # c entered at clock 1 + 1 = a's 2


def test_equal_priorities_fall_back_to_lru() -> None:
    p = CachePolicy.plain_lru(3, eviction="cost")
    for key in ("a", "b", "c"):
        p.admit(key, "t", 1)                   # cost None: nbytes, every priority 1
    assert p.admit("d", "t", 1) == ["a"]


def test_set_cost_reorders() -> None:
    p = CachePolicy.plain_lru(2, eviction="cost")
    p.admit("a", "t", 1, cost=5.0)
    p.admit("b", "t", 1, cost=1.0)
    p.set_cost("a", 0.5)                       # a's copy below went cheap (or b's went away)
    assert p.admit("c", "t", 1, cost=1.0) == ["a"]


def test_pinned_never_evicted_and_no_room() -> None:
    p = CachePolicy.plain_lru(2, eviction="cost")
    p.admit("a", "t", 1, cost=0.1, pin=True)
    p.admit("b", "t", 1, cost=100.0)
    assert p.admit("c", "t", 1, cost=1.0) == ["b"]     # a is cheaper but pinned
    p.pin("c")
    with pytest.raises(NoRoom):
        p.admit("d", "t", 1)
    assert p.contains("a") and p.contains("c") and p.used_bytes == 2


def test_caps_still_come_before_priority() -> None:
    """The over-cap tenant pays for the newcomer even where its entries are worth more."""
    p = CachePolicy(10, tenant_share=0.5, eviction="cost")
    p.admit("l1", "light", 1, cost=0.1)
    for i in range(8):
        p.admit(f"h{i}", "heavy", 1, cost=100.0)
    p.admit("o1", "other", 1, cost=0.1)
    assert p.admit("n1", "newbie", 2, cost=1.0) == ["h0", "h1"]
    assert p.contains("l1") and p.contains("o1")


def test_within_a_tenant_the_cheapest_goes() -> None:
    p = CachePolicy(10, tenant_share=0.5, eviction="cost")
    _ = [p.admit(f"l{i}", "light", 1, cost=1.0) for i in range(2)]
    for i in range(8):
        p.admit(f"h{i}", "heavy", 1, cost=10.0 if i != 5 else 1.0)
    p.touch("l0")
    p.touch("l1")
    assert p.admit("h8", "heavy", 1, cost=10.0) == ["h5"]   # heavy over its cap: its cheapest


def test_foothold_kept_in_cost_mode() -> None:
    p = CachePolicy(4, tenant_share=None, foothold=True, eviction="cost")
    p.admit("l1", "light", 1, cost=0.01)      # the lowest priority of all
    for i in range(10):
        p.admit(f"h{i}", "heavy", 1, cost=1.0)
    assert p.contains("l1")
    for key in ("h9", "h8", "h7"):
        p.pin(key)
    assert p.admit("h10", "heavy", 1) == ["l1"]  # nothing else could go


def test_inactive_tenant_goes_first_in_cost_mode() -> None:
    p = CachePolicy(4, tenant_share=0.5, eviction="cost")
    p.admit("a1", "a", 1, cost=0.1)
    p.admit("i1", "idle", 1, cost=100.0)
    p.admit("b1", "b", 1, cost=1.0)
    p.admit("b2", "b", 1, cost=1.0)
    p.set_active_tenants({"a", "b"})
    assert p.admit("a2", "a", 1, cost=1.0) == ["i1"]


def test_bookkeeping_holds_under_random_use() -> None:
    """Both orders: bytes within budget, pinned entries never evicted, counters add up."""
    rng = random.Random(7)
    for eviction in ("lru", "cost"):
        p = CachePolicy(64, tenant_share=0.5, eviction=eviction)
        pinned: dict[str, int] = {}
        for _ in range(3000):
            key, tenant = f"k{rng.randrange(60)}", f"t{rng.randrange(4)}"
            if p.touch(key):
                continue
            try:
                victims = p.admit(key, tenant, rng.choice((1, 2, 4)), cost=rng.random(),
                                  pin=rng.random() < 0.3)
            except NoRoom:
                continue
            assert not set(victims) & set(pinned)
            if p.is_pinned(key):
                pinned[key] = 1
            for k in [k for k in pinned if rng.random() < 0.3]:
                p.unpin(k)
                del pinned[k]
            assert p.used_bytes <= p.capacity_bytes
        totals = p.totals()
        assert totals.entries == len(p.entries()) and totals.bytes == p.used_bytes


def test_unknown_eviction_refused() -> None:
    with pytest.raises(ValueError, match="eviction"):
        CachePolicy(10, eviction="lfu")
    assert CachePolicy(10).eviction == "lru"
    assert CachePolicy.plain_lru(10, eviction="cost").eviction == "cost"
