"""Measured runs as simulator input: the serving benchmark's request sequence regenerated from a
results file's header (its workload generation is deterministic from scenario and seed:
bench.serve.scenarios.build_requests), or read from a trace it recorded (--trace-out); the
fleet flags from its argv; and the figures of a simulated phase, named as bench.serve.bench
names its.
"""
from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

from bench.serve import scenarios as ss
from bench.capacity.fleet import Fleet, FleetConfig, SimRequest

TIERS = ("gpu", "worker_host", "store_host", "source")     # what a trace row's tier may be


def pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile, as bench.serve.metrics.pct."""
    s = sorted(xs)
    if not s:
        return None
    return float(s[max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))])


def bench_args(header: dict):
    """bench.serve.bench's parsed flags of a recorded run (its defaults where the argv left
    them)."""
    from bench.serve import bench as serve_bench
    return serve_bench.parser().parse_args(header["argv"])


def _flags(command: str) -> dict[str, str]:
    """--name value / --name=value pairs of a recorded service command line."""
    words, out = shlex.split(command), {}
    for i, w in enumerate(words):
        if w.startswith("--"):
            name, eq, value = w[2:].partition("=")
            if eq:
                out[name] = value
            elif i + 1 < len(words) and not words[i + 1].startswith("--"):
                out[name] = words[i + 1]
    return out


def fleet_config(header: dict, **over) -> FleetConfig:
    """The recorded run's flags as a FleetConfig: from the services' own command lines in the
    header (what they ran with), the services' defaults for what they were not given."""
    from services.adapter_store.config import StoreConfig
    from services.common.runtime import parse_bytes
    from services.router.config import RouterConfig
    from services.worker.config import flag_defaults
    cmd = header["services"]
    w, r, st = (_flags(cmd[k]) for k in ("worker", "router", "adapter_store"))
    wd, rd, sd = flag_defaults(), RouterConfig, StoreConfig

    def get(flags: dict, name: str, default, kind=int):
        return kind(flags[name]) if name in flags else default
    values = {
        "gpu_pool_bytes": get(w, "gpu-pool-bytes", wd["gpu_pool_bytes"], parse_bytes),
        "pool_slots": get(w, "pool-slots", wd["pool_slots"]),
        "host_pool_bytes": get(w, "host-pool-bytes", wd["host_pool_bytes"], parse_bytes),
        "max_running": get(w, "max-running", wd["max_running"]),
        "max_batch_tokens": get(w, "max-batch-tokens", wd["max_batch_tokens"]),
        "tenant_share": get(w, "tenant-share", wd["tenant_share"], float),
        "eviction": get(w, "eviction", wd["eviction"], str),
        "loader_threads": get(w, "loader-threads", wd["loader_threads"]),
        "store_host_bytes": get(st, "host-cache-bytes",
                                sd.__dataclass_fields__["host_cache_bytes"].default, parse_bytes),
        "max_in_flight_per_worker": get(r, "max-in-flight-per-worker",
                                        _default(rd, "max_in_flight_per_worker")),
        "foothold_per_worker": get(r, "foothold-per-worker", _default(rd, "foothold_per_worker")),
        "spill_rows": get(r, "spill-rows", _default(rd, "spill_rows"))}
    return dataclasses.replace(FleetConfig(**values), **over)


def _default(cls, name: str):
    return cls.__dataclass_fields__[name].default


def adapter_bytes(header: dict) -> dict[str, int]:
    """Adapter id -> bytes, from the header's adapter groups (ids r{rank}-{i:04d})."""
    sizes = header["adapters"]["bytes"]
    return {f"r{g['rank']}-{i:04d}": int(sizes[str(g["rank"])])
            for g in header["adapters"]["groups"] for i in range(g["count"])}


def scenario_phases(header: dict, upto: str) -> list[tuple[str, str, list[SimRequest]]]:
    """(scenario, phase, requests) of every open-loop gRPC scenario of the run up to and
    including `upto`, warm-up before measured, exactly as bench.serve.bench built them."""
    a, vocab, sizes = bench_args(header), header["model"]["vocab"], adapter_bytes(header)
    out = []
    for fields in header["scenarios"]:
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
        s = ss.Scenario(**{k: v for k, v in fields.items()
                           if k in {f.name for f in dataclasses.fields(ss.Scenario)}})
        if s.path != "grpc" or s.rate is None or s.cold_requests or s.preload:
            continue
        ids = [f"r{s.rank}-{i:04d}" for i in range(s.adapters)]
        for phase, n in (("warmup", s.warmup), ("measure", s.requests)):
            if n:
                reqs = ss.build_requests(s, ids, vocab, a.tenants, a.seed, phase, n)
                out.append((s.name, phase, [SimRequest(r.index, r.at, r.adapter, r.tenant,
                                                       len(r.prompt), r.max_new,
                                                       sizes.get(r.adapter, 0), phase)
                                            for r in reqs]))
        if s.name == upto:
            break
    return out


def trace_phases(path: Path) -> tuple[dict, list[tuple[str, str, list[SimRequest]]]]:
    """A bench.serve.bench --trace-out file: its header and its scenarios' phases, in order."""
    doc = json.loads(Path(path).read_text())
    sizes, out = adapter_bytes(doc["header"]), []
    for name, rows in doc["scenarios"].items():
        for phase in ("warmup", "measure"):
            part = [r for r in rows if r["phase"] == phase]
            if part:
                out.append((name, phase, [SimRequest(i, r["at"], r["adapter"], r["tenant"],
                                                     r["prompt"], r["output"] or 1,
                                                     sizes.get(r["adapter"], 0), phase)
                                          for i, r in enumerate(part)]))
    return doc["header"], out


def replay(fleet: Fleet, phases) -> dict[str, dict]:
    """Run the phases in order on one fleet; the figures of every measured phase."""
    out = {}
    for name, phase, reqs in phases:
        before, steps0 = fleet.counters(), [len(w.steps) for w in fleet.workers]
        fleet.run(reqs)
        if phase == "measure":
            steps = [s for w, n in zip(fleet.workers, steps0) for s in w.steps[n:]]
            out[name] = figures(reqs, before, fleet.counters(), steps)
    return out


def _rate(h0m0, h1m1) -> float | None:
    hits, misses = h1m1[0] - h0m0[0], h1m1[1] - h0m0[1]
    return round(hits / (hits + misses), 4) if hits + misses else None


def figures(reqs: list[SimRequest], before: dict, after: dict, steps,
            counters: bool = True) -> dict:
    """bench.serve.bench's row fields for one simulated phase, and the tiers requests hit; the hit
    rates from the tiers' counters before and after (counters=False: None)."""
    done = [r for r in reqs if r.end is not None]
    span = max(r.end for r in done) - min(r.sent for r in done) if done else 0.0
    tokens = sum(r.output for r in done)
    ttft = [r.ttft for r in done]
    e2e = [r.end - r.sent for r in done]
    itl = sorted((dt, n) for dt, n in steps if n)         # a step's time, once per decode row
    total, acc, itl50 = sum(n for _, n in itl), 0, None
    for dt, n in itl:
        acc += n
        if acc >= total / 2:
            itl50 = dt
            break
    tiers = {t: sum(1 for r in done if r.tier == t)
             for t in ("gpu", "joined", "worker_host", "store_host", "source")}
    ms = (lambda v: None if v is None else round(v * 1e3, 3))
    return {"requests": len(reqs), "ok": len(done), "tokens": tokens, "span_s": round(span, 3),
            "out_tok_s": round(tokens / span, 2) if span else 0.0,
            "req_s": round(len(done) / span, 3) if span else 0.0,
            "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p90_ms": ms(pct(ttft, 90)),
            "ttft_p99_ms": ms(pct(ttft, 99)), "itl_p50_ms": ms(itl50),
            "e2e_p50_ms": ms(pct(e2e, 50)), "e2e_p99_ms": ms(pct(e2e, 99)),
            "gpu_hit_rate": _rate(before["gpu"], after["gpu"]) if counters else None,
            "worker_host_hit_rate": _rate(before["host"], after["host"]) if counters else None,
            "store_host_hit_rate": _rate(before["store"], after["store"]) if counters else None,
            "request_tiers": tiers, **(_deltas(before, after) if counters else {})}


def _deltas(before: dict, after: dict) -> dict:
    """Cold loads per source tier, GPU lookups and prefetch hints over the phase."""
    loads = {t: after["loads"].get(t, 0) - before["loads"].get(t, 0)
             for t in ("worker_host", "store_host", "source")}
    return {"loads": loads, "gpu_lookups": sum(after["gpu"]) - sum(before["gpu"]),
            "prefetches": after["prefetches"] - before["prefetches"]}


def calibrate(header: dict, measured: dict[str, dict], model, loads, key: str = "e2e_p50_ms"):
    """The step model's two serving terms from the run's base and 5-adapter rows only: e0 (a
    mixed step's eager cost) so that slora-base's simulated `key` matches the measured one,
    then e_lora (its LoRA part) for slora-5, by bisection. Returns (model, what was fitted)."""
    phases = scenario_phases(header, "slora-5")
    cfg = fleet_config(header)

    def sim(m, upto: str) -> float:
        part = phases[:max(i for i, p in enumerate(phases) if p[0] == upto) + 1]
        return replay(Fleet(cfg, m, loads), part)[upto][key]

    def bisect(make, target: float, lo: float = 0.0, hi: float = 80.0) -> float:
        for _ in range(16):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if sim(make(mid), upto) < target else (lo, mid)
        return round((lo + hi) / 2, 3)

    upto = "slora-base"
    e0 = bisect(lambda v: dataclasses.replace(model, e0=v), measured[upto][key])
    model = dataclasses.replace(model, e0=e0)
    upto = "slora-5"
    e_lora = bisect(lambda v: dataclasses.replace(model, e_lora=v), measured[upto][key])
    return dataclasses.replace(model, e_lora=e_lora), {
        "target": key, "e0_ms": e0, "e_lora_ms": e_lora,
        "from": {s: measured[s][key] for s in ("slora-base", "slora-5")}}
