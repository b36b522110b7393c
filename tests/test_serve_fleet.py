"""The serving benchmark with two workers behind the router (bench/serve/fleet.py): where the
workers run, per-worker figures, and a worker killed mid-run and started again. The slow tests
run bench/serve/bench.py --quick --workers 2 as processes on loopback (tiny model, CPU)."""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys

import pytest

from bench.serve import fleet as serve_fleet, report as serve_report
from bench.serve import scenarios as ss

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _args(**kw) -> argparse.Namespace:
    base = {"workers": 2, "devices": None, "device": "cpu", "gpu_pool_bytes": "768KiB",
            "kv_cache_bytes": None, "host_pool_bytes": "1280KiB"}
    return argparse.Namespace(**{**base, **kw})


def test_workers_on_one_device_share_the_memory_budgets_and_on_devices_each_their_own():
    from services.worker.config import WorkerConfig
    over, note = serve_fleet.layout(_args())
    assert over == [{"gpu_pool_bytes": "393216", "host_pool_bytes": "655360",
                     "kv_cache_bytes": str(WorkerConfig().engine.kv_cache_bytes // 2)}] * 2
    assert "1/2 of the memory budgets" in note
    over, note = serve_fleet.layout(_args(devices="cuda:0,cuda:1", device="cuda"))
    assert over == [{"device": "cuda:0"}, {"device": "cuda:1"}]
    assert serve_fleet.layout(_args(workers=1)) == ([{}], "one worker")
    with pytest.raises(SystemExit):
        serve_fleet.layout(_args(devices="cuda:0"))


def _rec(i, times, status="OK", tokens=None, streamed=None, send=0.0, end=1.0):
    return {"index": i, "adapter": "a", "times": times, "status": status, "error": "",
            "tokens": len(times) if tokens is None else tokens,
            "streamed": len(times) if streamed is None else streamed, "send": send, "end": end}


def test_requests_are_classified_by_how_they_ended():
    reqs = [ss.Request(i, "a", "t0", [1], 3) for i in range(5)]
    recs = [_rec(0, [0.1, 0.2, 0.3]),
            _rec(1, [0.1], status="UNAVAILABLE"),                # lost mid-stream
            _rec(2, [], status="UNAVAILABLE", send=0.5, end=0.6),  # lost before a token
            _rec(3, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], streamed=6, tokens=3),   # a duplicate
            _rec(4, [0.1, 0.2, 0.3], send=3.0, end=3.5)]
    c = serve_fleet.classify(recs, reqs, {"killed": 0.55, "router_sees": 2.0}, 0.0)
    assert (c["ok"], c["failed_after_tokens"], c["failed_before_token_n"], c["duplicated"]) == \
        (3, {"UNAVAILABLE": 1}, 1, 1)
    assert c["in_flight_at_kill"] == 4 and c["sent_after_rejoin"] == 1
    for bad in ("k:kill_at=-1,rate=1", "k:kill_worker=-1,rate=1", "k:after_rejoin=-1,rate=1"):
        with pytest.raises(ValueError):
            ss.parse_scenario(bad, {"rate": None, "concurrency": 4})


def test_a_kill_scenario_ends_with_a_tail_sent_after_the_rejoin():
    defaults = {"rate": None, "concurrency": 4}
    assert ss.parse_scenario("k:kill_at=3,requests=200", defaults).rejoin_requests == 20
    assert ss.parse_scenario("k:kill_at=3,requests=5", defaults).rejoin_requests == 1
    assert ss.parse_scenario("k:kill_at=3,after_rejoin=7", defaults).rejoin_requests == 7
    assert ss.parse_scenario("k:after_rejoin=7", defaults).rejoin_requests == 0


def _run(tmp_path, scenario: str) -> dict:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bench.serve.bench", "--quick", "--workers", "2",
                           "--suite", "none", "--scenarios", scenario, "--out", str(out),
                           "--name", "fleet", "--work", str(tmp_path / "work")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / "fleet.json").read_text())


@pytest.mark.slow
def test_two_workers_on_one_device_both_serve_with_halved_pools(tmp_path):
    """Two workers, each with half the quick run's pools, behind one router: both took adapter
    requests, each holds some of the working set and no more than its pool, rows say 2."""
    doc = _run(tmp_path, "two:adapters=16,rank=8,zipf=0.5,concurrency=4,requests=48,"
                         "warmup=4,prompt=8:16,output=4:8")
    fleet = doc["header"]["workers"]
    assert fleet["count"] == 2 and len(fleet["commands"]) == 2
    ports = {re.search(r"--listen 127\.0\.0\.1:(\d+)", c).group(1) for c in fleet["commands"]}
    assert len(ports) == 2
    assert all("--gpu-pool-bytes 393216" in c for c in fleet["commands"])
    rows = doc["rows"]
    assert rows and all(r["workers"] == 2 and not r["errors"] and r["ok"] == 48 for r in rows)
    assert set(serve_report.ROW_FIELDS) <= set(rows[0])
    per = rows[0]["per_worker"]
    assert [w["worker"] for w in per] == [0, 1]
    assert all(w["gpu_lookups"] > 0 for w in per)               # both served
    assert sum(w["gpu_lookups"] for w in per) <= 48
    for w in per:
        assert 0.0 <= w["gpu_hit_rate"] <= 1.0
        assert 1 <= w["resident"] <= 3                          # 384 KiB holds 3 of 112 KiB
        assert 0.0 < w["resident_frac"] <= 1.0
    mr = rows[0]["multi_resident"]
    assert 0 <= mr["count"] <= mr["union"] <= sum(w["resident"] for w in per)
    assert "2 workers behind the router" in (tmp_path / "out" / "fleet.md").read_text()


@pytest.mark.slow
def test_a_worker_killed_mid_run_loses_no_request_before_its_first_token(tmp_path):
    """Worker 1 SIGKILLed 3 s into an open-loop stream and started again on its port: no
    request failed before its first token (the router retried those on worker 0), none got a
    token twice, every failure had streamed tokens, and the restarted worker served again,
    the scenario's tail (sent once the router counted it live, however long the restart took)
    among them."""
    # 5 s of arrivals (the kill 3 s in, with dozens of requests in flight on both workers),
    # then the tail once the restarted worker is live
    doc = _run(tmp_path, "kill:adapters=16,rank=8,zipf=1.0,rate=30,requests=150,"
                         "prompt=8:16,output=32:64,kill_at=3,kill_worker=1,after_rejoin=40")
    (row,) = {r["scenario"]: r for r in doc["rows"]}.values()
    k = row["killed"]
    assert k["worker"] == 1 and k["requests"] == 190
    assert k["in_flight_at_kill"] > 0
    assert k["failed_before_token_n"] == 0, k["before_token_examples"]
    assert k["duplicated"] == 0
    assert k["ok"] + sum(k["failed_after_tokens"].values()) == 190
    assert set(k["failed_after_tokens"]) <= {"UNAVAILABLE"}
    ev = k["events_s"]
    assert ev["killed"] < ev["serving"] <= ev["router_sees"] <= ev["first_request"]
    assert k["served_by_restarted"] > 0 and k["sent_after_rejoin"] > 0
    assert row["per_worker"][1]["gpu_lookups"] >= k["served_by_restarted"]
