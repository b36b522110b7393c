"""An adapter-cache tier's lookups on every service's /metrics, under one set of names:
`lorafleet_cache_hits_total{tier}` and `lorafleet_cache_misses_total{tier}` (counters: a
dashboard takes rate() of them) and `lorafleet_cache_hit_rate{tier}` (a gauge: hits / lookups
since start). The worker serves gpu and worker_host, the store store_host."""
from __future__ import annotations

import threading

from prometheus_client import Counter, Gauge

HITS = Counter("lorafleet_cache_hits_total", "Adapter cache hits", ["tier"])
MISSES = Counter("lorafleet_cache_misses_total", "Adapter cache misses", ["tier"])
HIT_RATE = Gauge("lorafleet_cache_hit_rate", "Adapter cache hits / lookups since start, per tier",
                 ["tier"])
_lookups: dict[str, list[int]] = {}      # tier -> [hits, misses]
_lock = threading.Lock()


def declare(*tiers: str) -> None:
    """The series of these tiers exist (at 0) before their first lookup."""
    for tier in tiers:
        HITS.labels(tier)
        MISSES.labels(tier)
        HIT_RATE.labels(tier)


def count(tier: str, hit: bool) -> None:
    """One lookup in this tier: its counter and its hit rate."""
    (HITS if hit else MISSES).labels(tier).inc()
    with _lock:
        seen = _lookups.setdefault(tier, [0, 0])
        seen[0 if hit else 1] += 1
        HIT_RATE.labels(tier).set(seen[0] / (seen[0] + seen[1]))
