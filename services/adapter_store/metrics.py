"""The store's Prometheus metrics (on --metrics-port) and the cold-load window behind Stats.

    lorafleet_cache_hits_total{tier="store_host"}      lorafleet_cache_misses_total{tier=...}
    lorafleet_cache_hit_rate{tier="store_host"}         (gauge: hits / lookups since start)
    lorafleet_cache_evictions_total{tier="store_host"}
    lorafleet_store_source_loads_total{scheme="keep|file|s3", outcome="ok|data_loss|error"}
        (keep: the store's own copy of the version, keep.py)
    lorafleet_cold_load_seconds{tier="source"}          (histogram: read + digest check)
    lorafleet_store_adapters{state="READY|FAILED|REGISTERED"}   (gauge)
    lorafleet_store_host_bytes, lorafleet_store_host_adapters   (gauges: the host tier)
    lorafleet_store_refusals_total{reason="r|use_dora|shape|nonfinite|pickle|..."}
    lorafleet_store_background_validations_total{outcome="ready|failed|error|skipped"}
        (background.py; skipped: settled meanwhile by a first use, changed or deleted)
    lorafleet_store_background_left             (gauge: REGISTERED adapters it has yet to try)
"""
from __future__ import annotations

import math
from collections import deque

from prometheus_client import Counter, Gauge, Histogram

from services.common import hit_rate

TIER = "store_host"
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

CACHE_EVICTIONS = Counter("lorafleet_cache_evictions_total", "Adapter cache evictions", ["tier"])
SOURCE_LOADS = Counter("lorafleet_store_source_loads_total",
                       "Adapter reads from a source at Fetch time", ["scheme", "outcome"])
COLD_LOAD = Histogram("lorafleet_cold_load_seconds", "Adapter cold-load latency per source tier",
                      ["tier"], buckets=_BUCKETS)
ADAPTERS = Gauge("lorafleet_store_adapters", "Registered adapters by state", ["state"])
HOST_BYTES = Gauge("lorafleet_store_host_bytes", "Bytes held by the store host tier")
HOST_ADAPTERS = Gauge("lorafleet_store_host_adapters", "Adapters held by the store host tier")
REFUSALS = Counter("lorafleet_store_refusals_total", "Adapters refused at validation",
                   ["reason"])
BACKGROUND = Counter("lorafleet_store_background_validations_total",
                     "REGISTERED adapters validated in the background after start", ["outcome"])
BACKGROUND_LEFT = Gauge("lorafleet_store_background_left",
                        "REGISTERED adapters the background validation has yet to try")


CACHE_EVICTIONS.labels(TIER)        # the series exist (at 0) before the first lookup
hit_rate.declare(TIER)              # lorafleet_cache_{hits,misses}_total, _hit_rate
for _outcome in ("ready", "failed", "error", "skipped"):
    BACKGROUND.labels(_outcome)


def count_lookup(hit: bool) -> None:
    """One host-tier lookup at Fetch time: its counter and the hit rate."""
    hit_rate.count(TIER, hit)


def set_host_tier(resident: int, nbytes: int) -> None:
    HOST_ADAPTERS.set(resident)
    HOST_BYTES.set(nbytes)


class LatencyWindow:
    """The last `size` samples, for the p50/p95/p99 that Stats reports; `count` is all-time."""

    def __init__(self, size: int = 2048):
        self._samples: deque[float] = deque(maxlen=size)
        self.count = 0

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)
        self.count += 1

    def quantile(self, q: float) -> float:
        """Nearest-rank quantile of the window (0.0 when empty)."""
        ordered = sorted(self._samples)
        if not ordered:
            return 0.0
        rank = math.ceil(q * len(ordered)) - 1
        return ordered[min(len(ordered) - 1, max(0, rank))]


def observe_source_load(window: LatencyWindow, scheme: str, outcome: str, seconds: float) -> None:
    """Count a Fetch-time source load; latency only for the ones that succeeded."""
    SOURCE_LOADS.labels(scheme, outcome).inc()
    if outcome == "ok":
        COLD_LOAD.labels("source").observe(seconds)
        window.add(seconds)


def set_adapter_counts(counts: dict[str, int]) -> None:
    for state in ("READY", "REGISTERED", "FAILED"):
        ADAPTERS.labels(state).set(counts.get(state, 0))
