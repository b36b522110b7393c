"""The engine's gauges under vLLM's names, for gateways that pick an endpoint by them (the
Gateway API Inference Extension's endpoint picker reads these from a vLLM server):

    vllm:num_requests_running{model_name}   vllm:num_requests_waiting{model_name}
    vllm:kv_cache_usage_perc{model_name}     (the fraction of KV blocks in use, 0-1, as vLLM's)
    vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}
        (value: the Unix time of the update; the adapter lists are comma-separated ids)

and lorafleet_worker_prefix_blocks_shared_total (services.worker.engine.block_manager's sharing).

EngineGauges.step is the engine's per-step hook (Engine.on_step): it keeps the three counts
the scheduler already has (two list lengths and the block manager's free count) in plain
attributes, with no lock and no per-row work. The adapter sets need a pass over the running
and waiting sequences, so they are worked out at most every LORA_PERIOD_S of steps, and at
once when the engine empties or starts from empty (so an idle worker does not show stale
adapters). The collector reads those attributes at scrape time, on the scrape's thread.
"""
from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LORA_PERIOD_S = 0.5


class EngineGauges:
    def __init__(self, model_name: str, max_lora: int):
        self.model_name, self.max_lora = model_name, str(max_lora)
        self.running = self.waiting = 0
        self.kv_used = 0.0
        self.shared_blocks = 0                  # prompt blocks taken instead of computed
        self.lora = ("", "", time.time())       # running ids, waiting ids, when (one tuple)
        self._next_lora = 0.0

    def step(self, engine) -> None:
        """After each engine step, on the engine thread."""
        sched = engine.scheduler
        running, waiting = len(sched.running), len(sched.waiting)
        emptied = (running + waiting == 0) != (self.running + self.waiting == 0)
        self.running, self.waiting = running, waiting
        self.kv_used = sched.blocks.used_fraction
        self.shared_blocks = sched.blocks.shared_blocks
        now = time.monotonic()
        if emptied or now >= self._next_lora:
            self._next_lora = now + LORA_PERIOD_S
            self.lora = (_ids(sched.running), _ids(sched.waiting), time.time())

    def describe(self):
        return []

    def collect(self):
        labels, model = ["model_name"], [self.model_name]
        for name, doc, value in (
                ("vllm:num_requests_running", "Number of requests in model execution "
                 "batches.", self.running),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                 self.waiting),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 self.kv_used)):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(model, value)
            yield family
        running, waiting, when = self.lora
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["running_lora_adapters", "waiting_lora_adapters",
                                         "max_lora"])
        info.add_metric([running, waiting, self.max_lora], when)
        yield info
        shared = CounterMetricFamily(
            "lorafleet_worker_prefix_blocks_shared", "Prompt KV blocks a sequence took from "
            "another of its tenant, adapter and prompt start instead of computing them")
        shared.add_metric([], self.shared_blocks)
        yield shared


def _ids(seqs) -> str:
    """The distinct adapter ids of these sequences, sorted, comma-separated ("" for none)."""
    return ",".join(sorted({s.adapter.partition("@")[0] for s in seqs if s.adapter}))
