"""How a worker starts: start to SERVING on an empty and on a warm kernel cache, what it compiles
or captures once serving, and whether a workload's first run after start is as fast as its
second.

Through the real services (bench.serve.bench's stack, model and adapters): the store and a worker
with `--kernel-cache` pointing at a new, empty directory, then the router; the measured
scenario (--measure, closed loop, no warm-up requests) twice in a row; the varied workload
(--varied: the base model, and adapters of ranks 8, 16 and 64 with prompts of 1 to 2,048
tokens, mixed with base rows); the worker's /metrics read for the kernel specializations and
graph captures counted while serving; the stack stopped, and started again on the same
kernel cache. Results: OUT/NAME.json, {"cold_start_s", "warm_start_s",
"compiles_after_serving", "captures_after_serving", "first_run_tok_s", "second_run_tok_s"}
with a header and the runs' rows, and OUT/NAME.md.

    python -m bench.stack.startup --quick --out /tmp/startup        # CPU, tiny model
    python -m bench.stack.startup --shape 7b --device cuda --work /data/serve-work \\
        --out bench/results --name startup-h200
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import sys
import time
import urllib.request

from bench.lib.header import ROOT, base_header
from bench.serve import bench as serve_bench, scenarios as ss
from bench.serve.run import Bench
from bench.serve.stack import free_port

MEASURE = "startup-32:adapters=32,rank=16,zipf=0,concurrency=64,requests=640,warmup=0,preload=1"
VARIED = ("varied-base:adapters=0,concurrency=64,requests=128,warmup=0,prompt=1:2048;"
          "varied-r8:adapters=64,rank=8,zipf=1.0,concurrency=64,requests=128,warmup=0,"
          "prompt=1:2048;"
          "varied-r16:adapters=32,rank=16,zipf=1.0,concurrency=32,requests=96,warmup=0,"
          "prompt=1:1024;"
          "varied-r64:adapters=4,rank=64,zipf=0,concurrency=16,requests=48,warmup=0,"
          "prompt=1:2048")
QUICK_MEASURE = ("startup-2:adapters=2,rank=8,zipf=0,concurrency=4,requests=24,warmup=0,"
                 "preload=1,prompt=8:16,output=4:8")
QUICK_VARIED = ("varied-base:adapters=0,concurrency=4,requests=12,warmup=0,prompt=1:64,"
                "output=4:8;varied-r8:adapters=4,rank=8,zipf=1.0,concurrency=4,requests=12,"
                "warmup=0,prompt=1:64,output=4:8")


def parser():
    p = serve_bench.parser()
    p.add_argument("--measure", help=f"the scenario run twice after start ({MEASURE})")
    p.add_argument("--varied", help="the scenarios run after it, to meet what a served "
                                    "workload meets (ranks 8/16/64, prompts 1-2,048, base)")
    return p


def counter(port: int, name: str, phase: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(rf'^{name}{{phase="{phase}"}} ([0-9.e+]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def late_compiles(log: pathlib.Path) -> list[str]:
    """What the worker said it first needed while serving (its log's warnings: the kernel and
    its specialization), so a run that counts some also says which."""
    mark = "kernel specialization first needed while serving: "
    return [line.split(mark, 1)[1] for line in log.read_text(errors="replace").splitlines()
            if mark in line]


def start(bench: Bench, work: pathlib.Path, kcache: pathlib.Path, metrics: int) -> float:
    """Start the stack with the worker on `kcache`; the worker's seconds from start to SERVING."""
    bench.args.worker_flag = [f for f in bench.base_flags] + [f"--kernel-cache={kcache}",
                                                             f"--metrics-port={metrics}"]
    bench.start_services(work)
    seconds = bench.stack.worker.serving_s
    print(f"worker: SERVING {seconds:.1f}s after start (kernel cache {kcache})", flush=True)
    return seconds


def main(argv=None) -> int:
    args = serve_bench.resolve(parser().parse_args(argv))
    quick = args.quick
    measure = ss.parse_scenarios(args.measure or (QUICK_MEASURE if quick else MEASURE),
                                 args.defaults)
    varied = ss.parse_scenarios(args.varied or (QUICK_VARIED if quick else VARIED),
                                args.defaults)
    if len(measure) != 1:
        raise SystemExit("--measure: one scenario")
    scenarios = measure + varied
    work = pathlib.Path(args.work or (ROOT / "tmp" / "startup-work")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model, cfg, manifest = serve_bench.prepare(args, work, scenarios)
    bench = Bench(args, model, cfg, manifest)
    bench.base_flags = list(args.worker_flag)
    kcache = work / f"kernel-cache-{time.strftime('%Y%m%d-%H%M%S')}"
    metrics = free_port()
    result: dict = {}
    try:
        result["cold_start_s"] = round(start(bench, work, kcache, metrics), 2)
        first = measure[0]
        again = dataclasses.replace(first, name=first.name + "-again")
        bench.run_grpc(first)
        bench.run_grpc(again)
        for s in varied:
            bench.run_grpc(s)
        result["compiles_after_serving"] = int(counter(
            metrics, "lorafleet_worker_kernel_compiles_total", "serving"))
        result["captures_after_serving"] = int(counter(
            metrics, "lorafleet_worker_graph_captures_total", "serving"))
        result["compiles_at_start"] = int(counter(
            metrics, "lorafleet_worker_kernel_compiles_total", "start"))
        result["late_compiles"] = late_compiles(bench.stack.worker.log_path)
        bench.stop()
        result["warm_start_s"] = round(start(bench, work, kcache, free_port()), 2)
    finally:
        bench.stop()
    rows = {r["scenario"]: r for r in bench.rows}
    result["first_run_tok_s"] = rows[first.name]["out_tok_s"]
    result["second_run_tok_s"] = rows[again.name]["out_tok_s"]
    header = base_header(args.device, args.commit)
    header.update(model={"shape": None if args.model else args.shape, "path": str(model),
                         "layers": cfg["num_hidden_layers"], "hidden": cfg["hidden_size"]},
                  worker_flags=bench.base_flags, kernel_cache=str(kcache),
                  scenarios=[s.name for s in [first, again] + varied])
    doc = {"header": header, **result, "rows": bench.rows}
    name = args.name or ("startup-h200" if "H200" in header["card"] else
                         "startup-gpu" if args.device.startswith("cuda") else "startup-cpu")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(header, result, bench.rows))
    print((out / f"{name}.md").read_text(), flush=True)
    return 0


def markdown(header: dict, result: dict, rows: list[dict]) -> str:
    lines = [f"# Worker start-up, {header['card']}, {header['date']}", "",
             f"Commit {header['commit']}; " + ", ".join(f"{k} {v}" for k, v in
                                                       header["versions"].items()) + ".", "",
             "| start to SERVING, empty kernel cache | warm kernel cache | compiles / captures "
             "after SERVING | first run / second run tok/s |", "|---|---|---|---|",
             f"| {result['cold_start_s']} s | {result['warm_start_s']} s | "
             f"{result['compiles_after_serving']} / {result['captures_after_serving']} | "
             f"{result['first_run_tok_s']:.0f} / {result['second_run_tok_s']:.0f} |", "",
             "| scenario | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | errors |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['out_tok_s']:.0f} | {r['ttft_p50_ms']} / "
                     f"{r['ttft_p99_ms']} | {r['itl_p50_ms']} / {r['itl_p99_ms']} | "
                     f"{r['errors'] or 0} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
