"""What gateways and dashboards read from the services' /metrics, on the shared observed stack
(tests/observed.py): vLLM's series on the worker (the gauges an endpoint picker reads, the
TTFT / inter-token / queue-time histograms, token counters), lorafleet's own timing
histograms on the worker and, per tenant, on the router; hits and misses as counters; and a
tenant label bounded by --metrics-tenants (2 here: of three tenants, the least is `other`)."""
from __future__ import annotations

import re
import threading
import time

import pytest

from services.client.client import LorafleetClient
from tests.observed import samples, scrape

pytestmark = pytest.mark.slow

SERVED = 9              # the run's requests that reached the worker (tests/observed.py RUN)


def value(page: str, name: str, **labels) -> float:
    """The sum of name's samples whose labels include these."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for n, lab, v in samples(page) if n == name and all(w in lab for w in want))


def types(page: str) -> dict[str, str]:
    return {parts[2]: parts[3] for parts in (line.split() for line in page.splitlines()
                                             if line.startswith("# TYPE "))}


def test_worker_serves_vllm_request_metrics(observed):
    page = scrape(observed.metrics["worker"])
    model = 'model_name="tiny-llama"'
    kinds = types(page)
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:e2e_request_latency_seconds",
                 "lorafleet_worker_time_to_first_token_seconds",
                 "lorafleet_worker_inter_token_latency_seconds",
                 "lorafleet_worker_request_queue_time_seconds"):
        assert kinds[name] == "histogram", name
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert kinds[name] == "counter", name
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:lora_requests_info"):
        assert kinds[name] == "gauge", name
    assert any(n == "vllm:kv_cache_usage_perc" and model in lab for n, lab, _ in samples(page))
    generated = value(page, "lorafleet_worker_generated_tokens_total")
    assert generated > SERVED
    assert value(page, "vllm:generation_tokens_total", model_name="tiny-llama") == generated
    assert value(page, "vllm:prompt_tokens_total", model_name="tiny-llama") >= SERVED
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:request_queue_time_seconds_count",
                 "lorafleet_worker_time_to_first_token_seconds_count",
                 "lorafleet_worker_request_queue_time_seconds_count"):
        assert value(page, name) == SERVED, name
    # one gap between consecutive tokens: generated - 1 a request
    for name in ("vllm:inter_token_latency_seconds", "lorafleet_worker_inter_token_latency_seconds"):
        assert value(page, name + "_count") == generated - SERVED
        assert 0 < value(page, name + "_sum") / value(page, name + "_count") < 5
        inf = value(page, name + "_bucket", le="+Inf")
        assert inf == value(page, name + "_count")
    # the engine's steps timed by class (services/worker/engine/step_profile.py): eager on a
    # CPU, base-only steps and adapter steps both served
    assert kinds["lorafleet_worker_step_seconds"] == "summary"
    steps = [lab for n, lab, v in samples(page) if n == "lorafleet_worker_step_seconds_count"
             and v > 0]
    assert steps and all('kind="eager"' in lab and 'rows="1-32"' in lab for lab in steps)
    assert {'adapters="0"', 'adapters="1-8"'} <= {a for lab in steps for a in
                                                  re.findall(r'adapters="[^"]*"', lab)}
    assert value(page, "lorafleet_worker_step_seconds_sum") > 0


def lora_info(page: str) -> tuple[str, float]:
    (line,) = [(lab, v) for n, lab, v in samples(page) if n == "vllm:lora_requests_info"]
    return line


def test_gauges_follow_the_engine_while_it_runs_an_adapter(observed):
    """While a long pirate request decodes, the step hook's gauges show it running with its
    adapter (updated within ~0.5 s of steps); once it ends they go back to empty."""
    port = observed.metrics["worker"]
    done = threading.Event()

    def long_request():
        with LorafleetClient(observed.stack.router.addr, token="alpha", timeout=120) as c:
            c.generate(adapter="pirate", prompt="Once upon a time", max_new_tokens=400,
                       ignore_eos=True)
        observed.requests["alpha"] += 1
        done.set()
    thread = threading.Thread(target=long_request)
    thread.start()
    seen = None
    deadline = time.monotonic() + 60
    while not done.is_set() and time.monotonic() < deadline:
        page = scrape(port)
        labels, stamp = lora_info(page)
        if 'running_lora_adapters="pirate"' in labels:
            seen = (page, labels, stamp)
            break
        time.sleep(0.05)
    thread.join(120)
    assert seen is not None, "vllm:lora_requests_info never showed the running adapter"
    page, labels, stamp = seen
    assert 'waiting_lora_adapters=""' in labels and 'max_lora="128"' in labels
    assert abs(stamp - time.time()) < 30                    # a Unix time, of the update
    assert value(page, "vllm:num_requests_running") == 1
    assert 0 < value(page, "vllm:kv_cache_usage_perc") <= 1
    deadline = time.monotonic() + 10
    while 'running_lora_adapters=""' not in lora_info(scrape(port))[0]:
        assert time.monotonic() < deadline, "the adapter stayed listed after its request"
        time.sleep(0.05)
    page = scrape(port)
    assert value(page, "vllm:num_requests_running") == 0
    assert value(page, "vllm:kv_cache_usage_perc") == 0


def test_hits_and_misses_are_counters_that_agree(observed):
    pages = observed.pages()
    router, worker, store = pages["router"], pages["worker"], pages["store"]
    for page, name in ((router, "lorafleet_fleet_cache_hits"), (router, "lorafleet_fleet_cache_misses"),
                       (worker, "lorafleet_cache_hits"), (worker, "lorafleet_cache_misses"),
                       (store, "lorafleet_cache_hits"), (store, "lorafleet_cache_misses"),
                       (worker, "lorafleet_adapter_evictions")):
        assert types(page)[name + "_total"] == "counter", name
    assert types(router)["lorafleet_fleet_cache_hit_rate"] == "gauge"
    worker_addr = observed.stack.workers[0].addr
    for tier in ("gpu", "worker_host"):
        for kind in ("hits", "misses"):
            assert value(router, f"lorafleet_fleet_cache_{kind}_total", tier=tier,
                         worker=worker_addr) == value(worker, f"lorafleet_cache_{kind}_total",
                                                      tier=tier)
    # three adapters, each staged once; every other request with an adapter a hit (5 in the run)
    assert value(worker, "lorafleet_cache_misses_total", tier="gpu") == 3
    assert value(worker, "lorafleet_cache_hits_total", tier="gpu") >= 5


def test_the_tenant_label_is_bounded_and_keeps_the_counts(observed):
    """--metrics-tenants 2: alpha and beta are named, gamma's requests count under other."""
    page = scrape(observed.metrics["router"])
    tenants = {lab.split('tenant="')[1].split('"')[0] for n, lab, _ in samples(page)
               if 'tenant="' in lab}
    assert tenants == {"alpha", "beta", "other"}
    assert value(page, "lorafleet_router_requests_total", tenant="alpha") >= 5
    assert value(page, "lorafleet_router_requests_total", tenant="beta") == 3
    assert value(page, "lorafleet_router_requests_total", tenant="other") == 2
    assert value(page, "lorafleet_router_requests_total", tenant="other",
                 status="NOT_FOUND") == 1


def test_router_times_each_tenant(observed):
    page = scrape(observed.metrics["router"])
    for name in ("lorafleet_router_time_to_first_token_seconds",
                 "lorafleet_router_inter_token_latency_seconds",
                 "lorafleet_router_request_queue_time_seconds"):
        assert types(page)[name] == "histogram"
        assert value(page, name + "_count", tenant="beta") >= (1 if "inter" in name else 3)
        assert value(page, name + "_count", tenant="alpha") > 0
    ttft = value(page, "lorafleet_router_time_to_first_token_seconds_sum", tenant="beta") / 3
    latency = value(page, "lorafleet_request_seconds_sum", tenant="beta") / 3
    assert 0 < ttft <= latency
