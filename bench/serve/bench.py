"""The serving benchmark: load through the real services (adapter-store, one worker, router as
processes on loopback), as vLLM's benchmarks/benchmark_serving.py and S-LoRA's experiments run.

It writes (or takes, --model) a Llama checkpoint and N PEFT adapters into a work directory,
starts the services, sends requests to the router's GenerationService/GenerateStream from K
client processes (open-loop Poisson arrivals or a closed loop; Zipf adapter popularity; tenant
t{i % tenants} for adapter i) and reports per scenario: output tok/s, req/s, TTFT / ITL /
end-to-end percentiles, errors, the worker's GPU and host hit rates, the store's host hit rate,
cold loads per source tier (worker records stage by stage, when it sends them), and, with a
cold stream, the ITL of the other requests while loads run. Results: OUT/NAME.json (header +
rows), OUT/NAME.md, OUT/NAME.png and OUT/NAME-cdf.png.

    # a CPU smoke run (tiny model, a handful of adapters, a pool smaller than the working set)
    python -m bench.serve.bench --quick --out /tmp/serve
    # H200, Llama-2-7B shape: the S-LoRA sweep (5 .. 2,000 rank-8 adapters at 90% of the base
    # model's closed-loop req/s), the resident and cold-load cases, and the engine in-process
    python -m bench.serve.bench --shape 7b --device cuda --work /data/serve-work \\
        --suite slora,resident,cold,engine --gpu-pool-bytes 4GiB --kv-cache-bytes 40GiB \\
        --max-running 256 --max-batch-tokens 4096
    # latency: open loop at 20-100% of the base model's saturation (rate=sat*F), base and 32
    # adapters, and a prefill burst (64 prompts of --burst-prompt tokens at once) beside them
    python -m bench.serve.bench --shape 7b --device cuda --suite latency --name latency-h200
    # one scenario of your own (rate or concurrency; keys: see --scenarios)
    python -m bench.serve.bench --suite none --scenarios \\
        "mix:adapters=100,rank=8,zipf=1.0,rate=20,requests=400,prompt=64:256,output=128"

    # two workers behind the router, one per GPU (--workers 2 --devices cuda:0,cuda:1, or
    # --device cuda with two GPUs visible), or sharing one device with halved memory budgets
    # (--quick --workers 2); a worker killed mid-run and started again (after_rejoin=N: the
    # requests sent once the router counts it live again; default a tenth of requests):
    python -m bench.serve.bench --quick --workers 2 --suite none --scenarios \
        "kill:adapters=16,rank=8,zipf=1.0,rate=20,requests=200,kill_at=3,kill_worker=1"

A rerun with the same --work reuses the model and adapters while their manifests match.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time

from bench.lib.header import RESULTS, base_header, card_slug
from bench.serve import model as serve_model, report as serve_report
from bench.serve import saturation as sat, scenarios as ss
from bench.serve.run import Bench

GPU_DEFAULTS = {"gpu_pool_bytes": "4GiB", "kv_cache_bytes": "40GiB", "max_running": 256,
                "max_batch_tokens": 4096, "host_pool_bytes": "8GiB", "store_host_bytes": "16GiB",
                "max_in_flight_per_worker": 256}
# --quick: a pool of 6 of the tiny model's rank-8 adapters (112 KiB each in fp32) and a host
# tier of 11, so that 16 adapters take loads from the worker's host tier, the store's host tier
# and the source
QUICK_DEFAULTS = {"gpu_pool_bytes": "768KiB", "host_pool_bytes": "1280KiB", "request_timeout": 60}
LOAD_DEFAULTS = {"requests": 500, "warmup": 32, "prompt": "128", "output": "128",
                 "request_timeout": 600.0}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--quick", action="store_true", help="CPU smoke run: tiny model, suite quick + engine")
    a("--model", help="an existing HF checkpoint (else one is written into --work)")
    a("--work", help="work directory: model, adapters, service logs (default: a temp dir)")
    a("--shape", choices=sorted(serve_model.SHAPES), help="model to write (7b on a GPU)")
    a("--device", default="auto", help="auto (cuda if present), cpu, cuda, cuda:N")
    a("--workers", type=int, default=1, help="worker processes behind the router (each on its "
      "own device with --devices or --device cuda and that many GPUs; else all on --device, "
      "each with 1/W of --gpu-pool-bytes, --kv-cache-bytes and --host-pool-bytes)")
    a("--devices", help="comma-separated, one per worker (e.g. cuda:0,cuda:1)")
    a("--adapters", default="auto", help="COUNTxRANK groups, e.g. 32x16,2000x8 (auto: what "
      "the scenarios need)")
    a("--targets", default="q_proj,k_proj,v_proj,o_proj")
    a("--adapter-dtype", choices=("bf16", "fp32"), default="bf16")
    a("--source", choices=("local", "s3"), default="local",
      help="adapters from a local dir or from S3 (moto's server on loopback)")
    a("--transfer", choices=("shm", "stream"), default=None,
      help="store -> worker: the store's shared-memory directory (--shm-dir under /dev/shm; "
      "the default where /dev/shm is writable) or a gRPC stream")
    a("--suite", default=None, help="comma-separated presets: slora, resident, cold, quick, "
      "engine (the in-process twin of the resident case), none (default slora,resident,cold); "
      "or saturation alone (goodput, closed loops, open-loop latency: bench/serve/saturation.py)")
    a("--scenarios", default="", help="';'-separated NAME:key=value,... with keys "
      + ", ".join(ss.KEYS))
    _load_flags(p)
    _service_flags(p)
    sat.add_flags(p)
    a("--out", default=str(RESULTS))
    a("--replot", help="only redraw NAME.md and the plots of a results NAME.json")
    a("--commit", help="the code's commit for the header, where the checkout's git cannot tell "
      "(a working tree copied to a GPU machine)")
    a("--name", help="results name (serve-h200 on an H200, serve-cpu on a CPU)")
    a("--trace-out", help="also write every gRPC scenario's requests here (JSON: per request "
      "the arrival offset, adapter, tenant, prompt and output tokens, the adapter's tier), "
      "the warm-up's before the measured ones, for python -m bench.capacity.sim replay")
    return p


def _load_flags(p) -> None:
    a = p.add_argument
    a("--rate", default="auto", help="open-loop req/s of the suites, or auto: 90%% of a "
      "closed-loop probe's req/s on the base model")
    a("--concurrency", type=int, default=64, help="closed-loop requests in flight (resident)")
    a("--burst-prompt", default="1024", help="the latency suite's prefill burst: prompt tokens "
      "of its 64 requests (N or LO:HI; 1024)")
    a("--probe-concurrency", type=int, default=64)
    a("--probe-requests", type=int, default=0, help="0: 4x the probe concurrency")
    a("--cold-rate", type=float, default=2.0, help="the cold suite's cold stream, req/s")
    a("--steady-rate", default=None, help="the cold suite's steady stream, req/s (--rate)")
    a("--cold-requests", type=int, default=32, help="most requests of a cold stream")
    a("--requests", type=int, help="measured requests per scenario (500; --quick 24)")
    a("--warmup", type=int, help="unmeasured requests first, same workload (32; --quick 4)")
    a("--prompt", help="prompt tokens: N or LO:HI (128; --quick 8:16)")
    a("--output", help="new tokens: N or LO:HI (128; --quick 4:8)")
    a("--tenants", type=int, default=16, help="adapter i's requests come from t{i %% tenants}")
    a("--seed", type=int, default=0)
    a("--clients", type=int, help="client processes (4 on a GPU box, 1 for --quick)")
    a("--request-timeout", type=float, help="seconds per request (600; --quick 60)")
    a("--start-timeout", type=float, default=900.0, help="seconds for a service to serve")


def _service_flags(p) -> None:
    a = p.add_argument
    for svc in ("store", "worker", "router"):
        a(f"--{svc}-flag", action="append", default=[], metavar="ARG",
          help=f"passed to the {svc} as is (repeatable; one argv token, e.g. "
          f"--{svc}-flag=--log-level=DEBUG)")
    for flag, what in (("gpu-pool-bytes", "worker"), ("kv-cache-bytes", "worker"),
                       ("max-running", "worker"), ("max-batch-tokens", "worker"),
                       ("max-prefill-with-decode", "worker"),
                       ("host-pool-bytes", "worker"), ("pool-slots", "worker"),
                       ("eviction", "worker (lru or cost: the GPU pool's order)"),
                       ("store-host-bytes", "store --host-cache-bytes"),
                       ("max-in-flight-per-worker", "router")):
        a(f"--{flag}", help=f"{what} (GPU runs: {GPU_DEFAULTS.get(flag.replace('-', '_'), '-')};"
          " else the service's default)")


def resolve(args) -> argparse.Namespace:
    """Fill in what depends on the machine and on --quick."""
    if args.quick:
        args.device, args.shape = "cpu", args.shape or "tiny"
        args.suite = args.suite or "quick,engine"
    if args.device == "auto":
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = args.device.startswith("cuda")
    if args.transfer is None:
        args.transfer = "shm" if os.access("/dev/shm", os.W_OK) else "stream"
    if args.workers < 1:
        raise SystemExit("--workers must be >= 1")
    args.shape = args.shape or ("7b" if gpu else "tiny")
    args.suite = args.suite if args.suite is not None else "slora,resident,cold"
    args.clients = args.clients or (1 if args.quick else 4 if gpu else 2)
    small = {"requests": 24, "warmup": 4, "prompt": "8:16", "output": "4:8"}
    for key, value in {**(GPU_DEFAULTS if gpu else {}), **(small if args.quick else {}),
                       **(QUICK_DEFAULTS if args.quick else {})}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key, value in LOAD_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.defaults = {"requests": args.requests, "warmup": args.warmup,
                     "prompt": ss.parse_range(args.prompt, "--prompt"),
                     "output": ss.parse_range(args.output, "--output"),
                     "rate": None, "concurrency": args.concurrency}
    return args


def build_scenarios(args) -> list[ss.Scenario]:
    names = [n for n in args.suite.split(",") if n.strip() and n.strip() != "none"]
    texts = [t for n in names if n != "engine" for t in ss.suite(n.strip(), args)]
    out = ss.parse_scenarios(";".join(texts + [args.scenarios]), args.defaults)
    if "engine" in names:
        out.append(ss.engine_twin(out, args))
    for s in out:
        if s.path == "engine" and s.rate == "auto":
            raise SystemExit(f"scenario {s.name}: path=engine runs before the rate probe "
                             "(give a rate or a concurrency)")
    for s in out:
        if s.kill_at and not s.kill_worker < args.workers >= 2:
            raise SystemExit(f"scenario {s.name}: kill_worker={s.kill_worker} needs --workers "
                             ">= 2 and an index below it")
    if not out:
        raise SystemExit("no scenarios: give --suite or --scenarios")
    return out


# ------------------------------------------------------------------------- model, adapters
def prepare(args, work: pathlib.Path, scenarios) -> tuple[pathlib.Path, dict, dict]:
    """(model dir, its config.json, the adapters' manifest)."""
    if args.model:
        model = pathlib.Path(args.model).resolve()
    else:
        model = serve_model.ensure_model(work, args.shape, args.seed)
    cfg = json.loads((model / "config.json").read_text())
    if args.adapters == "auto":
        groups = [(n, r) for r, n in sorted(ss.adapter_needs(scenarios).items())]
    else:
        groups = serve_model.parse_groups(args.adapters)
    have = {r: n for n, r in groups}
    for r, n in ss.adapter_needs(scenarios).items():
        if have.get(r, 0) < n:
            raise SystemExit(f"--adapters {args.adapters}: the scenarios need {n} of rank {r}")
    targets = [t for t in args.targets.split(",") if t]
    manifest = serve_model.ensure_adapters(work, cfg, groups, targets, args.adapter_dtype,
                                           args.seed)
    manifest["source"] = args.source
    return model, cfg, manifest


def link_twins(rows: list[dict], scenarios: list[ss.Scenario]) -> None:
    """A cold-stream scenario's ITL p99 without the stream (the scenario alike but for it), and
    an engine row's gRPC twin."""
    by_name = {s.name: s for s in scenarios}
    first = {}
    for r in rows:
        first.setdefault(r["scenario"], r)
    for r in rows:
        s = by_name[r["scenario"]]
        if s.cold_requests:
            twin = next((t for t in scenarios if t.path == "grpc" and not t.cold_requests and
                         dataclasses.replace(t, name=s.name, cold=s.cold, cold_n=s.cold_n,
                                             cold_adapters=s.cold_adapters,
                                             cold_arrival=s.cold_arrival, burst_at=s.burst_at
                                             if not t.burst else t.burst_at) == s),
                        None)
            if twin is not None:
                r["nocold_twin"], r["itl_p99_nocold_ms"] = twin.name, first[twin.name][
                    "itl_p99_ms"]
        if s.path == "engine" and s.twin in first:
            g = first[s.twin]
            r["engine_vs"] = {"scenario": g["scenario"], "out_tok_s": g["out_tok_s"]}


def header(args, model, cfg, manifest, scenarios, bench: Bench) -> dict:
    h = base_header(args.device, args.commit)
    h["model"] = {"shape": None if args.model else args.shape, "path": str(model),
                  "layers": cfg["num_hidden_layers"], "hidden": cfg["hidden_size"],
                  "vocab": cfg["vocab_size"], "dtype": cfg.get("torch_dtype")}
    h["adapters"] = {k: v for k, v in manifest.items() if k != "ids"}
    h["adapters"]["first_last"] = {r: [v[0], v[-1]] for r, v in manifest["ids"].items() if v}
    h["clients"] = args.clients
    h["transfer"] = args.transfer
    h["scenarios"] = [_scenario_fields(s) for s in scenarios]
    h.update(bench.header)
    return h


def _scenario_fields(s: ss.Scenario) -> dict:
    """The scenario as the header lists it (the kill keys only where a scenario kills)."""
    return {k: v for k, v in dataclasses.asdict(s).items()
            if k not in ("kill_at", "kill_worker", "restart_after", "after_rejoin") or s.kill_at}


def run(args) -> pathlib.Path:
    """Prepare, run every scenario, write the results; returns the markdown's path."""
    scenarios = build_scenarios(args)
    print("scenarios: " + "; ".join(s.name for s in scenarios), flush=True)
    tmp = None if args.work else tempfile.mkdtemp(prefix="serve-bench-")
    work = pathlib.Path(args.work or tmp).resolve()
    model, cfg, manifest = prepare(args, work, scenarios)
    bench = Bench(args, model, cfg, manifest)
    try:
        scenarios = execute(bench, scenarios, work)
    except BaseException:
        print(f"failed; the work dir {work} (service logs in logs/) is kept", flush=True)
        raise
    order = {s.name: i for i, s in enumerate(scenarios)}
    bench.rows.sort(key=lambda r: order[r["scenario"]])
    link_twins(bench.rows, scenarios)
    h = header(args, model, cfg, manifest, scenarios, bench)
    name = args.name or ("serve-h200" if "H200" in h["card"] else
                         "serve-gpu" if args.device.startswith("cuda") else "serve-cpu")
    out = pathlib.Path(args.out)
    for p in serve_report.write(out, name, h, bench.rows, bench.cdfs):
        print(f"wrote {p}", flush=True)
    if args.trace_out:
        trace = {"header": h, "scenarios": bench.traces}
        pathlib.Path(args.trace_out).write_text(json.dumps(trace, indent=None, default=str))
        print(f"wrote {args.trace_out}", flush=True)
    (out / "partial-rows.json").unlink(missing_ok=True)
    if tmp:                  # a temp work dir is not reused: drop the model and adapters
        for part in work.iterdir():
            if part.name != "logs":
                shutil.rmtree(part, ignore_errors=True)
        print(f"service logs kept in {work / 'logs'}", flush=True)
    return out / f"{name}.md"


def execute(bench: Bench, scenarios: list[ss.Scenario], work: pathlib.Path) -> list:
    """The engine in-process first (it needs the memory the worker will take), then the
    services, the rate probe if a scenario asks for it, and the gRPC scenarios in order.
    Returns the scenarios with rate auto replaced by the probe's rate."""
    engine = [s for s in scenarios if s.path == "engine"]
    if engine:
        bench.run_engine(engine)
    try:
        bench.start_services(work)
        if any(s.rate == "auto" for s in scenarios):
            rate = bench.probe()
            saturation = bench.header["probe"]["req_s"]
            scenarios = [dataclasses.replace(s, rate=round(s.rate_frac * saturation, 3)
                                             if s.rate_frac else rate)
                         if s.rate == "auto" else s for s in scenarios]
        for s in scenarios:
            if s.path == "grpc":
                bench.run_grpc(s)
                bench.save_partial()
    finally:
        bench.stop()
    return scenarios


def run_saturation(args) -> int:
    """--suite saturation (serve/saturation.py): prepare, start the stack, run the suite, write
    the results."""
    from bench.serve import saturation_report
    from bench.serve.saturation_suite import Suite
    t0 = time.monotonic()
    sat.defaults(args)
    args = resolve(args)
    tmp = None if args.work else tempfile.mkdtemp(prefix="serve-sat-")
    work = pathlib.Path(args.work or tmp).resolve()
    workloads, shrunk = sat.fit_disk(args, sat.parse_workloads(args.sat_workloads), work)
    scenarios = sat.all_scenarios(workloads)
    model, cfg, manifest = prepare(args, work, scenarios)
    bench = Bench(args, model, cfg, manifest)
    suite = Suite(bench, args, workloads, sat.cold_list(args, workloads),
                  sat.open_list(args, workloads), t0)
    try:
        bench.start_services(work)
        suite.run()
    except BaseException:
        print(f"failed; the work dir {work} (service logs in logs/) is kept", flush=True)
        raise
    finally:
        bench.stop()
    h = header(args, model, cfg, manifest, scenarios, bench)
    h.update(suite.header(), disk=shrunk or None, scenarios=[
        {"workload": w.name, "kind": w.kind, "adapters": w.adapters, "ranks": list(w.ranks),
         "zipf": 0.0 if w.kind == "resident" else w.zipf} for w in workloads])
    name = args.name or f"saturation-{card_slug(h['card'], args.device)}"
    for p in saturation_report.write(pathlib.Path(args.out), name, h, suite.rows):
        print(f"wrote {p}", flush=True)
    if tmp:
        for part in work.iterdir():
            if part.name != "logs":
                shutil.rmtree(part, ignore_errors=True)
    print((pathlib.Path(args.out) / f"{name}.md").read_text(), flush=True)
    return 0


def replot(path: pathlib.Path) -> int:
    doc = json.loads(path.read_text())
    path.with_suffix(".md").write_text(serve_report.markdown(doc["header"], doc["rows"]))
    for p in serve_report.plots(path.parent, path.stem, doc["header"], doc["rows"],
                                doc.get("cdfs", {})):
        print(f"wrote {p}", flush=True)
    return 0


def main(argv=None) -> int:
    parsed = parser().parse_args(argv)
    if parsed.replot:
        return replot(pathlib.Path(parsed.replot))
    if parsed.suite == "saturation":
        return run_saturation(parsed)
    args = resolve(parsed)
    md = run(args)
    print(md.read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
