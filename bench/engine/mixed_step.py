"""What a mixed step costs: D decode rows beside a prefill chunk of C tokens, on the
Llama-7B-shaped engine (random bf16 weights), base rows or rows over rank-16 q/k/v/o adapters
(the rows spread over them in turn), run eagerly (the model runner) and through the graph
runner (which replays a captured graph where it has one for the step, else runs it eagerly
too).

Per case: the step's wall time (host to host: inputs built, forward launched, sampled tokens
read back), and on CUDA the GPU's busy time (the sum of its kernels' durations, from the
profiler): wall well above busy means the step waits on the host launching kernels. The busy
time by kind of kernel (KINDS: the LoRA kernels, the GEMMs, attention, norms and RoPE, the
rest): what the adapters cost in a step, and where. Column LoRA's q/k/v shrink rides in the
GEMM (its extra columns), so "lora" is then the expand and the other groups.

    python -m bench.engine.mixed_step --layers 32 --decode 64,128,256 \
        --chunks 0,256,1024 --distincts 0,32,128 --out bench/results --name mixed-step-h200

Results: OUT/NAME.json ({"header", "rows": [{"adapters", "decode_rows", "chunk", "path",
"wall_ms", "gpu_busy_ms", "gpu_ms": {kind: ms}}]}) and OUT/NAME.md. --profile C also prints
the profiler's table of one eager step with a C-token chunk and the most adapters (host ops by
self CPU time).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

from bench.engine.build import build_engine, kv_bytes, mixed_batch
from bench.lib.header import RESULTS, base_header

# a kernel's kind, by its name: the first whose pattern the name contains (lower case)
KINDS = (("lora", ("_sgmv_kernel", "_shrink_kernel", "_expand_kernel", "_one_launch_kernel",
                   "_shrink_blocks_kernel")),
         ("attention", ("_paged_attn_kernel", "_split_combine_kernel")),
         ("norms", ("_rms_kernel", "_rope_kv_kernel", "_rope_kernel", "_silu_mul_kernel",
                    "_write_kv_kernel", "_quantize_rows_kernel")),
         ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "_fp8_gemm_kernel")))


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, pats in KINDS if any(p in low for p in pats)), "other")


def _release(built, batch) -> None:
    for b in batch:
        built.engine.scheduler.blocks.free(b.seq)


def _busy_ms(fn, reps: int) -> dict[str, float]:
    """Mean kernel time per call of fn by kind (kind_of), ms, from the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    by = {k: 0.0 for k, _ in KINDS} | {"other": 0.0}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by[kind_of(e.key)] += e.device_time_total / reps / 1000.0
    return {k: round(v, 3) for k, v in by.items()}


def measure(fn, reps: int, cuda: bool) -> tuple[float, dict[str, float] | None]:
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
    p.add_argument("--decode", default="64", help="decode rows beside the chunk (a list)")
    p.add_argument("--context", type=int, default=256, help="decode rows' tokens so far")
    p.add_argument("--chunks", default="0,128,256,512,1024")
    p.add_argument("--distincts", default="0,32", help="adapter counts (0: base rows)")
    p.add_argument("--paths", default="eager,graph")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--profile", type=int, default=0, help="print one eager step's profile "
                   "at this chunk (CUDA)")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    p.add_argument("--name", default="mixed-step-h200")
    p.add_argument("--commit", default=None)
    a = p.parse_args()
    chunks = [int(c) for c in a.chunks.split(",")]
    distincts = [int(d) for d in a.distincts.split(",")]
    decodes = [int(d) for d in a.decode.split(",")]
    cuda = a.device.startswith("cuda")
    budget = max(decodes) + max(chunks)
    built, slots = build_engine(a.layers, max(distincts), cuda_graphs=cuda, device=a.device,
                                max_model_len=max(a.context + 64, max(chunks) + 64),
                                max_batch_tokens=max(budget, 256), graph_max_rank=16,
                                max_running=max(128, max(decodes) + 1),
                                kv_cache_bytes=kv_bytes(a.layers, max(decodes) * (a.context + 32)
                                                        + max(chunks) + 256))
    a.most = max(distincts)
    graph = built.engine.runner
    eager = getattr(graph, "runner", graph)            # the ModelRunner under a GraphRunner
    rows = []
    for rows_d in decodes:
        for d in distincts:
            for c in chunks:
                rows += case(built, eager, graph, slots[:d], rows_d, c, a, cuda)
    doc = {"header": {**base_header(a.device, a.commit), "layers": a.layers,
                      "context": a.context, "adapter_rank": 16}, "rows": rows}
    write(doc, a)
    return 0


def case(built, eager, graph, slots: list[int], decode: int, chunk: int, a,
         cuda: bool) -> list[dict]:
    """One batch (decode rows beside a chunk, over these adapters) on each path: its rows."""
    rows = []
    batch = mixed_batch(built, slots, decode, a.context, chunk)
    for path in a.paths.split(","):
        run = (eager if path == "eager" else graph).run
        wall, kinds = measure(lambda: run(batch), a.reps, cuda)
        busy = None if kinds is None else round(sum(kinds.values()), 3)
        rows.append({"adapters": len(slots), "decode_rows": decode, "chunk": chunk,
                     "path": path, "wall_ms": round(wall, 3), "gpu_busy_ms": busy,
                     "gpu_ms": kinds})
        print(f"decode {decode:3d} adapters {len(slots):3d} chunk {chunk:5d} {path:5s}: wall "
              f"{wall:8.3f} ms" + (f", GPU busy {busy:8.3f} ms {kinds}" if kinds else ""),
              flush=True)
    if cuda and a.profile and a.profile == chunk and len(slots) == a.most:
        print(profile_table(lambda: eager.run(batch)), flush=True)
    _release(built, batch)
    return rows


def write(doc: dict, a) -> None:
    rows = doc["rows"]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{a.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    h = doc["header"]
    kinds = [k for k, _ in KINDS] + ["other"]
    lines = [f"# Mixed steps, {h['card']}, {h['date']}", "",
             f"Commit {h['commit']}; {a.layers} layers of the Llama-7B shape; decode rows at "
             f"{a.context} tokens of context beside one prefill chunk; adapters rank 16 on "
             "q/k/v/o, the rows spread over them. Wall: host to host, median; GPU busy: the sum "
             "of kernel durations, then by kind of kernel (ms).", "",
             "| decode rows | adapters | chunk | path | wall ms | GPU busy ms | "
             + " | ".join(kinds) + " |", "|---" * (6 + len(kinds)) + "|"]
    for r in rows:
        busy = "-" if r["gpu_busy_ms"] is None else f"{r['gpu_busy_ms']:.2f}"
        by = [f"{r['gpu_ms'][k]:.2f}" if r["gpu_ms"] else "-" for k in kinds]
        lines.append(f"| {r['decode_rows']} | {r['adapters']} | {r['chunk']} | {r['path']} | "
                     f"{r['wall_ms']:.2f} | {busy} | " + " | ".join(by) + " |")
    (a.out / f"{a.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
