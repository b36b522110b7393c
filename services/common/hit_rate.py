"""`lorafleet_cache_hit_rate{tier}`: hits / lookups since start for each adapter-cache tier this
process serves (the worker: gpu and worker_host; the store: store_host), under one name on
every service. Each service also counts hits and misses in its own counters."""
from __future__ import annotations

import threading

from prometheus_client import Gauge

HIT_RATE = Gauge("lorafleet_cache_hit_rate", "Adapter cache hits / lookups since start, per tier",
                 ["tier"])
_lookups: dict[str, list[int]] = {}      # tier -> [hits, misses]
_lock = threading.Lock()


def declare(*tiers: str) -> None:
    """The series of these tiers exist (at 0) before their first lookup."""
    for tier in tiers:
        HIT_RATE.labels(tier)


def count(tier: str, hit: bool) -> None:
    """One lookup in this tier: its hit rate."""
    with _lock:
        seen = _lookups.setdefault(tier, [0, 0])
        seen[0 if hit else 1] += 1
        HIT_RATE.labels(tier).set(seen[0] / (seen[0] + seen[1]))
