"""The capacity simulator on CPU: a small recorded trace replays to the hit rates its requests
imply, and cost-aware eviction beats LRU where it must (a hot set of small adapters against a
scan of big ones). Fast: a few thousand simulated steps."""
from __future__ import annotations

import json
import random

from bench.capacity import replay as cr
from bench.serve import scenarios as ss
from bench.capacity.fleet import Fleet, FleetConfig, SimRequest
from bench.capacity.model import LoadTimes, StepModel, fit_step_model, measured_load_times

MB = 1 << 20
STEP = StepModel(a0=5.0, a1=0.02, c0=0.3, c1=0.01, k_pre=0.02)
LOADS = LoadTimes({"source": (0.03, 0.07), "worker_host": (0.006, 0.02),
                   "store_host": (0.02, 0.05)}, 16 * MB)


def _trace(tmp_path, adapters: int, requests: int) -> tuple[str, list]:
    """A trace in serve_bench --trace-out's format: one open-loop Zipf scenario."""
    header = json.loads(open("bench/results/serve-h200.json").read())["header"]
    s = ss.Scenario("small", adapters=adapters, rate=20.0, requests=requests, warmup=8,
                    prompt=(32, 64), output=(8, 16))
    ids = [f"r8-{i:04d}" for i in range(adapters)]
    rows = []
    for phase, n in (("warmup", s.warmup), ("measure", s.requests)):
        for r in ss.build_requests(s, ids, 1000, 4, 0, phase, n):
            rows.append({"at": r.at, "adapter": r.adapter, "tenant": r.tenant, "phase": phase,
                         "prompt": len(r.prompt), "output": r.max_new, "tier": None})
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"header": header, "scenarios": {"small": rows}}))
    return str(path), rows


def test_replayed_trace_misses_once_per_adapter_when_the_pool_holds_all(tmp_path) -> None:
    path, rows = _trace(tmp_path, adapters=30, requests=300)
    header, phases = cr.trace_phases(path)
    fleet = Fleet(cr.fleet_config(header), STEP, LOADS)       # 4 GiB: all 30 fit
    fig = cr.replay(fleet, phases)["small"]
    warm = {r["adapter"] for r in rows if r["phase"] == "warmup"}
    fresh = {r["adapter"] for r in rows if r["phase"] == "measure"} - warm
    tiers = fig["request_tiers"]
    assert fig["ok"] == 300 and tiers["source"] == len(fresh) and tiers["worker_host"] == 0
    hits = tiers["gpu"]
    assert fig["gpu_hit_rate"] == round(hits / (hits + len(fresh)), 4)
    assert 0.5 < fig["gpu_hit_rate"] < 1.0
    assert fig["out_tok_s"] > 0 and fig["ttft_p50_ms"] > 0


def test_a_pool_smaller_than_the_working_set_reloads_from_the_host_tier(tmp_path) -> None:
    path, _ = _trace(tmp_path, adapters=200, requests=400)
    header, phases = cr.trace_phases(path)
    cfg = cr.fleet_config(header, gpu_pool_bytes=20 * 16 * MB, pool_slots=64)
    fig = cr.replay(Fleet(cfg, STEP, LOADS), phases)["small"]
    assert fig["request_tiers"]["worker_host"] > 0
    assert fig["gpu_hit_rate"] < 0.8 and fig["worker_host_hit_rate"] > 0


def _scan_workload() -> list[SimRequest]:
    """Rounds of four small hot adapters, then two big ones never seen again; one at a time."""
    out, t = [], 0.0
    for k in range(60):
        for key, nbytes in [(f"hot{i}", MB) for i in range(4)] + [
                (f"big{k}-{j}", 8 * MB) for j in range(2)]:
            out.append(SimRequest(len(out), t, key, "t0", 8, 1, nbytes))
            t += 1.0
    return out


def test_cost_aware_eviction_keeps_the_hot_small_adapters_lru_loses() -> None:
    results = {}
    for eviction in ("lru", "cost"):
        cfg = FleetConfig(gpu_pool_bytes=16 * MB, pool_slots=32, host_pool_bytes=1 << 30,
                          eviction=eviction, tenant_share=0.0)
        reqs = Fleet(cfg, STEP, LOADS).run(_scan_workload())
        hot = [r for r in reqs[40:] if r.adapter.startswith("hot")]
        results[eviction] = sum(r.tier == "gpu" for r in hot) / len(hot)
    assert results["lru"] == 0.0                  # two big ones push the whole hot set out
    assert results["cost"] > 0.9


def test_the_step_model_fits_the_e2e_bench_and_the_loads_are_measured() -> None:
    model, fit = fit_step_model()
    assert fit["points"] >= 8 and fit["max_abs_residual_ms"] < 0.5
    assert 3.0 < model.ms(64, 0, 0, 0) < 8.0 < model.ms(64, 4096, 32, 64)
    loads = measured_load_times()
    rng = random.Random(0)
    samples = sorted(loads.sample(rng, "source", loads.ref_bytes) for _ in range(2001))
    p50, _ = loads.tiers["source"]
    assert abs(samples[1000] / p50 - 1) < 0.1
