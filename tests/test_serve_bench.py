"""bench/serve/bench.py: its scenarios, request lists, adapters and figures, and a --quick run
through the real services whose result files must be complete. Nothing here is timed."""
from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys

import pytest

from bench.serve import metrics as sm
from bench.serve import report as serve_report
from bench.serve import scenarios as ss

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULTS = {"requests": 10, "warmup": 0, "prompt": (4, 4), "output": (2, 2), "rate": None,
            "concurrency": 4}


def test_scenarios_parse_with_the_mode_given_replacing_the_default():
    a, b = ss.parse_scenarios("a:adapters=5,rank=16,zipf=0.5,rate=2.5;b:prompt=8:16,"
                              "preload=1,cold=1,cold_n=3", DEFAULTS)
    assert (a.adapters, a.rank, a.zipf, a.rate, a.concurrency) == (5, 16, 0.5, 2.5, None)
    assert (b.concurrency, b.prompt, b.preload, b.cold_requests) == (4, (8, 16), True, 3)
    assert ss.parse_scenario("c:rate=auto", DEFAULTS).rate == "auto"
    for bad in ("d:colour=1", "e:rate=1,concurrency=2", "f:prompt=9:3", "g:cold=1"):
        with pytest.raises(ValueError):
            ss.parse_scenario(bad, DEFAULTS)


def test_request_lists_are_reproducible_and_follow_the_scenario():
    s = ss.parse_scenario("x:adapters=3,zipf=1.0,rate=50,requests=200,prompt=5:9,output=3",
                          DEFAULTS)
    ids = ["a", "b", "c"]
    one = ss.build_requests(s, ids, vocab=100, tenants=2, seed=7)
    assert one == ss.build_requests(s, ids, vocab=100, tenants=2, seed=7)
    assert one != ss.build_requests(s, ids, vocab=100, tenants=2, seed=8)
    assert all(5 <= len(r.prompt) <= 9 and min(r.prompt) >= 10 and max(r.prompt) < 100
               and r.max_new == 3 for r in one)
    assert all(r.tenant == f"t{ids.index(r.adapter) % 2}" for r in one)
    counts = [sum(r.adapter == a for r in one) for a in ids]
    assert counts[0] > counts[2]                             # Zipf: the first is the most used
    times = [r.at for r in one]
    assert times == sorted(times) and 2 < times[-1] < 8      # ~200 / 50 s of Poisson arrivals
    base = ss.build_requests(ss.parse_scenario("y:", DEFAULTS), [], 100, 2, 0)
    assert all(r.adapter == "" and r.at is None for r in base)


def test_a_cold_stream_arrives_by_poisson_at_once_or_one_at_a_time():
    s = ss.parse_scenario("c:concurrency=4,cold_n=3,cold_arrival=burst,burst_at=1.5", DEFAULTS)
    assert s.cold_requests == 3 and s.cold == 0
    burst = ss.cold_stream(s, ["a", "b", "c"], 100, 2, 0, 10)
    assert [r.index for r in burst] == [10, 11, 12] and {r.at for r in burst} == {1.5}
    assert all(r.cold and r.extra == {"burst": True} for r in burst)
    chain = ss.cold_stream(ss.parse_scenario("d:cold_n=2,cold_arrival=chain,burst_at=2",
                                             DEFAULTS), ["a", "b"], 100, 2, 0, 0)
    assert all(r.extra == {"chain": True} and r.at == 2.0 for r in chain)
    poisson = ss.cold_stream(ss.parse_scenario("p:rate=5,cold=4,cold_n=3", DEFAULTS),
                             ["a", "b", "c"], 100, 2, 0, 0)
    times = [r.at for r in poisson]
    assert times == sorted(times) and len(set(times)) == 3 and all(not r.extra for r in poisson)
    assert ss.adapter_needs([s]) == {8: 3}
    for bad in ("e:cold_n=2,cold_arrival=sometimes", "f:cold_arrival=burst"):
        with pytest.raises(ValueError):
            ss.parse_scenario(bad, DEFAULTS)


def test_adapter_needs_count_a_fresh_adapter_per_cold_request():
    sc = ss.parse_scenarios("a:adapters=32,rank=16;b:adapters=32,rank=16,cold=2,cold_n=5;"
                            "c:adapters=100,rank=8;base:adapters=0", DEFAULTS)
    assert ss.adapter_needs(sc) == {16: 37, 8: 100}


def test_adapters_are_distinct_valid_peft_and_reused(tmp_path):
    import torch
    from safetensors.torch import load_file
    from bench.serve import model as serve_model
    cfg = serve_model.model_config("tiny")
    man = serve_model.ensure_adapters(tmp_path, cfg, [(5, 4), (2, 8)], ["q_proj", "v_proj"],
                                      "bf16")
    dirs = [tmp_path / "adapters" / a for ids in man["ids"].values() for a in ids]
    blobs = {hashlib.sha256((d / "adapter_model.safetensors").read_bytes()).hexdigest()
             for d in dirs}
    assert len(blobs) == len(dirs) == 7
    for d in dirs:
        config = json.loads((d / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and config["r"] == int(d.name[1:].split("-")[0])
        t = load_file(str(d / "adapter_model.safetensors"))
        assert len(t) == 2 * 2 * cfg["num_hidden_layers"]
        flat = torch.cat([x.float().flatten() for x in t.values()])
        assert torch.isfinite(flat).all() and 0.005 < flat.std() < 0.02
    stamp = (dirs[0] / "adapter_model.safetensors").stat().st_mtime_ns
    serve_model.ensure_adapters(tmp_path, cfg, [(5, 4), (2, 8)], ["q_proj", "v_proj"], "bf16")
    assert (dirs[0] / "adapter_model.safetensors").stat().st_mtime_ns == stamp


def _record(i, send, times, cold=False, tier=None, load=0.0, status="OK"):
    return {"index": i, "adapter": "a", "tenant": "t0", "cold": cold, "phase": "measure",
            "prompt": 4, "send": send, "end": times[-1] if times else send, "times": times,
            "status": status, "error": "", "tokens": len(times),
            "timings": {"queue_s": 0.0, "cold_load_s": load, "time_to_first_token_s": 0.1,
                        "total_s": times[-1] - send if times else 0.0, "adapter_tier": tier}}


def test_client_figures_and_the_itl_inside_cold_windows():
    recs = [_record(0, 0.0, [0.1, 0.2, 0.3, 1.3]), _record(1, 0.5, [0.6, 0.7]),
            _record(2, 0.5, [], status="UNAVAILABLE")]
    fig = sm.client_figures(recs)
    assert fig["tokens"] == 6 and fig["out_tok_s"] == pytest.approx(6 / 1.3, abs=0.01)
    assert fig["errors"] == {"UNAVAILABLE": 1} and fig["ttft_p50_ms"] == pytest.approx(100)
    assert fig["itl_p99_ms"] == pytest.approx(1000)
    split = sm.itl_split(recs, [(0.9, 1.0)])       # overlaps the 0.3 -> 1.3 gap only
    assert split["gaps_in_cold_windows"] == 1 and split["itl_p99_cold_ms"] == pytest.approx(1000)
    assert split["itl_p99_outside_ms"] == pytest.approx(100)


def test_cold_figures_per_tier_from_the_worker_records_with_stages():
    from services.common.gen.lorafleet.v1 import common_pb2, worker_pb2
    recs = [worker_pb2.ColdLoadRecord(seq=i + 1, tier=common_pb2.SOURCE, total_s=0.01 * (i + 1),
                                      fetch_s=0.005, end_unix_s=10.0 + i) for i in range(3)]
    reqs = [_record(0, 0.0, [0.2, 0.3], tier="source", load=0.02)]
    tiers = sm.cold_by_tier(recs, {}, reqs)
    assert list(tiers) == ["source"] and tiers["source"]["n"] == 3
    assert tiers["source"]["p50_ms"] == pytest.approx(20)
    assert tiers["source"]["stages"]["fetch_s"]["p99_ms"] == pytest.approx(5)
    assert tiers["source"]["first_step_p50_ms"] == pytest.approx(80)
    windows, source = sm.cold_windows(recs, reqs)
    assert source == "worker" and windows[0] == pytest.approx((9.99, 10.0))
    # no records (today's worker): the histograms give the totals, the requests the windows
    fallback = sm.cold_by_tier([], {"store_host": [0.004]}, [])
    assert fallback["store_host"]["from"] == "worker_histogram"
    assert sm.cold_windows([], reqs)[1] == "request_timings"


def test_rows_carry_every_required_field():
    s = ss.parse_scenario("x:adapters=2", DEFAULTS)
    fig = sm.client_figures([_record(0, 0.0, [0.1, 0.2])])
    tiers = sm.cold_by_tier([], {"source": [0.01]}, [])
    for rows in (serve_report.scenario_rows(s, fig, {"gpu_hit_rate": 0.5}, {}, {}),
                 serve_report.scenario_rows(s, fig, {"gpu_hit_rate": 0.5}, tiers, {})):
        assert all(set(serve_report.ROW_FIELDS) <= set(r) for r in rows)
    assert rows[0]["cold_tier"] == "source" and rows[0]["cold_p50_ms"] == pytest.approx(10)


@pytest.mark.slow
def test_quick_run_writes_complete_results(tmp_path):
    """The services as processes, the engine in-process, tiny counts: result files complete,
    the base model's row there, loads from a cold tier, tokens served, no errors."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bench.serve.bench", "--quick", "--out", str(out),
                           "--work", str(tmp_path / "work")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads((out / "serve-cpu.json").read_text())
    for key in ("date", "card", "versions", "commit", "argv", "model", "adapters", "services"):
        assert doc["header"][key], key
    assert {"adapter_store", "worker", "router"} <= set(doc["header"]["services"])
    assert {"python", "torch", "grpcio", "protobuf"} <= set(doc["header"]["versions"])
    rows = doc["rows"]
    for r in rows:
        assert set(serve_report.ROW_FIELDS) <= set(r), r["scenario"]
        assert r["out_tok_s"] > 0 and not r["errors"], r
    assert any(r["adapters"] == 0 and r["path"] == "grpc" for r in rows)
    assert any(r["cold_tier"] is not None and r["cold_p50_ms"] is not None for r in rows)
    assert any(r["path"] == "engine" for r in rows)
    assert "| scenario |" in (out / "serve-cpu.md").read_text()
    for r in (r for r in rows if r["path"] == "grpc"):        # the worker's steps over each
        assert r["steps"]["steps"] > 0 and r["steps"]["classes"][0]["kind"] == "eager"
    assert "Engine steps by class" in (out / "serve-cpu.md").read_text()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "serve-cpu.png").stat().st_size > 0
    assert (out / "serve-cpu-cdf.png").stat().st_size > 0


def test_quick_run_with_cost_eviction_records_a_trace_the_simulator_replays(tmp_path):
    """--eviction reaches the worker, --trace-out writes every request with its tier, and the
    capacity simulator replays that trace with the run's own flags."""
    from bench.capacity import replay as cr
    from bench.capacity.fleet import Fleet
    from bench.capacity.model import LoadTimes, StepModel
    out, trace = tmp_path / "out", tmp_path / "trace.json"
    scenario = "t:adapters=16,rank=8,zipf=0.5,rate=20,requests=24,warmup=4,prompt=8:16,output=4:8"
    proc = subprocess.run([sys.executable, "-m", "bench.serve.bench", "--quick", "--suite", "none",
                           "--scenarios", scenario, "--eviction", "cost", "--trace-out",
                           str(trace), "--out", str(out), "--work", str(tmp_path / "work")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(trace.read_text())
    assert "--eviction cost" in doc["header"]["services"]["worker"]
    rows = doc["scenarios"]["t"]
    assert [r["phase"] for r in rows].count("warmup") == 4 and len(rows) == 28
    assert all(r["status"] == "OK" and r["tier"] in cr.TIERS for r in rows)
    assert any(r["tier"] != "gpu" for r in rows) and rows[0]["at"] == 0.0
    header, phases = cr.trace_phases(trace)
    cfg = cr.fleet_config(header)
    assert cfg.eviction == "cost" and cfg.gpu_pool_bytes == 768 << 10
    step = StepModel(a0=5.0, a1=0.02, c0=0.3, c1=0.01, k_pre=0.02)
    loads = LoadTimes({"source": (0.03, 0.07), "worker_host": (0.006, 0.02),
                       "store_host": (0.02, 0.05)}, 112 << 10)
    fig = cr.replay(Fleet(cfg, step, loads), phases)["t"]
    assert fig["ok"] == 24 and 0.0 < fig["gpu_hit_rate"] < 1.0


@pytest.mark.slow
def test_a_service_that_exits_raises_with_the_end_of_its_log(tmp_path, capsys):
    """A bad flag (the store and worker addresses are closed loopback ports): the router exits
    2, and waiting for it raises at once, naming it, with its log's tail printed."""
    import os
    from bench.serve.stack import ServiceProc
    svc = ServiceProc("router", ["--store", "127.0.0.1:1", "--worker", "127.0.0.1:1",
                                 "--max-in-flight-per-worker", "0"], tmp_path, dict(os.environ))
    with pytest.raises(RuntimeError, match="router exited with 2"):
        svc.wait(60)
    assert "max-in-flight-per-worker" in capsys.readouterr().out
    svc.terminate()


@pytest.mark.slow
def test_quick_run_from_s3(tmp_path):
    """--source s3: the adapters uploaded to moto's server on loopback and registered with the
    store, then served."""
    pytest.importorskip("boto3")
    pytest.importorskip("moto")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bench.serve.bench", "--quick", "--source", "s3",
                           "--suite", "none", "--scenarios",
                           "s3:adapters=3,rank=8,zipf=0,concurrency=2,requests=9",
                           "--out", str(out), "--name", "s3"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads((out / "s3.json").read_text())["rows"]
    assert rows and all(r["ok"] == 9 and not r["errors"] for r in rows)
    assert {r["cold_tier"] for r in rows} == {"source"}


@pytest.mark.slow
def test_the_startup_bench_quick_run_writes_its_figures(tmp_path):
    """bench/stack/startup.py on the tiny model: two starts on one kernel cache, the measured
    scenario twice, the varied workload, and the six figures issue 23 names (not timed)."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bench.stack.startup", "--quick", "--work",
                           str(tmp_path / "work"), "--out", str(out), "--name", "startup-t"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "startup-t.json").read_text())
    for key in ("cold_start_s", "warm_start_s", "first_run_tok_s", "second_run_tok_s"):
        assert isinstance(doc[key], float) and doc[key] > 0, key
    assert doc["compiles_after_serving"] == 0 and doc["captures_after_serving"] == 0
    assert doc["late_compiles"] == []             # what the worker logged it needed late
    names = [r["scenario"] for r in doc["rows"]]
    assert names[:2] == ["startup-2", "startup-2-again"] and "varied-r8" in names
    assert not any(r["errors"] for r in doc["rows"])
    assert pathlib.Path(doc["header"]["kernel_cache"]).is_dir() and (out / "startup-t.md").exists()


def test_rates_as_fractions_of_saturation_and_a_prefill_burst_parse_and_build():
    s = ss.parse_scenario("b:adapters=3,rate=sat*0.8,burst=5,burst_prompt=20:30", DEFAULTS)
    assert (s.rate, s.rate_frac, s.concurrency, s.burst, s.burst_prompt) == \
        ("auto", 0.8, None, 5, (20, 30))
    for bad in ("c:rate=sat*0", "c:rate=sat*x", "c:burst=-1,rate=2"):
        with pytest.raises(ValueError):
            ss.parse_scenario(bad, DEFAULTS)
    s = ss.parse_scenario("b:adapters=3,rate=10,requests=40,burst=5,burst_prompt=20:30",
                          DEFAULTS)
    assert ss.burst_time(s) == 2.0                               # half way through arrivals
    burst = ss.burst_requests(s, ["a", "b", "c"], 100, 2, 0, 40, ss.burst_time(s))
    assert [r.index for r in burst] == list(range(40, 45)) and {r.at for r in burst} == {2.0}
    assert all(20 <= len(r.prompt) <= 30 and r.extra == {"burst": True} for r in burst)
    g = type("G", (), {"burst_prompt": "1024"})()
    names = [t.split(":")[0] for t in ss.suite("latency", g)]
    assert names[:5] == ["lat-base-20", "lat-base-40", "lat-base-60", "lat-base-80",
                         "lat-base-100"] and names[-1] == "prefill_burst"


def test_burst_figures_split_the_steady_gaps_at_the_burst_window():
    def rec(send, times, burst=False):
        return {"send": send, "times": times, "end": times[-1], "status": "OK", "cold": False,
                "burst": burst, "tokens": len(times), "error": ""}
    steady = rec(0.0, [0.1, 0.2, 0.3, 1.3, 1.4, 2.0, 2.1])      # a 1.0 s gap inside the burst
    burst = [rec(0.35, [1.25, 1.5], True), rec(0.35, [1.3, 1.6], True)]
    f = sm.burst_figures([steady, *burst])
    assert f["burst_requests"] == 2 and f["burst_window_ms"] == pytest.approx(950.0)
    assert f["itl_p99_burst_ms"] == pytest.approx(1000.0, rel=1e-6)
    assert f["burst_ttft_p50_ms"] == pytest.approx(925.0, abs=30)
    assert sm.client_figures([steady, *burst])["ttft_p50_ms"] == pytest.approx(100.0)
