"""What a mixed step costs: D decode rows beside a prefill chunk of C tokens, on the
Llama-7B-shaped engine (random bf16 weights), base rows or rows over rank-16 q/k/v/o adapters,
run eagerly (the model runner) and through the graph runner (which replays a captured graph
where it has one for the step, else runs it eagerly too).

Per case: the step's wall time (host to host: inputs built, forward launched, sampled tokens
read back), and on CUDA the GPU's busy time (the sum of its kernels' durations, from the
profiler): wall well above busy means the step waits on the host launching kernels.

    python bench/mixed_step_bench.py --layers 32 --decode 64 --chunks 0,128,256,512,1024 \
        --distincts 0,32 --out bench/results --name mixed-step-h200 [--profile 256]

Results: OUT/NAME.json ({"header", "rows": [{"adapters", "decode_rows", "chunk", "path",
"wall_ms", "gpu_busy_ms"}]}) and OUT/NAME.md. --profile C also prints the profiler's table of
one eager step with a C-token chunk and the most adapters (host ops by self CPU time).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def mixed_batch(built, slots: list[int], decode: int, context: int, chunk: int):
    """decode sequences with `context` tokens in the cache (one row each) and one new
    sequence with a `chunk`-token prompt (one run of rows), their KV blocks taken; each on an
    adapter of slots in turn (none: base rows)."""
    from services.worker.engine.scheduler import Scheduled
    from services.worker.engine.sequence import Sequence, Stopping
    blocks = built.engine.scheduler.blocks
    batch = []
    for i in range(decode + (1 if chunk else 0)):
        prefill = i == decode
        n = chunk if prefill else context + 1
        seq = Sequence(f"s{i}", list(range(3, 3 + n)), slot=slots[i % len(slots)] if slots
                       else -1, stopping=Stopping(max_new_tokens=64, ignore_eos=True))
        if not blocks.ensure(seq, n):
            raise SystemExit("KV cache too small for the case")
        seq.num_computed = 0 if prefill else context
        batch.append(Scheduled(seq, n if prefill else 1))
    return batch


def kv_bytes(layers: int, tokens: int) -> int:
    """K and V of `tokens` tokens in `layers` layers of the Llama-7B shape (32 KV heads of
    128, bf16), with a quarter to spare."""
    return tokens * 2 * layers * 32 * 128 * 2 * 5 // 4


def _release(built, batch) -> None:
    for b in batch:
        built.engine.scheduler.blocks.free(b.seq)


def _busy_ms(fn, reps: int) -> float:
    """Mean sum of kernel durations per call of fn, from the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages()
                if e.device_type == torch.autograd.DeviceType.CUDA)
    return total / reps / 1000.0


def measure(fn, reps: int, cuda: bool) -> tuple[float, float | None]:
    for _ in range(3):                     # compiles, autotunes, lazy state
        fn()
    walls = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()                               # reads its sampled tokens back: a host sync
        walls.append((time.perf_counter() - t) * 1000)
    busy = _busy_ms(fn, min(reps, 5)) if cuda else None
    return statistics.median(walls), busy


def profile_table(fn) -> str:
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                     max_name_column_width=50)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--decode", type=int, default=64, help="decode rows beside the chunk")
    p.add_argument("--context", type=int, default=256, help="decode rows' tokens so far")
    p.add_argument("--chunks", default="0,128,256,512,1024")
    p.add_argument("--distincts", default="0,32", help="adapter counts (0: base rows)")
    p.add_argument("--paths", default="eager,graph")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--profile", type=int, default=0, help="print one eager step's profile "
                   "at this chunk (CUDA)")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    p.add_argument("--name", default="mixed-step-h200")
    p.add_argument("--commit", default=None)
    a = p.parse_args()
    from bench.serve_report import base_header
    from bench.timeline import build_engine
    chunks = [int(c) for c in a.chunks.split(",")]
    distincts = [int(d) for d in a.distincts.split(",")]
    cuda = a.device.startswith("cuda")
    budget = a.decode + max(chunks)
    built, slots = build_engine(a.layers, max(distincts), cuda_graphs=cuda, device=a.device,
                                max_model_len=max(a.context + 64, max(chunks) + 64),
                                max_batch_tokens=max(budget, 256), graph_max_rank=16,
                                kv_cache_bytes=kv_bytes(a.layers, a.decode * (a.context + 32)
                                                        + max(chunks) + 256))
    graph = built.engine.runner
    eager = getattr(graph, "runner", graph)            # the ModelRunner under a GraphRunner
    rows = []
    for d in distincts:
        for c in chunks:
            batch = mixed_batch(built, slots[:d], a.decode, a.context, c)
            for path in a.paths.split(","):
                run = (eager if path == "eager" else graph).run
                wall, busy = measure(lambda: run(batch), a.reps, cuda)
                rows.append({"adapters": d, "decode_rows": a.decode, "chunk": c, "path": path,
                             "wall_ms": round(wall, 3),
                             "gpu_busy_ms": None if busy is None else round(busy, 3)})
                print(f"adapters {d:3d} chunk {c:5d} {path:5s}: wall {wall:8.3f} ms"
                      + (f", GPU busy {busy:8.3f} ms" if busy is not None else ""), flush=True)
            if cuda and a.profile == c and d == max(distincts):
                print(profile_table(lambda: eager.run(batch)), flush=True)
            _release(built, batch)
    doc = {"header": {**base_header(a.device, a.commit), "layers": a.layers,
                      "context": a.context, "adapter_rank": 16}, "rows": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{a.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    h = doc["header"]
    lines = [f"# Mixed steps, {h['card']}, {h['date']}", "",
             f"Commit {h['commit']}; {a.layers} layers of the Llama-7B shape; {a.decode} decode "
             f"rows at {a.context} tokens of context beside one prefill chunk; adapters rank 16 "
             "on q/k/v/o. Wall: host to host, median; GPU busy: the sum of kernel durations.",
             "", "| adapters | chunk | path | wall ms | GPU busy ms |", "|---|---|---|---|---|"]
    for r in rows:
        busy = "-" if r["gpu_busy_ms"] is None else f"{r['gpu_busy_ms']:.2f}"
        lines.append(f"| {r['adapters']} | {r['chunk']} | {r['path']} | {r['wall_ms']:.2f} | "
                     f"{busy} |")
    (a.out / f"{a.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
