"""Host (Python) cost of a CUDA-graph decode step, measured on this CPU without the model forward.

    python -m bench.engine.host_overhead [--model models/tiny-llama] [--batch 32 64 128]
                                        [--forward model stub] [--out bench/results]
                                        [--baseline OLD.json] [--profile]
    python -m bench.engine.host_overhead --device cuda --out /tmp/x      # real graphs, on a GPU

On a GPU a graph decode step is: schedule, order the rows, fill the graph's static input buffers
(StaticInputs.fill: services.worker.executor.step_inputs.StepBuilder.fill), replay the graph, build
the sampling parameters (sampling_inputs.sampling_batch) and sample (sampling.sample), both from
graph_inputs.start_sampling, copy the tokens back (graph_inputs.collect: tolist), then
per row the stop checks, incremental detokenization and the sink callback (Engine._append).
Everything but the replay is host work that the GPU waits for. This bench runs that very path on the CPU: a real engine is
built from the tiny model (its byte-level BPE tokenizer, so detokenization is real work) with the
three demo adapters placed, and wrapped in a GraphRunner whose "graphs" are stand-ins replayed on
its static buffers, timing themselves. A step's host time is its wall time minus that replay.
Two kinds of stand-in (--forward):

- model: the tiny model's forward, run eagerly. Between two steps the forward sweeps the CPU's
  caches, so the host code runs cache-cold: a pessimistic figure.
- stub: logits that make the next token a fixed pseudo-random function of (token, position),
  no model. The caches stay warm, as on a GPU host that only waits for the device; the text
  is of arbitrary tokens (partial UTF-8 characters included).

Reported per stand-in, batch (32/64/128 sequences, rows spread over base + 3 adapters) and
sampling mode (greedy; sampled: temperature/top-k/top-p with seeds; greedy + two stop sequences
that never match), the median over the full-batch decode steps of the best of --repeats runs:

- host: step wall time minus the replay, in microseconds;
- sample: the sample() call; on the CPU this is the sampling math itself (on a GPU it is a few
  kernel launches), so host - sample is the part that stays host work on any device;
- the phases: schedule, fill (StaticInputs.fill), sampling_batch, other run (decode checks,
  the step plan: row order, slots and LoRA choices; tolist) and post (num_computed updates,
  Engine._append for every row, inbox/expiry).

A second part times StaticInputs.fill alone on synthetic decode batches (context ~200 tokens,
rows on the base model only, on 8 adapters, or each on its own adapter): best of 5 rounds of
300 calls.

With --device cuda the engine runs the tiny model on the GPU with real captured graphs (one per
batch size, as services.worker.startup.factory captures them) and a step's host time is its wall
time minus the graph's device time (CUDA events around the replay): the serial host overhead of the
step, as bench/engine/e2e.py reports it (decode step ms vs graph replay ms).

With --baseline, the host figures of an earlier run (its JSON) are shown beside the new ones.
On a shared machine, alternate runs of the two versions and combine each side's JSONs (--merge
for the new side, several --baseline files for the old): each case keeps its fastest run.
The engine runs without overlap (each step waited for, GraphRunner.run: launch then collect), so
that a step's phases are its own. Writes OUT/host-overhead-cpu.json and OUT/host-overhead-cpu.md (host-overhead-cuda.* on a GPU).
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import pathlib
import platform
import pstats
import statistics
import sys
import time

import numpy as np
import torch

import services.worker.executor.graph_inputs as graph_inputs_mod
from bench.lib.header import RESULTS, ROOT
from services.worker.adapters.layout import staged_from_peft_dir
from services.worker.engine.scheduler import Scheduled
from services.worker.engine.sequence import Sampling, Sequence, Stopping
from services.worker.executor.graph_runner import GraphRunner
from services.worker.executor.step_inputs import StepPlan
from services.worker.perf_config import PerfConfig
from services.worker.config import EngineOptions
from services.worker.startup.factory import build_engine

ADAPTERS = ("acme-support", "pirate", "poet")
PROMPTS = ("Tell me about the weather.", "Can you help me?", "Hello!", "How are you?",
           "Tell me a story.", "What is your favourite food?", "What should I do today?",
           "Where should I go this weekend?")
MODES = {
    "greedy": lambda i: (Sampling(), ()),
    "sampled": lambda i: (Sampling(temperature=0.8, top_k=50, top_p=0.9, seed=1000 + i), ()),
    "greedy+stops": lambda i: (Sampling(), ("<never-1>", "\n\n\n\n")),
}
FORWARDS = ("model", "stub")          # CPU stand-ins; on a GPU the forward is "graph"
PHASES = ("schedule", "fill", "sampling_batch", "sample", "run_other", "post")


class Clock:
    """Nanoseconds spent per phase during the current step."""

    def __init__(self):
        self.ns: dict[str, int] = {}
        self.profiler: cProfile.Profile | None = None     # paused around the replay

    def reset(self) -> None:
        self.ns = dict.fromkeys(("forward", *PHASES, "run"), 0)

    def timed(self, name: str, fn):
        """fn wrapped so that its calls add to phase `name`."""
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns[name] += time.perf_counter_ns() - t0
        return wrapper


class CpuGraph:
    """Stands in for a captured decode graph on the CPU: replay() writes the logits of the rows
    in the GraphRunner's static buffers into its static output (with the model, or with the stub
    rule), and adds its time to `forward`. key: the runner's graph key, a batch size or
    (batch size, LoRA group mask, rank tile)."""

    def __init__(self, runner: GraphRunner, key, clock: Clock, stub: bool):
        self.runner, self.key, self.clock, self.stub = runner, key, clock, stub
        self.b = key[0] if isinstance(key, tuple) else key
        self.ctx_args = key if isinstance(key, tuple) else (key,)

    def replay(self) -> None:
        prof = self.clock.profiler
        if prof is not None:
            prof.disable()
        t0 = time.perf_counter_ns()
        r, b, out = self.runner, self.b, self.runner.outputs[self.key]
        with torch.inference_mode():
            if self.stub:           # next token: a function of (token, position), not special
                nxt = (r.ids[:b] * 31 + r.pos[:b] * 17 + 7) % (out.shape[1] - 4) + 4
                out.zero_().scatter_(1, nxt[:, None], 8.0)
            else:
                out.copy_(r.model.forward(r.ids[:b], r._ctx(*self.ctx_args), r.runner.kv_cache))
        self.clock.ns["forward"] += time.perf_counter_ns() - t0
        if prof is not None:
            prof.enable()


class StandIns(dict):
    """GraphRunner.graphs / .outputs on the CPU: every key is "captured", its value made on first
    use (so the bench follows however the runner keys its graphs)."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __contains__(self, key) -> bool:
        return True

    def __missing__(self, key):
        value = self[key] = self.make(key)
        return value


def build(model_dir: pathlib.Path, batch: int, prompt_len: int, new: int, clock: Clock,
          forward: str = "model"):
    """An engine with the demo adapters placed, its runner a GraphRunner for `batch` rows: on
    the CPU over stand-in graphs, with forward "graph" on the GPU over captured ones; returns
    (built, graph runner, adapter slots)."""
    cuda = forward == "graph"
    opts = EngineOptions(device="cuda" if cuda else "cpu", dtype="auto" if cuda else "float32",
                         kv_cache_bytes=64 << 20, block_size=16,
                         max_batch_tokens=max(1024, batch * prompt_len), max_running=batch,
                         pool_bytes=64 << 20, pool_slots=8, max_model_len=prompt_len + new + 16,
                         cuda_graphs=False, perf=PerfConfig.from_env(os.environ),
                         overlap=False)   # serial steps: each one waited for (GraphRunner.run)
    built = build_engine(model_dir, opts)
    adapters = model_dir.parent / "adapters"
    slots = [built.pool.place(n, staged_from_peft_dir(adapters / n, built.spec))
             for n in ADAPTERS if (adapters / n).exists()]
    gr = GraphRunner(built.engine.runner, sizes=(batch,))
    if cuda:                  # as services.worker.startup.factory does it, for one batch size
        gr.capture(64)
        gr.timings = []
        built.engine.runner = gr
        return built, gr, slots
    gr.rank = 64                       # what capture() would set: graphs serve ranks <= 64
    gr.start_tiles = (16, 64)
    gr.captured = set(gr.sizes)        # (where the runner tracks captured sizes)
    vocab = built.spec.vocab_size
    gr.outputs = StandIns(lambda key: torch.zeros(batch, vocab, dtype=torch.float32))
    gr.graphs = StandIns(lambda key: CpuGraph(gr, key, clock, forward == "stub"))
    built.engine.runner = gr
    return built, gr, slots


def instrument(built, gr: GraphRunner, clock: Clock):
    """Wrap the step's phases with timers; returns an undo function."""
    engine = built.engine
    engine.scheduler.schedule = clock.timed("schedule", engine.scheduler.schedule)
    gr.inputs.fill = clock.timed("fill", gr.inputs.fill)
    gr.run = clock.timed("run", gr.run)
    # a graph step samples in graph_inputs (start_sampling / finish_sampling): the names as they
    # look them up there
    saved = graph_inputs_mod.sampling_batch, graph_inputs_mod.sample
    graph_inputs_mod.sampling_batch = clock.timed("sampling_batch", saved[0])
    graph_inputs_mod.sample = clock.timed("sample", saved[1])

    def undo():
        graph_inputs_mod.sampling_batch, graph_inputs_mod.sample = saved
    return undo


def run_once(model_dir: pathlib.Path, forward: str, batch: int, mode: str, steps: int,
             warm: int, profile: bool = False) -> dict:
    """One engine run: prefill, then `warm` + `steps` full-batch decode steps, timed. With
    profile, the timed steps run under cProfile (the replay left out) and the result holds the
    top functions instead of trustworthy timings."""
    clock = Clock()
    clock.reset()
    built, gr, slots = build(model_dir, batch, 16, warm + steps + 2, clock, forward)
    engine, sched, tok = built.engine, built.engine.scheduler, built.tokenizer
    events = []
    choices = [-1, *slots]
    for i in range(batch):
        sampling, stops = MODES[mode](i)
        prompt = tok.encode(PROMPTS[i % len(PROMPTS)]).ids
        engine.submit(Sequence(f"r{i}", prompt, slot=choices[i % len(choices)],
                               sampling=sampling,
                               stopping=Stopping(max_new_tokens=warm + steps + 2,
                                                 stop_sequences=stops, ignore_eos=True)),
                      events.append)
    undo = instrument(built, gr, clock)
    rows, prof, n_decode = [], None, 0
    try:
        while True:
            full = (not sched.waiting and len(sched.running) == batch
                    and all(s.is_decoding for s in sched.running))
            if not full and n_decode:
                break
            clock.reset()
            replays = gr.replays
            if full and profile and n_decode == warm:
                prof = clock.profiler = cProfile.Profile()
            profiling = prof is not None and len(rows) < steps
            t0 = time.perf_counter_ns()
            if profiling:
                prof.enable()
            if not engine.step():
                break
            wall = time.perf_counter_ns() - t0
            if profiling:
                prof.disable()
            if not full:
                continue
            if gr.timings:                  # on a GPU: the graph's device time (tolist synced)
                start, end = gr.timings[-1][-2:]
                clock.ns["forward"] = int(start.elapsed_time(end) * 1e6)
            assert gr.replays == replays + 1, "a full decode step did not take the graph path"
            n_decode += 1
            if n_decode <= warm or len(rows) == steps:
                continue
            ns = clock.ns
            row = {"host": wall - ns["forward"], "forward": ns["forward"]}
            row.update({p: ns[p] for p in ("schedule", "fill", "sampling_batch", "sample")})
            row["run_other"] = ns["run"] - ns["forward"] - ns["fill"] - ns["sampling_batch"] \
                - ns["sample"]
            row["post"] = wall - ns["run"] - ns["schedule"]
            rows.append(row)
    finally:
        undo()
    med = {k: statistics.median(r[k] for r in rows) / 1e3 for k in rows[0]}
    med["host_minus_sample"] = statistics.median((r["host"] - r["sample"]) for r in rows) / 1e3
    text = sum(len(e.text) for e in events)
    return {"steps": len(rows), "us": {k: round(v, 1) for k, v in med.items()},
            "chars_emitted": text, "profile": _top(prof) if prof else None}


def _top(prof: cProfile.Profile, n: int = 25) -> list[str]:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(n)
    return [line for line in s.getvalue().splitlines() if line.strip()][-n - 1:]


def fill_bench(model_dir: pathlib.Path, batch: int, layout: str, forward: str = "model",
               iters: int = 300) -> float:
    """µs a call of StaticInputs.fill on a synthetic decode batch of `batch` sequences (best of
    5 rounds of `iters` calls)."""
    built, gr, _ = build(model_dir, batch, 16, 240, Clock(), forward)
    blocks = built.engine.scheduler.blocks
    seqs = []
    for i in range(batch):
        slot = {"base": -1, "8 adapters": i % 8, "distinct": i}[layout]
        seq = Sequence(f"s{i}", list(range(4, 4 + 180 + (i * 7) % 40)), slot=slot, arrival=i)
        assert blocks.ensure(seq, len(seq.tokens))
        seq.num_computed = len(seq.tokens) - 1
        seqs.append(seq)
    # the step's plan (row order, slots; the LoRA choices, which a launch makes before it fills
    # to pick the graph, left out: the synthetic slots name no adapter in the pool)
    ordered = sorted((Scheduled(s, 1) for s in seqs),
                     key=lambda x: (x.seq.slot < 0, x.seq.slot, x.seq.arrival))
    plan = StepPlan(ordered, [x.seq for x in ordered],
                    np.array([x.seq.slot for x in ordered], dtype=np.int64), 0, 0, False)
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            gr.inputs.fill(plan, batch)
        rounds.append((time.perf_counter_ns() - t0) / iters / 1e3)
    return round(min(rounds), 1)


def cpu_model() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


FORWARD_TITLES = {
    "model": "With the model forward between steps (host code cache-cold: pessimistic)",
    "stub": "With a stub forward (caches warm, as on a GPU host waiting for the device)",
    "graph": "Captured CUDA graphs (host = step wall time - graph device time)",
}


def write(out: pathlib.Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    name = f"host-overhead-{result['device']}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    base = result.get("baseline") or {}
    where = f"on {result['gpu']}" if result.get("gpu") else "on CPU"
    lines = [f"# Host cost of a graph decode step {where} ({result['date']})", "",
             f"{result['cpu']}, Python {result['python']}, torch {result['torch']}, "
             f"{result['threads']} torch thread(s), load average "
             f"{result['load_average_before']:.1f} at start; model {result['model']} with the "
             f"demo adapters (rows on base + 3 adapters); median of {result['steps']} "
             f"full-batch decode steps, best of {result['repeats']} runs. "
             "µs per decode step, the replayed forward excluded; sample is the sampling math on "
             "this CPU (kernel launches on a GPU). See bench/engine/host_overhead.py."
             + (f" Before: {base['label']}, best of {base.get('repeats', '?')} runs."
                if base else "")]
    for forward in FORWARD_TITLES:
        runs = [r for r in result["runs"].values() if r["forward"] == forward]
        if not runs:
            continue
        lines += ["", f"## {FORWARD_TITLES[forward]}", "",
                  "| batch | mode | host µs | host − sample µs |"
                  + (" before: host µs | before: host − sample µs |" if base else "")
                  + " schedule | fill | sampling_batch | sample | other run | post (append) |",
                  "| ---: | --- | ---: | ---: |" + (" ---: | ---: |" if base else "")
                  + " ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in runs:
            u = r["us"]
            key = f"{forward}/{r['batch']}/{r['mode']}"
            old = (base.get("runs") or {}).get(key, {}).get("us")
            before = (f" {old['host']:.0f} | {old['host_minus_sample']:.0f} |" if old else
                      " - | - |") if base else ""
            lines.append(f"| {r['batch']} | {r['mode']} | {u['host']:.0f} | "
                         f"{u['host_minus_sample']:.0f} |{before} "
                         + " | ".join(f"{u[p]:.0f}" for p in PHASES) + " |")
    lines += ["", "## StaticInputs.fill alone, synthetic decode batches", "",
              "µs a call, best of 5 rounds of 300 calls.", "",
              "| batch | rows on | µs |" + (" before µs |" if base else ""),
              "| ---: | --- | ---: |" + (" ---: |" if base else "")]
    for key, r in result["fill"].items():
        old = (base.get("fill") or {}).get(key, {}).get("us")
        lines.append(f"| {r['batch']} | {r['layout']} | {r['us']:.1f} |"
                     + ((f" {old:.1f} |" if old else " - |") if base else ""))
    if result.get("profile"):
        lines += ["", f"## cProfile of {result['profile_of']}", "",
                  "The replay left out; by own time.", "", "```", *result["profile"], "```"]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def merge(results: list[dict]) -> dict:
    """Several runs' results as one: per case the run with the least host time, per fill
    case the fastest; repeats added up; the first profile."""
    out = dict(results[-1], runs={}, fill={}, repeats=sum(r["repeats"] for r in results),
               load_average_before=max(r["load_average_before"] for r in results))
    profiled = [r for r in results if r.get("profile")]
    if profiled:
        out["profile"], out["profile_of"] = profiled[0]["profile"], profiled[0]["profile_of"]
    for r in results:
        for key, run in r["runs"].items():
            if key not in out["runs"] or run["us"]["host"] < out["runs"][key]["us"]["host"]:
                out["runs"][key] = run
        for key, f in r["fill"].items():
            if key not in out["fill"] or f["us"] < out["fill"][key]["us"]:
                out["fill"][key] = f
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "tiny-llama"))
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--batch", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--forward", nargs="+", default=list(FORWARDS), choices=FORWARDS,
                   help="CPU stand-ins for the graphs")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: real captured graphs on the GPU (--forward is ignored)")
    p.add_argument("--steps", type=int, default=40, help="decode steps timed per run")
    p.add_argument("--warm", type=int, default=4, help="decode steps skipped first")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per case; the fastest median is kept (the machine is shared)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--no-fill", action="store_true", help="skip the fill microbenchmark")
    p.add_argument("--baseline", nargs="+", default=[],
                   help="earlier JSON results to compare with (several: merged)")
    p.add_argument("--merge", nargs="+", default=[],
                   help="write these JSON results merged (no new run)")
    p.add_argument("--label", default="", help="a name for this run (e.g. a commit)")
    p.add_argument("--profile", action="store_true",
                   help="add a cProfile of batch-64 greedy decode steps (the last forward kind)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    forwards = ["graph"] if args.device == "cuda" else args.forward
    if args.merge:
        result = merge([json.loads(pathlib.Path(f).read_text()) for f in args.merge])
        return finish(result, args)
    model = pathlib.Path(args.model)
    if not (model / "tokenizer.json").exists():
        sys.exit(f"{model}: no model; run `make model` first")
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "label": args.label, "cpu": cpu_model(), "python": platform.python_version(),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "model": model.name, "steps": args.steps, "repeats": args.repeats,
              "load_average_before": os.getloadavg()[0], "device": args.device,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "runs": {}, "fill": {}}
    if args.profile:
        prof = run_once(model, forwards[-1], 64, "greedy", args.steps, args.warm,
                        profile=True)["profile"]
        result["profile"] = prof
        result["profile_of"] = f"{args.steps} batch-64 greedy decode steps ({forwards[-1]})"
        print("\n".join(prof), flush=True)
    for forward in forwards:
        for batch in args.batch:
            for mode in args.modes:
                runs = [run_once(model, forward, batch, mode, args.steps, args.warm)
                        for _ in range(args.repeats)]
                best = min(runs, key=lambda r: r["us"]["host"])
                best.pop("profile")
                result["runs"][f"{forward}/{batch}/{mode}"] = {
                    "forward": forward, "batch": batch, "mode": mode, **best}
                u = best["us"]
                print(f"{forward:5s} batch {batch:4d} {mode:13s} host {u['host']:8.1f} us  "
                      f"host-sample {u['host_minus_sample']:8.1f} us  (replay "
                      f"{u['forward']:.0f} us)  " + " ".join(f"{p}={u[p]:.0f}" for p in PHASES),
                      flush=True)
    for batch in [] if args.no_fill else args.batch:
        for layout in ("base", "8 adapters", "distinct"):
            us = fill_bench(model, batch, layout, forwards[-1])
            result["fill"][f"{batch}/{layout}"] = {"batch": batch, "layout": layout, "us": us}
            print(f"fill batch {batch:4d} {layout:11s} {us:8.1f} us", flush=True)
    return finish(result, args)


def finish(result: dict, args) -> dict:
    """Attach the baseline (if any), write the files."""
    if args.baseline:
        old = merge([json.loads(pathlib.Path(f).read_text()) for f in args.baseline])
        result["baseline"] = {"label": old.get("label") or old["date"], "date": old["date"],
                              "repeats": old["repeats"], "runs": old["runs"],
                              "fill": old["fill"]}
    write(pathlib.Path(args.out), result)
    return result


if __name__ == "__main__":
    main()
