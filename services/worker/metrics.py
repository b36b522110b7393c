"""The worker's Prometheus metrics (the health signals docs/ARCHITECTURE.md names, from this
worker), and its requests' timings under lorafleet's names and vLLM's (RequestMetrics; the
engine's gauges are services/worker/engine/gauges.py)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.common import hit_rate
from services.common.span_attrs import FINISH_REASONS
from services.common.tenant_labels import TenantLabels
from services.common.timing_buckets import ITL_BUCKETS, ITL_DOC, QUEUE_BUCKETS, TTFT_BUCKETS
from services.common.weighted_histogram import WeightedHistogram

REQUESTS = Counter("lorafleet_worker_requests_total", "Requests by outcome", ["stop_reason"])
TOKENS = Counter("lorafleet_worker_generated_tokens_total", "Tokens generated", ["tenant"])
COLD_LOAD = Histogram("lorafleet_cold_load_seconds", "Adapter cold-load latency by source tier",
                      ["tier"], buckets=(.001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10))
COLD_LOAD_STAGE = Histogram(
    "lorafleet_cold_load_stage_seconds", "Cold-load time by stage: fetch (store call and "
    "transfer), digest, layout (header and plan), room_wait (pool full of adapters in use), "
    "host_to_device (copy, layout kernel, slot tables; of it copy_wait, behind another "
    "placement, launch, the host queueing them, and device, the device finishing them), "
    "handoff (to a loader thread and back), source (the store's source read)",
    ["stage"], buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5))
EVICTIONS = Counter("lorafleet_adapter_evictions_total", "Adapter evictions per tenant and tier",
                    ["tenant", "tier"])
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
    """One adapter lookup in this worker's tier: its counters and the tier's hit rate."""
    hit_rate.count(tier, hit)


# --- request timings -------------------------------------------------------------------------
TTFT = Histogram("lorafleet_worker_time_to_first_token_seconds", "Arrival to first token",
                 buckets=TTFT_BUCKETS)
ITL = WeightedHistogram("lorafleet_worker_inter_token_latency_seconds",
                        "Time between a request's tokens" + ITL_DOC, buckets=ITL_BUCKETS)
QUEUE = Histogram("lorafleet_worker_request_queue_time_seconds", "Arrival to first scheduled "
                  "(adapter staging included)", buckets=QUEUE_BUCKETS)

# vLLM's names and labels (model_name: the served base model), for gateways and dashboards
# that read a vLLM server's /metrics (the Gateway API Inference Extension, vLLM's Grafana)
MODEL = ["model_name"]
VLLM_TTFT = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token "
                      "in seconds.", MODEL, buckets=TTFT_BUCKETS)
VLLM_ITL = WeightedHistogram("vllm:inter_token_latency_seconds", "Histogram of inter-token "
                             "latency in seconds." + ITL_DOC, MODEL, buckets=ITL_BUCKETS)
VLLM_TPOT = Histogram("vllm:request_time_per_output_token_seconds", "Histogram of "
                      "time_per_output_token_seconds per request.", MODEL, buckets=ITL_BUCKETS)
VLLM_QUEUE = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING "
                       "phase for request.", MODEL, buckets=QUEUE_BUCKETS)
VLLM_E2E = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency "
                     "in seconds.", MODEL, buckets=TTFT_BUCKETS)
VLLM_PROMPT = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", MODEL)
VLLM_GENERATION = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                          MODEL)
VLLM_SUCCESS = Counter("vllm:request_success", "Count of successfully processed requests.",
                       ["model_name", "finished_reason"])


class RequestMetrics:
    """What one finished request adds to /metrics, called once a request on the event loop
    (never per token, never on the engine thread). tenants bounds the tenant label."""

    def __init__(self, tenants: TenantLabels, model_name: str):
        self.tenants, self.model = tenants, model_name
        for family in (VLLM_PROMPT, VLLM_GENERATION, VLLM_TTFT, VLLM_TPOT, VLLM_QUEUE,
                       VLLM_E2E, VLLM_ITL):
            family.labels(model_name)            # the series exist (at 0) from the start

    def finished(self, tenant: str, ev) -> None:
        """ev: the request's last TokenEvent (stop, token counts, queue_s, ttft_s, total_s)."""
        REQUESTS.labels(ev.stop.name).inc()
        self.tenants.note(tenant)
        self.tenants.labels(TOKENS, tenant).inc(ev.generated_tokens)
        model = self.model
        VLLM_PROMPT.labels(model).inc(ev.prompt_tokens)
        VLLM_GENERATION.labels(model).inc(ev.generated_tokens)
        VLLM_E2E.labels(model).observe(ev.total_s)
        VLLM_SUCCESS.labels(model, FINISH_REASONS.get(int(ev.stop), "stop")).inc()
        QUEUE.observe(ev.queue_s)
        VLLM_QUEUE.labels(model).observe(ev.queue_s)
        if ev.generated_tokens < 1:
            return
        TTFT.observe(ev.ttft_s)
        VLLM_TTFT.labels(model).observe(ev.ttft_s)
        gaps = ev.generated_tokens - 1
        if gaps > 0:
            mean = max(0.0, ev.total_s - ev.ttft_s) / gaps
            ITL.observe(mean, gaps)
            VLLM_ITL.labels(model).observe(mean, gaps)
            VLLM_TPOT.labels(model).observe(mean)



class Evictions:
    """lorafleet_adapter_evictions_total{tenant, tier} from the cache policies' cumulative
    per-tenant counts (CachePolicy.stats()): each update adds what is new since the last."""

    def __init__(self, tenants: TenantLabels | None = None):
        self.tenants = tenants or TenantLabels()
        self._seen: dict[tuple[str, str], int] = {}

    def update(self, tier: str, stats: dict) -> None:
        for tenant, st in stats.items():
            before = self._seen.get((tier, tenant), 0)
            if st.evictions > before:
                self._seen[(tier, tenant)] = st.evictions
                self.tenants.labels(EVICTIONS, tenant, tier).inc(st.evictions - before)


def adapter_tiers(manager) -> None:
    """An AdapterManager's adapter counts per tier and evictions per tenant, for /metrics."""
    ADAPTERS.labels("gpu").set(sum(1 for i in manager.info.values() if i.gpu))
    ADAPTERS.labels("worker_host").set(len(manager.host))
    for tier, policy in (("gpu", manager.gpu), ("worker_host", manager.host.policy)):
        manager.evictions.update(tier, policy.stats())
