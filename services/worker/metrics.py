"""The worker's Prometheus metrics (the health signals docs/ARCHITECTURE.md names, from this worker)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.common import hit_rate

REQUESTS = Counter("lorafleet_worker_requests_total", "Requests by outcome", ["stop_reason"])
TOKENS = Counter("lorafleet_worker_generated_tokens_total", "Tokens generated", ["tenant"])
CACHE = Counter("lorafleet_adapter_cache_total", "Adapter lookups by tier and result",
                ["tier", "result"])
COLD_LOAD = Histogram("lorafleet_cold_load_seconds", "Adapter cold-load latency by source tier",
                      ["tier"], buckets=(.001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10))
COLD_LOAD_STAGE = Histogram(
    "lorafleet_cold_load_stage_seconds", "Cold-load time by stage: fetch (store call and "
    "transfer), digest, layout (header and plan), room_wait (pool full of adapters in use), "
    "host_to_device (copy, layout kernel, slot tables), source (the store's source read)",
    ["stage"], buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5))
EVICTIONS = Gauge("lorafleet_adapter_evictions", "Evictions per tenant and tier",
                  ["tier", "tenant"])
ADAPTERS = Gauge("lorafleet_adapters", "Adapters resident per tier", ["tier"])
KV_USED = Gauge("lorafleet_kv_used_fraction", "Fraction of KV blocks in use")
RUNNING = Gauge("lorafleet_running_sequences", "Sequences running")
WAITING = Gauge("lorafleet_waiting_sequences", "Sequences waiting")

KERNEL_COMPILES = Counter(
    "lorafleet_worker_kernel_compiles_total", "Triton kernel specializations first needed "
    "(compiled or loaded from the kernel cache), by phase: start (before SERVING) or serving "
    "(expected: none)", ["phase"])
GRAPH_CAPTURES = Counter("lorafleet_worker_graph_captures_total",
                         "CUDA graphs captured, by phase: start or serving (expected: none)",
                         ["phase"])
for _phase in ("start", "serving"):
    KERNEL_COMPILES.labels(_phase)
    GRAPH_CAPTURES.labels(_phase)


class Phase:
    """Whether the worker has said SERVING yet (the phase label of the two counters above)."""
    name = "start"


def count_compile(kernel: str, log=None) -> None:
    KERNEL_COMPILES.labels(Phase.name).inc()
    if Phase.name == "serving" and log is not None:
        log.warning("kernel specialization first needed while serving: %s", kernel)


def compiles(phase: str) -> int:
    """Kernel specializations counted so far in a phase."""
    return int(KERNEL_COMPILES.labels(phase)._value.get())


def count_capture() -> None:
    GRAPH_CAPTURES.labels(Phase.name).inc()


hit_rate.declare("gpu", "worker_host")


def count_lookup(tier: str, hit: bool) -> None:
    """One adapter lookup in this worker's tier: its counter and the tier's hit rate."""
    CACHE.labels(tier, "hit" if hit else "miss").inc()
    hit_rate.count(tier, hit)
