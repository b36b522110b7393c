"""Where the time of a CUDA graph goes, kernel by kernel: each replay is profiled (CUPTI records
the kernels a graph launches), and every kernel is charged the time from the end of the kernel
before it to its own end ("increment"). Under programmatic dependent launch a kernel starts
before its predecessor ends, so its duration overstates its cost; the increments add up to the
replay's span.

    python bench/timeline.py sgmv --shapes 64:64:8,16:64:32 [--chain 8] \
        [--configs "base;k_chunk=512"]
    python bench/timeline.py decode --layers 4 --batch 64 --distinct 32
    python bench/timeline.py mixed --layers 4 --decode 64 --chunk 128 --distinct 32 [--path eager]

Prints, per kernel name: calls per replay, mean duration and mean increment (µs), and their sum.

`step` runs decode steps of the same engine inside an NVTX range named "step", for Nsight
Compute to profile each kernel of the replayed graph (boost clocks kept):

    ncu --nvtx --nvtx-include "step/" --graph-profiling node --clock-control none \
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
dram__bytes_read.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,\
launch__registers_per_thread,launch__grid_size,launch__occupancy_limit_registers,\
launch__occupancy_limit_shared_mem,sm__warps_active.avg.pct_of_peak_sustained_active,\
smsp__issue_active.avg.pct_of_peak_sustained_active --csv \
        python bench/timeline.py step --layers 2 > ncu-step.csv

(bench/results/ab/ncu-decode-step-h200.csv was made so.)
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MARK = "spin_kernel"            # torch.cuda._sleep's kernel: separates the replays


def _short(name: str) -> str:
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    return name[:56]


def profile_replays(replay, reps: int = 20, flush_mib: int = 512) -> list[list[tuple]]:
    """Kernels of `reps` calls of replay(), L2 flushed before each: one list of
    (name, start_us, end_us) per call, sorted by start."""
    flush = torch.empty(flush_mib << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            torch.cuda._sleep(2000)
            replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    return split_replays(sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                                if e.get("cat") == "kernel"))


def split_replays(kernels: list[tuple]) -> list[list[tuple]]:
    """(start, end, name) kernels sorted by start, of calls each preceded by an L2 flush (a
    fill kernel) and the MARK kernel -> one list of (name, start, end) per call."""
    groups, cur = [], None
    for start, end, name in kernels:
        if MARK in name:
            cur = []
            groups.append(cur)
        elif cur is not None:
            cur.append((name, start, end))
    for g in groups[:-1]:                  # the next call's flush ends each group but the last
        if g and "Fill" in g[-1][0]:
            g.pop()
    return [g for g in groups if g]


def summarize(groups: list[list[tuple]], per: int = 1) -> tuple[list[dict], float]:
    """Per kernel name: calls, duration and increment, means per replay divided by `per`, most
    costly first; and the median span of a replay divided by `per`."""
    acc = collections.defaultdict(lambda: [0, 0.0, 0.0])
    spans = []
    for g in groups:
        prev_end = g[0][1]
        for name, start, end in g:
            a = acc[_short(name)]
            a[0] += 1
            a[1] += end - start
            a[2] += max(0.0, end - prev_end)     # the gap before it counts as its cost
            prev_end = max(prev_end, end)
        spans.append(max(end for _, _, end in g) - g[0][1])
    n = len(groups) * per
    rows = [dict(kernel=k, calls=c / n, dur_us=d / n, incr_us=i / n)
            for k, (c, d, i) in acc.items()]
    rows.sort(key=lambda r: -r["incr_us"])
    spans.sort()
    return rows, spans[len(spans) // 2] / per


def print_rows(title: str, rows: list[dict], span: float) -> None:
    print(f"--- {title}: span {span:.2f} us (median), increments sum "
          f"{sum(r['incr_us'] for r in rows):.2f}")
    for r in rows:
        print(f"  {r['kernel']:<56} {r['calls']:5.2f}  dur {r['dur_us']:7.2f}  "
              f"incr {r['incr_us']:7.2f}")


def sgmv_main(a) -> None:
    from kernels import sgmv_split
    from bench.kernel_bench import (TOL, capture_graph, impl_fn, load_vllm, make_problem,
                                    make_weights, reference)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    for shape in a.shapes.split(","):
        rank, t, n = (int(v) for v in shape.split(":"))
        weights = [make_weights(4096, rank, torch.bfloat16, dev, gen) for _ in range(a.chain)]
        probs = [make_problem(w, 4096, rank, t, n, torch.bfloat16, dev, gen) for w in weights]
        runs = [(impl, "") for impl in a.impls.split(",") if impl]
        vllm = None
        if any(impl.startswith("vllm") for impl, _ in runs):
            vllm = load_vllm(a.vllm_src)
            if isinstance(vllm, str):
                raise SystemExit(f"vLLM's kernels: {vllm}")
        runs += [("ours_split", cfg) for cfg in a.configs.split(";") if a.configs]
        ref = reference(probs[0])
        for impl, cfg in runs:
            sgmv_split.set_overrides("" if cfg == "base" else cfg)
            y = probs[0]["y0"].clone()
            impl_fn(impl, probs[0], y, vllm)()
            err = ((y.float() - ref).abs() / (1 + ref.abs())).max().item()
            ys = [p["y0"].clone() for p in probs]
            fns = [impl_fn(impl, p, y, vllm) for p, y in zip(probs, ys)]
            for f in fns:
                f()
            graph = capture_graph(fns)
            rows, span = summarize(profile_replays(graph.replay, a.reps), per=a.chain)
            ok = "ok" if err <= TOL else "WRONG"
            print_rows(f"r{rank} T{t} n{n} {impl} {cfg} ({ok}, err {err:.1e}), per call of a "
                       f"chain of {a.chain}", rows, span)
            del graph
        sgmv_split.set_overrides(os.environ.get("LORAFLEET_SGMV_SPLIT", ""))
        del weights, probs
        torch.cuda.empty_cache()


def build_engine(layers: int, distinct: int, cuda_graphs: bool,
                 graph_max_rank: int | None = None, device: str = "cuda",
                 max_model_len: int = 1024, max_batch_tokens: int = 8192,
                 kv_cache_bytes: int = 4 << 30, **options):
    """The Llama-7B-shaped engine (random bf16 weights, `layers` layers) with `distinct` rank-16
    q/k/v/o adapters placed in its pool: (built, their slots). options: more EngineOptions."""
    from bench.e2e_gpu_bench import (_NullTokenizer, adapter_tensors, llama7b_spec,
                                     random_weights)
    from services.worker.adapters.layout import staged_from_tensors
    from services.worker.config import EngineOptions
    from services.worker.perf_config import PerfConfig
    from services.worker.startup.factory import assemble
    dev = torch.device(device)
    spec = llama7b_spec(layers)
    extra = {} if graph_max_rank is None else {"graph_max_rank": graph_max_rank}
    opts = EngineOptions(device=device, dtype="bfloat16", kv_cache_bytes=kv_cache_bytes,
                         max_batch_tokens=max_batch_tokens, max_running=128, pool_bytes=2 << 30,
                         pool_slots=64, max_model_len=max_model_len, cuda_graphs=cuda_graphs,
                         perf=PerfConfig.from_env(os.environ), **extra, **options)
    built = assemble(spec, random_weights(spec, dev, torch.bfloat16), _NullTokenizer(), opts,
                     dev, torch.bfloat16)
    slots = [built.pool.place(f"a{i}", staged_from_tensors(
                 adapter_tensors(spec, 16, i + 1, dev), {"r": 16, "lora_alpha": 32}, spec))
             for i in range(distinct)]
    return built, slots


def decode_engine(layers: int, batch: int, distinct: int, cuda_graphs: bool,
                  graph_max_rank: int | None = None, max_new: int = 400, device: str = "cuda",
                  prompt: int = 128):
    """build_engine's engine with `batch` requests of `prompt` tokens spread over its
    `distinct` adapters (0: base only), prefilled and a few decode steps in."""
    from services.worker.engine.sequence import Sequence, Stopping
    built, slots = build_engine(layers, distinct, cuda_graphs, graph_max_rank, device)
    eng = built.engine
    for i in range(batch):
        slot = slots[i % len(slots)] if slots else -1
        eng.submit(Sequence(f"r{i}", list(range(3, 3 + prompt)), slot=slot,
                            stopping=Stopping(max_new_tokens=max_new, ignore_eos=True)),
                   lambda e: 0)
    for _ in range(8):                                      # prefill, graph capture, warm steps
        eng.step()
    return eng


def decode_main(a) -> None:
    eng = decode_engine(a.layers, a.batch, a.distinct, True, a.grank)
    rows, span = summarize(profile_replays(eng.step, a.reps), per=a.layers)
    print_rows(f"decode, batch {a.batch}, {a.distinct} adapters, graphs up to rank "
               f"{a.grank or 'default'}, "
               f"SGMV {os.environ.get('LORAFLEET_SGMV_SPLIT', '')!r}, per layer of {a.layers}",
               rows, span)


def mixed_main(a) -> None:
    """A mixed step (decode rows beside one prompt chunk), replayed from its graph or run
    eagerly, kernel by kernel."""
    from bench.mixed_step_bench import kv_bytes, mixed_batch
    built, slots = build_engine(a.layers, a.distinct, True, a.grank,
                                max_model_len=max(a.context, a.chunk) + 64,
                                max_batch_tokens=max(a.decode + a.chunk, 256),
                                kv_cache_bytes=kv_bytes(a.layers, a.decode * (a.context + 32)
                                                        + a.chunk + 256))
    graphs = built.engine.runner
    batch = mixed_batch(built, slots, a.decode, a.context, a.chunk)
    run = graphs.run if a.path == "graph" else graphs.runner.run
    rows, span = summarize(profile_replays(lambda: run(batch), a.reps), per=a.layers)
    print_rows(f"mixed, {a.decode} decode rows at {a.context} tokens beside a {a.chunk}-token "
               f"chunk, {a.distinct} adapters, {a.path}, per layer of {a.layers}", rows, span)


def step_main(a) -> None:
    eng = decode_engine(a.layers, a.batch, a.distinct, True, a.grank)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("step")
    for _ in range(a.steps):
        eng.step()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sgmv")
    s.add_argument("--shapes", default="16:64:8,16:64:32,64:64:8,64:256:32")
    s.add_argument("--impls", default="ours", help="kernel_bench impls (ours, vllm, loop, ...)")
    s.add_argument("--vllm-src", default=".peers/vllm_lora_ops", help="for the vllm impls")
    s.add_argument("--configs", default="", help="';'-separated LORAFLEET_SGMV_SPLIT values "
                   "run through sgmv_split ('base': none), e.g. 'base;k_chunk=512;progs_per_sm=2'")
    s.add_argument("--chain", type=int, default=8)
    s.add_argument("--reps", type=int, default=20)
    d = sub.add_parser("decode")
    d.add_argument("--layers", type=int, default=4)
    d.add_argument("--batch", type=int, default=64)
    d.add_argument("--distinct", type=int, default=32)
    d.add_argument("--reps", type=int, default=10)
    d.add_argument("--grank", type=int, default=None,
                   help="the largest rank the graphs serve (default: the worker's)")
    m = sub.add_parser("mixed", help="a mixed step: decode rows beside one prompt chunk")
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--decode", type=int, default=64)
    m.add_argument("--context", type=int, default=256)
    m.add_argument("--chunk", type=int, default=128)
    m.add_argument("--distinct", type=int, default=32)
    m.add_argument("--path", choices=("graph", "eager"), default="graph")
    m.add_argument("--reps", type=int, default=10)
    m.add_argument("--grank", type=int, default=16)
    st = sub.add_parser("step", help="decode steps in an NVTX range 'step' (for ncu)")
    st.add_argument("--layers", type=int, default=2)
    st.add_argument("--batch", type=int, default=64)
    st.add_argument("--distinct", type=int, default=32)
    st.add_argument("--steps", type=int, default=1)
    st.add_argument("--grank", type=int, default=None)
    a = p.parse_args()
    with torch.inference_mode():
        {"sgmv": sgmv_main, "decode": decode_main, "mixed": mixed_main,
         "step": step_main}[a.cmd](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
