"""The four health signals as the router sees them: per-tenant service and latency (with Jain's
index), the adapter working set; cache and cold-load figures are gathered from workers and the
store at GetStats time. Plain Python (no torch).

On /metrics the router also shows the fleet: cache hits/misses and adapter counts per worker tier
from the residency streams (FleetCollector, read at scrape time) and the cold-load time requests
saw, per source tier (COLD_LOAD); the store's host tier is on the store's own /metrics. Every
`tenant` label goes through one TenantLabels (--metrics-tenants: top N by requests + "other").
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.common.tenant_labels import TenantLabels
from services.common.weighted_histogram import WeightedHistogram
from services.common.timing_buckets import ITL_BUCKETS, ITL_DOC, QUEUE_BUCKETS, TTFT_BUCKETS

REQUESTS = Counter("lorafleet_router_requests_total", "Requests by tenant and status",
                   ["tenant", "status"])
TOKENS = Counter("lorafleet_tokens_served_total", "Generated tokens served per tenant", ["tenant"])
LATENCY = Histogram("lorafleet_request_seconds", "End-to-end request latency per tenant",
                    ["tenant"], buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
THROTTLED = Counter("lorafleet_throttled_total", "Requests refused by quota", ["tenant"])
JAIN = Gauge("lorafleet_jain_index", "Jain's fairness index over active tenants' tokens")
QUEUED = Gauge("lorafleet_fair_queue_waiting", "Requests waiting in the fair queue")
COLD_TIERS = {2: "worker_host", 3: "store_host", 4: "source"}   # common_pb2.Tier values
COLD_LOAD = Histogram("lorafleet_router_cold_load_seconds",
                      "Adapter cold-load time requests waited for, by source tier", ["tier"],
                      buckets=(.001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10))
TTFT = Histogram("lorafleet_router_time_to_first_token_seconds", "Time from the request's "
                 "admission to its first token, per tenant", ["tenant"], buckets=TTFT_BUCKETS)
ITL = WeightedHistogram("lorafleet_router_inter_token_latency_seconds", "Time between a "
                        "request's tokens as the router forwards them, per tenant" + ITL_DOC,
                        ["tenant"], buckets=ITL_BUCKETS)
QUEUE_TIME = Histogram("lorafleet_router_request_queue_time_seconds", "Time a request waited "
                       "(the fair queue and the worker's queue, adapter staging included), "
                       "per tenant", ["tenant"], buckets=QUEUE_BUCKETS)


def percentile(values, q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    xs = sorted(values)
    if not xs:
        return 0.0
    k = max(0, min(len(xs) - 1, int(round(q / 100.0 * len(xs) + 0.5)) - 1))
    return float(xs[k])


def jain_index(xs) -> float:
    """(sum x)^2 / (n * sum x^2); 1.0 is perfectly even, 1/n is one tenant taking all."""
    xs = [float(x) for x in xs]
    if not xs or not any(xs):
        return 1.0
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


# refusals for the request's own fault: they do not make a tenant one the fleet served unfairly
CLIENT_FAULT = frozenset({"INVALID_ARGUMENT", "NOT_FOUND", "PERMISSION_DENIED",
                          "UNAUTHENTICATED", "OUT_OF_RANGE", "FAILED_PRECONDITION"})


@dataclass
class TenantRecord:
    requests: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    throttled: int = 0
    errors: int = 0
    rejected: int = 0       # refused for the request's own fault (a bad argument, no adapter)
    latencies: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096))


class RouterStats:
    def __init__(self, working_set_window: float = 600.0, tenants: TenantLabels | None = None):
        self.labels = tenants or TenantLabels()     # the tenant label of every family here
        # the store's last Stats reply (GetStats and poll_store_stats refresh it): the store
        # tier's cache figures and adapter counts on the router's /metrics
        self.store_snapshot = None
        self.worker_infos: dict = {}    # address -> the last Info reply (GetStats refreshes it)
        self.tenants: dict[str, TenantRecord] = {}
        self.window = working_set_window
        self._adapters_seen: dict[str, float] = {}

    def _t(self, tenant: str) -> TenantRecord:
        return self.tenants.setdefault(tenant, TenantRecord())

    def record(self, tenant: str, latency_s: float, tokens: int, prompt_tokens: int,
               status: str = "OK", ttft_s: float | None = None,
               queue_s: float | None = None) -> None:
        """A request that reached a worker. ttft_s: admission to first token (None: no
        token); queue_s: its wait in the fair queue and the worker's queue (None: unknown)."""
        rec = self._t(tenant)
        rec.requests += 1
        rec.tokens += tokens
        rec.prompt_tokens += prompt_tokens
        rec.latencies.append(latency_s)
        if status != "OK":
            rec.errors += 1
        lab = self.labels
        lab.note(tenant)
        lab.labels(REQUESTS, tenant, status).inc()
        lab.labels(TOKENS, tenant).inc(tokens)
        lab.labels(LATENCY, tenant).observe(latency_s)
        if queue_s is not None:
            lab.labels(QUEUE_TIME, tenant).observe(queue_s)
        if ttft_s is not None:
            lab.labels(TTFT, tenant).observe(ttft_s)
            if tokens > 1:
                lab.labels(ITL, tenant).observe(max(0.0, latency_s - ttft_s) / (tokens - 1),
                                                tokens - 1)
        JAIN.set(self.jain())

    def refuse(self, tenant: str, status: str) -> None:
        """A request refused at admission (quota, bad argument, unknown adapter, ...): one of
        the tenant's requests, under its status, with no tokens. No latency sample: a refusal is
        not service, and its microseconds would make a throttled tenant's latency look best. A
        tenant refused everything is thus active with nothing served, as Jain's index should
        see it, unless every refusal was for the request's own fault (CLIENT_FAULT)."""
        rec = self._t(tenant)
        rec.requests += 1
        rec.errors += 1
        rec.rejected += status in CLIENT_FAULT
        self.labels.note(tenant)
        self.labels.labels(REQUESTS, tenant, status).inc()
        JAIN.set(self.jain())

    def throttle(self, tenant: str) -> None:
        self._t(tenant).throttled += 1
        self.labels.labels(THROTTLED, tenant).inc()

    def cold_load(self, timings) -> None:
        """A request that waited for its adapter to be staged (common_pb2.Timings)."""
        tier = COLD_TIERS.get(timings.adapter_tier)
        if tier and timings.cold_load_s > 0:
            COLD_LOAD.labels(tier).observe(timings.cold_load_s)

    def saw_adapter(self, adapter_id: str) -> None:
        self._adapters_seen[adapter_id] = time.monotonic()

    def working_set(self) -> int:
        cutoff = time.monotonic() - self.window
        stale = [a for a, t in self._adapters_seen.items() if t < cutoff]
        for a in stale:
            del self._adapters_seen[a]
        return len(self._adapters_seen)

    def jain(self) -> float:
        """Over the tenants that asked for service the fleet could give: a tenant whose every
        request was refused for its own fault (CLIENT_FAULT) is not one served unfairly."""
        return jain_index(r.tokens for r in self.tenants.values() if r.requests > r.rejected)


class FleetCollector:
    """Prometheus collector over the live residency view (services.router.workers.WorkerSet):
    per worker tier, cache hits and misses (counters, one series a worker: `worker` label, so
    sum(rate(...)) holds while workers come and go) and the hit rate since start over the live
    workers (a gauge), and resident adapters; live workers. The store's tier (`store_host`, no
    worker label) and the registered count come from the store's last Stats reply
    (RouterStats.store_snapshot), so /metrics carries all four signals as GetStats does."""

    def __init__(self, workers, stats: RouterStats):
        self.workers, self.stats = workers, stats

    def collect(self):
        live = list(self.workers.live().values())
        doc = "Adapter cache {} per tier ({}; store_host from the store)"
        hits = CounterMetricFamily("lorafleet_fleet_cache_hits", doc.format(
            "hits", "worker tiers per live worker"), labels=["tier", "worker"])
        misses = CounterMetricFamily("lorafleet_fleet_cache_misses", doc.format(
            "misses", "worker tiers per live worker"), labels=["tier", "worker"])
        rate = GaugeMetricFamily("lorafleet_fleet_cache_hit_rate", doc.format(
            "hits / lookups since start", "worker tiers over live workers"), labels=["tier"])
        sums = {"gpu": [0, 0], "worker_host": [0, 0]}
        for w in live:
            for tier, c in w.cache.items():
                hits.add_metric([tier, w.addr], c.hits)
                misses.add_metric([tier, w.addr], c.misses)
                acc = sums.setdefault(tier, [0, 0])
                acc[0] += c.hits
                acc[1] += c.misses
        store = self.stats.store_snapshot
        if store is not None:
            hits.add_metric(["store_host", ""], store.host_hits)
            misses.add_metric(["store_host", ""], store.host_misses)
            sums["store_host"] = [store.host_hits, store.host_misses]
        for tier, (h, m) in sums.items():
            rate.add_metric([tier], h / (h + m) if h + m else 0.0)
        yield from (hits, misses, rate)
        resident = GaugeMetricFamily("lorafleet_fleet_adapters", "Adapters resident per tier "
                                     "(worker tiers summed over live workers; store_host from "
                                     "the store)", labels=["tier"])
        resident.add_metric(["gpu"], sum(len(w.view().resident) for w in live))
        resident.add_metric(["worker_host"], sum(
            1 for w in live for a in w.adapters.values() if a.tier))
        if store is not None:
            resident.add_metric(["store_host"], store.host_resident)
        yield resident
        if store is not None:
            yield GaugeMetricFamily("lorafleet_adapters_registered", "Adapters registered in "
                                    "the store", value=store.registered)
        yield GaugeMetricFamily("lorafleet_working_set_adapters", "Distinct adapters requested "
                                "in the recent window", value=self.stats.working_set())
        yield GaugeMetricFamily("lorafleet_workers_live", "Workers with a live residency stream",
                                value=len(live))
        yield GaugeMetricFamily("lorafleet_fleet_cold_loads_pending", "Adapters being staged "
                                "on live workers now (cold loads in flight: a thrash signal)",
                                value=sum(1 for w in live for a in w.adapters.values()
                                          if a.loading))
