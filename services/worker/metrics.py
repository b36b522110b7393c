"""The worker's Prometheus metrics (the health signals DESIGN.md names, from this worker)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("lorafleet_worker_requests_total", "Requests by outcome", ["stop_reason"])
TOKENS = Counter("lorafleet_worker_generated_tokens_total", "Tokens generated", ["tenant"])
CACHE = Counter("lorafleet_adapter_cache_total", "Adapter lookups by tier and result",
                ["tier", "result"])
COLD_LOAD = Histogram("lorafleet_cold_load_seconds", "Adapter cold-load latency by source tier",
                      ["tier"], buckets=(.001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10))
HIT_RATE = Gauge("lorafleet_cache_hit_rate", "Adapter cache hits / lookups since start, per tier "
                 "(the store publishes its own tier's under the same name)", ["tier"])
EVICTIONS = Gauge("lorafleet_adapter_evictions", "Evictions per tenant and tier",
                  ["tier", "tenant"])
ADAPTERS = Gauge("lorafleet_adapters", "Adapters resident per tier", ["tier"])
KV_USED = Gauge("lorafleet_kv_used_fraction", "Fraction of KV blocks in use")
RUNNING = Gauge("lorafleet_running_sequences", "Sequences running")
WAITING = Gauge("lorafleet_waiting_sequences", "Sequences waiting")

_lookups = {tier: [0, 0] for tier in ("gpu", "worker_host")}    # hits, misses
for _tier in _lookups:
    HIT_RATE.labels(_tier)            # the series exist (at 0) before the first lookup


def count_lookup(tier: str, hit: bool) -> None:
    """One adapter lookup in this worker's tier: its counter and the tier's hit rate."""
    CACHE.labels(tier, "hit" if hit else "miss").inc()
    seen = _lookups[tier]
    seen[0 if hit else 1] += 1
    HIT_RATE.labels(tier).set(seen[0] / (seen[0] + seen[1]))
