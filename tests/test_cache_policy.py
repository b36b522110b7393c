"""CachePolicy: LRU order, pins, NoRoom, per-tenant caps, footholds, counters (no torch)."""
from __future__ import annotations

import random
import threading

import pytest

from services.common.cache_policy import CachePolicy, NoRoom

pytestmark = pytest.mark.policy     # torch-free: `make test-policy`


def _fill(policy: CachePolicy, tenant: str, keys: list[str], nbytes: int = 1) -> None:
    for key in keys:
        assert policy.admit(key, tenant, nbytes) == []


def test_evicts_least_recently_used_first() -> None:
    policy = CachePolicy.plain_lru(3)
    _fill(policy, "t", ["a", "b", "c"])
    assert policy.touch("a")
    assert policy.admit("d", "t", 1) == ["b"]
    assert policy.admit("e", "t", 2) == ["c", "a"]
    assert [e.key for e in policy.entries()] == ["d", "e"]
    assert policy.used_bytes == 3 and policy.free_bytes == 0


def test_byte_budget_evicts_enough_bytes() -> None:
    policy = CachePolicy.plain_lru(10)
    policy.admit("big", "t", 6)
    policy.admit("small", "t", 3)
    assert policy.admit("mid", "t", 5) == ["big"]
    assert policy.used_bytes == 8


def test_pinned_never_evicted() -> None:
    policy = CachePolicy.plain_lru(3)
    _fill(policy, "t", ["a", "b", "c"])
    policy.pin("a")
    policy.pin("a")  # ref-counted
    assert policy.admit("d", "t", 1) == ["b"]
    policy.unpin("a")
    assert policy.admit("e", "t", 1) == ["c"]  # still pinned once
    policy.unpin("a")  # last pin: "a" becomes most recently used
    assert policy.admit("f", "t", 1) == ["d"]
    with pytest.raises(ValueError):
        policy.unpin("a")


def test_no_room_when_all_pinned_changes_nothing() -> None:
    policy = CachePolicy.plain_lru(4)
    _fill(policy, "t", ["a", "b"], nbytes=2)
    policy.pin("a")
    before = policy.entries()
    with pytest.raises(NoRoom) as info:
        policy.admit("c", "u", 3)
    assert (info.value.needed, info.value.reclaimable) == (3, 2)
    assert policy.entries() == before and policy.used_bytes == 4
    with pytest.raises(NoRoom):
        policy.admit("huge", "t", 5)
    policy.pin("b")
    with pytest.raises(NoRoom):
        policy.admit("c", "u", 1)


def test_admit_pinned_and_readmit_and_remove() -> None:
    policy = CachePolicy.plain_lru(2)
    policy.admit("a", "t", 1, pin=True)
    policy.admit("b", "t", 1)
    assert policy.admit("a", "t", 1) == []  # already there: refreshed
    assert policy.admit("c", "t", 1) == ["b"]
    with pytest.raises(ValueError):
        policy.remove("a")
    policy.unpin("a")
    assert policy.remove("a") and not policy.remove("a")
    assert policy.tenant_bytes("t") == 1 and not policy.contains("a")


def test_counters_per_tenant() -> None:
    policy = CachePolicy.plain_lru(2)
    policy.admit("a", "x", 1)
    policy.admit("b", "y", 1)
    assert policy.touch("a") and not policy.touch("zz")
    policy.admit("c", "y", 1)  # evicts "b" (y), the LRU after the hit on "a"
    policy.admit("d", "y", 1, count_miss=False)
    stats = policy.stats()
    assert (stats["x"].hits, stats["x"].misses) == (1, 1)
    assert (stats["y"].misses, stats["y"].evictions) == (2, 1)
    assert stats["x"].evictions == 1 and stats["x"].hit_rate == 0.5
    assert policy.totals().entries == len(policy.entries()) == 2
    assert (policy.totals().hits, policy.totals().misses) == (1, 3)


def test_over_cap_requester_evicts_its_own_entries_first() -> None:
    policy = CachePolicy(10, tenant_share=0.5)
    _fill(policy, "light", ["l1", "l2"])
    _fill(policy, "heavy", [f"h{i}" for i in range(8)])
    policy.touch("l1")
    policy.touch("l2")
    # light is active; heavy holds 8 > cap 5: its own oldest go, not light's older entries
    assert policy.admit("h8", "heavy", 1) == ["h0"]
    victims = policy.admit("h9", "heavy", 3)
    assert victims == ["h1", "h2", "h3"]
    assert policy.contains("l1") and policy.contains("l2")


def test_over_cap_other_tenant_evicted_first() -> None:
    policy = CachePolicy(10, tenant_share=0.5)
    _fill(policy, "light", ["l1"])
    _fill(policy, "heavy", [f"h{i}" for i in range(8)])
    _fill(policy, "other", ["o1"])
    # "light" is older than all of heavy's, but heavy (8 > 5) pays for the newcomer
    assert policy.admit("n1", "newbie", 2) == ["h0", "h1"]
    plain = CachePolicy.plain_lru(10)
    _fill(plain, "light", ["l1"])
    _fill(plain, "heavy", [f"h{i}" for i in range(8)])
    _fill(plain, "other", ["o1"])
    assert plain.admit("n1", "newbie", 2) == ["l1", "h0"]


def test_inactive_tenants_entries_go_first_with_caps() -> None:
    policy = CachePolicy(4, tenant_share=0.5)
    _fill(policy, "a", ["a1"])
    _fill(policy, "idle", ["i1"])
    _fill(policy, "b", ["b1", "b2"])
    policy.set_active_tenants({"a", "b"})
    assert policy.admit("a2", "a", 1) == ["i1"]  # newer than a1, but nobody waits for it
    plain = CachePolicy.plain_lru(4)
    _fill(plain, "a", ["a1"])
    _fill(plain, "idle", ["i1"])
    _fill(plain, "b", ["b1", "b2"])
    assert plain.admit("a2", "a", 1) == ["a1"]


def test_cap_is_fair_share_of_active_tenants_but_at_least_tenant_share() -> None:
    policy = CachePolicy(10, tenant_share=0.25)
    _fill(policy, "x", ["x0", "x1", "x2", "x3"])  # 4 of 10: under the fair share of 2 (5)
    _fill(policy, "y", [f"y{i}" for i in range(6)])
    assert policy.admit("x4", "x", 1) == ["y0"]  # y holds 6 > 5: y pays, not x
    policy.set_active_tenants({"x", "y", "z", "w", "v", "u"})  # fair share 1/6 < 0.25: cap 2.5
    assert policy.admit("x5", "x", 1) == ["x0"]  # x holds 5 > 2.5: x recycles its own


def test_alone_tenant_may_fill_the_tier() -> None:
    policy = CachePolicy(4, tenant_share=0.25)
    _fill(policy, "solo", ["a", "b", "c", "d"])
    assert policy.tenant_bytes("solo") == 4  # caps never refuse: work-conserving


def test_foothold_kept_until_nothing_else_can_go() -> None:
    policy = CachePolicy(4, tenant_share=None, foothold=True)
    _fill(policy, "light", ["l1"])
    for i in range(10):
        policy.admit(f"h{i}", "heavy", 1)
    assert policy.contains("l1")
    policy.pin("h9")
    policy.pin("h8")
    policy.pin("h7")
    assert policy.admit("h10", "heavy", 1) == ["l1"]  # nothing else could go
    plain = CachePolicy(4, tenant_share=None, foothold=False)
    _fill(plain, "light", ["l1"])
    for i in range(10):
        plain.admit(f"h{i}", "heavy", 1)
    assert not plain.contains("l1")


def test_foothold_only_for_active_tenants() -> None:
    policy = CachePolicy(3, tenant_share=None, foothold=True)
    _fill(policy, "light", ["l1"])
    _fill(policy, "heavy", ["h0", "h1"])
    policy.set_active_tenants({"heavy"})
    assert policy.admit("h2", "heavy", 1) == ["l1"]
    policy.set_active_tenants(None)  # back to automatic (recent accesses)
    assert policy.active_tenants() == {"light", "heavy"}
    windowed = CachePolicy(3, tenant_share=None, foothold=True, active_window=2)
    _fill(windowed, "light", ["l1"])
    _fill(windowed, "heavy", ["h0", "h1"])
    assert windowed.admit("h2", "heavy", 1) == ["l1"]  # light idle for 2 accesses


def _bursty_workload(policy: CachePolicy, rounds: int = 400) -> dict[str, float]:
    """Light: 3 adapters round-robin. Heavy: bursts of 8 requests over 40 adapters."""
    rng = random.Random(7)
    for r in range(rounds):
        light_key = f"l{r % 3}"
        if not policy.touch(light_key):
            policy.admit(light_key, "light", 1)
        burst = 8 if r % 4 == 0 else 1
        for _ in range(burst):
            key = f"h{rng.randrange(40)}"
            if not policy.touch(key):
                policy.admit(key, "heavy", 1)
    return {t: s.hit_rate for t, s in policy.stats().items()}


def test_caps_protect_light_tenant_from_bursty_heavy_one() -> None:
    with_caps = _bursty_workload(CachePolicy(10, tenant_share=0.5))
    without = _bursty_workload(CachePolicy.plain_lru(10))
    assert with_caps["light"] > 0.95
    assert without["light"] < 0.5
    assert with_caps["light"] > without["light"] + 0.4


def test_thread_safe_under_concurrent_use() -> None:
    policy = CachePolicy(50, tenant_share=0.5)

    def worker(tenant: str) -> None:
        rng = random.Random(tenant)
        for _ in range(2000):
            key = f"{tenant}-{rng.randrange(60)}"
            if not policy.touch(key):
                try:
                    policy.admit(key, tenant, 1 + rng.randrange(3))
                except NoRoom:
                    pass

    threads = [threading.Thread(target=worker, args=(f"t{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert policy.used_bytes == sum(e.nbytes for e in policy.entries()) <= 50


def test_over_cap_tenant_waits_rather_than_take_a_foothold():
    """Everything of the heavy tenant is pinned; the light tenant's last entry is its foothold:
    the heavy tenant's next admission is refused (it waits) instead of evicting it."""
    p = CachePolicy(400, tenant_share=0.5)
    p.admit("light-1", "light", 100)
    for i in range(3):
        p.admit(f"heavy-{i}", "heavy", 100, pin=True)
    with pytest.raises(NoRoom):
        p.admit("heavy-3", "heavy", 100, pin=True)
    assert p.contains("light-1")
    p.unpin("heavy-0")                      # one of its own rows finished: it recycles that
    assert p.admit("heavy-3", "heavy", 100, pin=True) == ["heavy-0"]
    assert p.contains("light-1")


def test_an_entry_larger_than_the_cap_comes_in_while_its_tenant_holds_nothing_else():
    """A rank-64 adapter in a pool of 1.5 of them (tenant_share 0.5: the cap is 2/3 of the
    adapter): with every other active tenant keeping a foothold it was refused for ever, though
    nothing was pinned. Its tenant holds nothing else, so it may take footholds; a tenant that
    holds more (pinned) still waits for its own pins."""
    p = CachePolicy(1536, tenant_share=0.5)
    for i in range(13):
        p.admit(f"small-{i}", f"t{i}", 112)                 # thirteen footholds, none pinned
    assert p.admit("big", "tb", 896) == [f"small-{i}" for i in range(8)]
    q = CachePolicy(1536, tenant_share=0.5)
    for i in range(6):
        q.admit(f"small-{i}", f"t{i}", 112)
    q.admit("own", "tb", 400, pin=True)
    with pytest.raises(NoRoom):
        q.admit("big", "tb", 896)
    assert q.contains("small-0")
