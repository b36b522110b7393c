"""Capacity simulator v2: a fleet of workers on simulated time running the very policy code the
services run — CachePolicy for the GPU pool (bytes and slots) and the host tiers (LRU, or
cost-aware eviction on the GPU pool), the router's placement (choose_worker with its
spill_rows / load_floor), its fair gate and quotas — with cold-load times drawn from the
serving benchmark's measured per-tier distributions and an engine whose step time is a model
fitted to the e2e bench (bench/capacity/model.py states it; bench/capacity/fleet.py what is
simulated and what is not). Outputs throughput (out tok/s, req/s), TTFT percentiles and hit
rates per tier.

    # validate: regenerate bench/results/serve-h200.json's slora scenarios (deterministic from
    # its header), calibrate the two serving terms on its base and 5-adapter rows, predict the
    # 100 / 1,000 / 2,000-adapter rows -> bench/results/capacity-validate.{json,md}
    python -m bench.capacity.sim validate
    # replay a trace bench.serve.bench recorded (--trace-out), with the run's own flags
    python -m bench.capacity.sim replay /tmp/trace.json [--eviction cost]
    # the table: 10k and 100k adapters over 1-64 workers, LRU against cost-aware eviction
    # -> bench/results/capacity_sim.{json,md,png}
    python -m bench.capacity.sim table [--adapters 10000,100000] [--workers 1,2,4,8,16,32,64]
    # one synthetic run of your own (every WorkloadConfig / FleetConfig field is a flag)
    python -m bench.capacity.sim run --adapters 20000 --workers 8 --zipf 1.1 --rate 320
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.capacity import replay as cr, report
from bench.capacity.fleet import Fleet, FleetConfig
from bench.capacity.model import fit_step_model, measured_load_times
from bench.capacity.workload import WorkloadConfig, make_requests
from bench.lib.header import RESULTS, ROOT
from services.common.runtime import parse_bytes

VALIDATED = ("slora-100", "slora-1000", "slora-2000")
TARGETS = (1000, 2000)       # the rows; slora-100 goes beside them ("also")


def meta(started: float) -> dict:
    """Date, machine, versions, commit: the results' header."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=ROOT, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs",
            "python": platform.python_version(), "commit": commit,
            "seconds": round(time.perf_counter() - started, 1)}


def models(results: Path = RESULTS):
    """The step model fitted to the e2e bench, calibrated on serve-h200's base and 5-adapter
    rows; the load times; the serving run's header and measured rows; the fit's notes."""
    doc = json.loads((results / "serve-h200.json").read_text())
    measured = {r["scenario"]: r for r in doc["rows"]}
    model, fit = fit_step_model(results)
    loads = measured_load_times(results)
    model, cal = cr.calibrate(doc["header"], measured, model, loads)
    return model, loads, doc, {"fit": fit, "calibration": cal,
                               "step_model": dataclasses.asdict(model),
                               "load_times_s": loads.tiers}


def validate(out: Path) -> dict:
    """Predict serve-h200's slora rows; write capacity-validate.{json,md}."""
    started = time.perf_counter()
    model, loads, doc, notes = models()
    header = doc["header"]
    measured, cold = {}, {}
    for r in doc["rows"]:                       # a row per cold tier: the first has the totals
        measured.setdefault(r["scenario"], r)
        if r.get("cold_tier"):
            cold.setdefault(r["scenario"], {})[r["cold_tier"]] = r["cold_n"]
    sim = cr.replay(Fleet(cr.fleet_config(header), model, loads),
                    cr.scenario_phases(header, VALIDATED[-1]))
    rows = []
    for name in VALIDATED:
        m, p = measured[name], sim[name]
        rows.append({"scenario": name, "adapters": m["adapters"],
                     "measured_gpu_hit": m["gpu_hit_rate"], "predicted_gpu_hit": p["gpu_hit_rate"],
                     "measured_tok_s": m["out_tok_s"], "predicted_tok_s": p["out_tok_s"],
                     "gpu_hit_rel_err": round(p["gpu_hit_rate"] / m["gpu_hit_rate"] - 1, 4),
                     "tok_s_rel_err": round(p["out_tok_s"] / m["out_tok_s"] - 1, 4),
                     "loads": {"measured": cold.get(name, {}), "predicted": p["loads"]},
                     # GPU lookups the worker counted: its misses (one per cold load) / miss rate
                     "lookups": {"requests": m["requests"], "measured": round(
                         m["worker_cold_records"] / (1 - m["gpu_hit_rate"])),
                         "predicted": p["gpu_lookups"], "prefetches": p["prefetches"]},
                     "measured": {k: m.get(k) for k in report.COMPARED},
                     "predicted": {k: p.get(k) for k in report.COMPARED + ("request_tiers",)}})
    doc_out = {"header": {**meta(started), "serve": {k: header[k] for k in
                                                     ("date", "card", "commit", "argv")},
                          **notes},
               "rows": [r for r in rows if r["adapters"] in TARGETS],
               "also": [r for r in rows if r["adapters"] not in TARGETS]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity-validate.json").write_text(json.dumps(doc_out, indent=1))
    (out / "capacity-validate.md").write_text(report.validate_md(doc_out))
    return doc_out


def replay_trace(path: Path, eviction: str | None) -> dict:
    """Replay a bench.serve.bench --trace-out file with its run's flags; figures per scenario."""
    model, loads, _, _ = models()
    header, phases = cr.trace_phases(path)
    over = {"eviction": eviction} if eviction else {}
    return cr.replay(Fleet(cr.fleet_config(header, **over), model, loads), phases)


def synthetic(wcfg: WorkloadConfig, fcfg: FleetConfig, model, loads,
              warmup: float = 0.25) -> dict:
    """One synthetic run; figures over the requests after the first `warmup` share."""
    reqs = make_requests(wcfg)
    fleet = Fleet(fcfg, model, loads)
    fleet.run(reqs)
    measured = reqs[int(warmup * len(reqs)):]
    steps = [s for w in fleet.workers for s in w.steps]
    fig = cr.figures(measured, {}, {}, steps, counters=False)
    n = max(1, fig["ok"])
    fig["hit_share"] = {t: round(c / n, 4) for t, c in fig["request_tiers"].items()}
    fig["gpu_hit_rate"] = fig["hit_share"]["gpu"]
    fig["cold_loads_per_s"] = round(sum(fig["request_tiers"][t] for t in
                                        ("worker_host", "store_host", "source"))
                                    / max(fig["span_s"], 1e-9), 1)
    fig["throttled"], fig["prefetches"] = fleet.throttled, fleet.prefetches
    fig.update(tenant_figures(measured, wcfg))
    return fig


def tenant_figures(reqs: list, wcfg: WorkloadConfig) -> dict:
    """GPU hit share per tenant, and the steady tenants' while the bursty one bursts (v1's)."""
    per: dict[str, list[int]] = {}
    burst = [0, 0]
    for r in reqs:
        hit = r.tier == "gpu"
        got = per.setdefault(r.tenant, [0, 0])
        got[0], got[1] = got[0] + hit, got[1] + 1
        if r.tenant != "bursty" and r.at % wcfg.burst_period_s < wcfg.burst_on_s:
            burst[0], burst[1] = burst[0] + hit, burst[1] + 1
    rates = {t: round(h / n, 4) for t, (h, n) in sorted(per.items())}
    steady = [v for t, v in rates.items() if t != "bursty"]
    return {"tenant_gpu_hit": rates,
            "steady_min_gpu_hit": min(steady) if steady else None,
            "steady_gpu_hit_in_bursts": round(burst[0] / burst[1], 4) if burst[1] else None}


def table(out: Path, name: str, grid: dict, wcfg: WorkloadConfig, fcfg: FleetConfig,
          rate_per_worker: float, requests_per_worker: int = 1500) -> dict:
    """Every combination of grid's adapters, workers, gpu_pool_bytes, zipf and eviction; the
    fleet's rate rate_per_worker x workers, at least requests_per_worker x workers requests
    (wcfg.requests at least). Writes NAME.{json,md,png} under out."""
    started = time.perf_counter()
    model, loads, _, notes = models()
    runs = []
    for a, zipf, pool, w, ev in itertools.product(grid["adapters"], grid["zipf"],
                                                  grid["gpu_pool_bytes"], grid["workers"],
                                                  grid["eviction"]):
        wl = dataclasses.replace(wcfg, adapters=a, zipf=zipf, rate=rate_per_worker * w,
                                 requests=max(wcfg.requests, requests_per_worker * w))
        t = time.perf_counter()
        fig = synthetic(wl, dataclasses.replace(fcfg, workers=w, eviction=ev,
                                                gpu_pool_bytes=pool), model, loads)
        runs.append({"adapters": a, "workers": w, "eviction": ev, "zipf": zipf,
                     "gpu_pool_gib": pool / (1 << 30), "rate": wl.rate,
                     "sim_requests": wl.requests, **fig,
                     "sim_s": round(time.perf_counter() - t, 1)})
        print(report.table_line(runs[-1]), flush=True)
    doc = {"header": {**meta(started), "workload": dataclasses.asdict(wcfg),
                      "fleet": dataclasses.asdict(fcfg), "rate_per_worker": rate_per_worker,
                      "requests_per_worker": requests_per_worker,
                      **notes}, "runs": runs}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    (out / f"{name}.md").write_text(report.table_md(doc))
    report.plot(out / f"{name}.png", doc)
    return doc


def _add_fields(p: argparse.ArgumentParser, *configs) -> None:
    seen = set()
    for cfg in configs:
        for f in dataclasses.fields(cfg):
            if f.name in seen:              # seed: the workload's and the fleet's, one flag
                continue
            seen.add(f.name)
            kind = parse_bytes if f.name.endswith("_bytes") else type(f.default)
            p.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=None)


def _pick(cls, args, **over):
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
             if getattr(args, f.name, None) is not None}
    return cls(**{**given, **over})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="predict serve-h200.json's slora rows")
    v.add_argument("--out", type=Path, default=RESULTS)
    r = sub.add_parser("replay", help="replay a bench.serve.bench --trace-out file")
    r.add_argument("trace", type=Path)
    r.add_argument("--eviction", choices=("lru", "cost"))
    t = sub.add_parser("table", help="adapters x workers x eviction")
    t.add_argument("--out", type=Path, default=RESULTS)
    t.add_argument("--name", default="capacity_sim", help="results NAME.{json,md,png}")
    t.add_argument("--workers-list", default="1,2,4,8,16,32,64")
    t.add_argument("--adapters-list", default="10000,100000")
    t.add_argument("--evictions", default="lru,cost")
    t.add_argument("--gpu-pool-list", default="4GiB", help="GPU pool bytes per worker")
    t.add_argument("--zipf-list", default="1.0")
    t.add_argument("--rate-per-worker", type=float, default=40.0)
    t.add_argument("--requests-per-worker", type=int, default=1500)
    one = sub.add_parser("run", help="one synthetic run")
    for sp in (t, one):
        _add_fields(sp, WorkloadConfig, FleetConfig)
    args = p.parse_args(argv)
    if args.cmd == "validate":
        print(report.validate_md(validate(args.out)))
    elif args.cmd == "replay":
        print(json.dumps(replay_trace(args.trace, args.eviction), indent=1))
    elif args.cmd == "table":
        items = (lambda s, f=int: [f(x) for x in s.split(",") if x])
        grid = {"adapters": items(args.adapters_list), "workers": items(args.workers_list),
                "eviction": items(args.evictions, str), "zipf": items(args.zipf_list, float),
                "gpu_pool_bytes": items(args.gpu_pool_list, parse_bytes)}
        table(args.out, args.name, grid, _pick(WorkloadConfig, args), _pick(FleetConfig, args),
              args.rate_per_worker, args.requests_per_worker)
        print((args.out / f"{args.name}.md").read_text())
    else:
        model, loads, _, _ = models()
        print(json.dumps(synthetic(_pick(WorkloadConfig, args), _pick(FleetConfig, args),
                                   model, loads), indent=1))


if __name__ == "__main__":
    main()
