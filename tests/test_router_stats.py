"""`lorafleet stats --json` (the real CLI, as a subprocess) after a known run shows every field of
the README's operator contract, with values that agree with what was sent: requests and tokens per
tenant, one cold load per source tier as staged, hits and misses per tier, adapter counts; the
router's /metrics carries the same signals. Requests refused at admission (quota, bad argument,
unknown adapter) count among their tenant's requests, under their status. With the store down,
the reply keeps its shape and the store's last figures."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import urllib.request

import grpc
import pytest

from services.router.stats import jain_index

from services.client.client import LorafleetClient
from services.common.gen.lorafleet.v1 import worker_pb2 as wpb, worker_pb2_grpc
from tests.conftest import Stack
from tests.support import FreePort, MotoS3, S3_ENV

pytestmark = pytest.mark.slow

BUCKET = "lorafleet-stats"
NEW = 4     # tokens per request (ignore_eos: exact)


def cli(*args: str) -> str:
    exe = pathlib.Path(sys.executable).parent / "lorafleet"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "services.client.cli"]
    done = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_stats_json_agrees_with_the_run(lora_fleet, tmp_path):
    base, adapters = lora_fleet
    moto = MotoS3(tmp_path)
    s3 = moto.client()
    s3.create_bucket(Bucket=BUCKET)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        s3.put_object(Bucket=BUCKET, Key=f"shared/cold/{name}",
                      Body=(adapters / "a20" / name).read_bytes())
    metrics_port, worker_metrics_port = FreePort(), FreePort()
    stack = Stack(base, adapters, tmp_path, env=S3_ENV, store_args=["--s3-endpoint", moto.endpoint],
                  router_args=["--metrics-port", metrics_port],
                  worker_args=["--metrics-port", worker_metrics_port])
    try:
        router, worker_addr = stack.router.addr, stack.workers[0].addr
        cli("--router", router, "--token", "ops", "register", "--id", "cold2",
            "--source", f"s3://{BUCKET}/shared/cold")
        run = {"t1": ["a00", "a01", "a02", "a00", "a01", "a02"], "t2": ["a00"] * 4,
               "t3": ["", "", "cold2"]}
        for tenant, names in run.items():
            with LorafleetClient(router, tenant) as c:
                for name in names:
                    c.generate(adapter=name, prompt_ids=[7, 8, 9], max_new_tokens=NEW,
                               ignore_eos=True)
        with grpc.insecure_channel(stack.workers[0].addr) as ch:
            worker = worker_pb2_grpc.WorkerStub(ch)
            worker.OffloadAdapter(wpb.OffloadAdapterRequest(id="a01", to_host=True))
            worker.OffloadAdapter(wpb.OffloadAdapterRequest(id="a02", to_host=False))
        with LorafleetClient(router, "t3") as c:
            tiers = [c.generate(adapter=a, prompt_ids=[7, 8, 9], max_new_tokens=NEW,
                                ignore_eos=True).timings.adapter_tier for a in ("a01", "a02")]
        assert tiers == [2, 3]                            # WORKER_HOST, STORE_HOST
        run["t3"] += ["a01", "a02"]
        stats = json.loads(cli("--router", router, "stats", "--json"))
        text = cli("--router", router, "stats")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                         timeout=10).read().decode()
        worker_metrics = urllib.request.urlopen(f"http://127.0.0.1:{worker_metrics_port}/metrics",
                                                timeout=10).read().decode()
        # the store gone: the reply keeps its shape, with the store's last figures
        assert stack.store.terminate() == 0
        stale = json.loads(cli("--router", router, "stats", "--json"))
    finally:
        codes = stack.terminate()
        moto.stop()
    assert all(code == 0 for code in codes)
    print("\n" + text)

    assert set(stats) >= {"cache", "cold_load_seconds", "tenants", "jain_index", "adapters"}
    tenants = stats["tenants"]
    assert set(tenants) == set(run)
    for name, sent in run.items():
        t = tenants[name]
        assert (t["requests"], t["tokens_served"], t["throttled"]) == (len(sent),
                                                                       NEW * len(sent), 0)
        assert 0 < t["p50_latency_s"] <= t["p99_latency_s"]
    tokens = [NEW * len(sent) for sent in run.values()]
    assert stats["jain_index"] == pytest.approx(sum(tokens) ** 2 /
                                                (len(tokens) * sum(x * x for x in tokens)))

    with_adapter = sum(1 for names in run.values() for n in names if n)     # 13
    distinct = {n for names in run.values() for n in names if n}            # a00 a01 a02 cold2
    cache = stats["cache"]
    # GPU: a miss per staging (4 first loads, a01 and a02 again), a hit for every other request.
    assert (cache["gpu"]["misses"], cache["gpu"]["hits"]) == (6, with_adapter - 6)
    assert (cache["worker_host"]["hits"], cache["worker_host"]["misses"]) == (1, 5)
    assert (cache["store_host"]["hits"], cache["store_host"]["misses"]) == (1, 4)
    for tier in cache.values():
        total = tier["hits"] + tier["misses"]
        assert tier["hit_rate"] == pytest.approx(tier["hits"] / total)
    for name in ("gpu", "worker_host"):             # the one worker's own page, same rates
        line = next(x for x in worker_metrics.splitlines()
                    if x.startswith(f'lorafleet_cache_hit_rate{{tier="{name}"}}'))
        assert float(line.split()[-1]) == pytest.approx(cache[name]["hit_rate"])
    cold = stats["cold_load_seconds"]
    assert {k: v["count"] for k, v in cold.items()} == {"source": 4, "store_host": 1,
                                                        "worker_host": 1}
    for v in cold.values():
        assert 0 < v["p50"] <= v["p95"] <= v["p99"]
    assert stats["adapters"] == {"registered": 51, "store_host": 4, "worker_host": 4,
                                 "gpu_resident": 4, "working_set": len(distinct)}
    assert stale["cache"]["store_host"] == cache["store_host"]
    assert stale["adapters"] == stats["adapters"]

    for line in ('lorafleet_router_requests_total{status="OK",tenant="t1"} 6.0',
                 'lorafleet_tokens_served_total{tenant="t2"} 16.0',
                 # counters, one series a worker (the store's tier: no worker)
                 f'lorafleet_fleet_cache_misses_total{{tier="gpu",worker="{worker_addr}"}} 6.0',
                 f'lorafleet_fleet_cache_hits_total{{tier="gpu",worker="{worker_addr}"}} '
                 f'{with_adapter - 6}.0',
                 'lorafleet_fleet_cache_hit_rate{tier="gpu"} '
                 f'{(with_adapter - 6) / with_adapter}',
                 'lorafleet_router_cold_load_seconds_count{tier="source"} 4.0',
                 'lorafleet_fleet_adapters{tier="gpu"} 4.0', "lorafleet_jain_index ",
                 # the store's tier and count, from its last Stats reply
                 'lorafleet_fleet_cache_misses_total{tier="store_host",worker=""} 4.0',
                 'lorafleet_fleet_adapters{tier="store_host"} 4.0',
                 "lorafleet_adapters_registered 51.0"):
        assert line in metrics, line


def test_requests_refused_at_admission_are_counted(lora_fleet, tmp_path):
    """A tenant's requests refused before reaching a worker (its quota, a bad argument, an
    unknown adapter) are among its requests in GetStats and in
    lorafleet_router_requests_total under their status. Jain's index leaves out a tenant whose
    every request was refused for its own fault (an unknown adapter): it was not served
    unfairly."""
    base, adapters = lora_fleet
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": {
        "ops": {"tokens": ["tok-ops"], "role": "admin"},
        "slow": {"tokens": ["tok-slow"], "quota": {"requests_per_s": 0.1, "request_burst": 1}},
        "lost": {"tokens": ["tok-lost"]}}}))
    metrics_port = FreePort()
    stack = Stack(base, adapters, tmp_path, router_args=["--tenants", str(tenants),
                                                         "--insecure-internal",
                                                         "--metrics-port", metrics_port])
    kw = dict(prompt_ids=[7, 8, 9], max_new_tokens=NEW, ignore_eos=True)
    try:
        codes = []
        with LorafleetClient(stack.router.addr, "tok-slow", timeout=30) as c:
            c.generate(adapter="a00", **kw)
            for call in (dict(adapter="a00"), dict(adapter="no-such"),
                         dict(adapter="a00", temperature=-1.0)):
                with pytest.raises(grpc.RpcError) as err:
                    c.generate(**call, **kw)
                codes.append(err.value.code())
        with LorafleetClient(stack.router.addr, "tok-lost", timeout=30) as c:
            with pytest.raises(grpc.RpcError) as err:
                c.generate(adapter="no-such", **kw)
            codes.append(err.value.code())
        with LorafleetClient(stack.router.addr, "tok-ops", timeout=30) as c:
            stats = c.stats()
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                         timeout=10).read().decode()
    finally:
        stack.terminate()
    S = grpc.StatusCode
    assert codes == [S.RESOURCE_EXHAUSTED, S.NOT_FOUND, S.INVALID_ARGUMENT, S.NOT_FOUND]
    t = {x.tenant: x for x in stats.tenants}
    assert (t["slow"].requests, t["slow"].throttled, t["slow"].tokens_served) == (4, 1, NEW)
    assert (t["lost"].requests, t["lost"].throttled, t["lost"].tokens_served) == (1, 0, 0)
    # one latency sample, the served request's: a refusal's microseconds are not service
    assert 0 < t["slow"].p50_latency_s == t["slow"].p99_latency_s
    assert stats.jain_index == pytest.approx(jain_index([NEW]))         # "lost" left out
    for status, tenant in (("OK", "slow"), ("RESOURCE_EXHAUSTED", "slow"),
                           ("NOT_FOUND", "slow"), ("INVALID_ARGUMENT", "slow"),
                           ("NOT_FOUND", "lost")):
        line = f'lorafleet_router_requests_total{{status="{status}",tenant="{tenant}"}} 1.0'
        assert line in metrics, line
    assert 'lorafleet_throttled_total{tenant="slow"} 1.0' in metrics
