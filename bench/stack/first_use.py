"""First use of never-used adapters through the real adapter store (issue 43).

Fleet: N distinct Llama-7B-shaped LoRA adapters (bf16, q/k/v/o, rank 8 = 16.8 MB each) written
as PEFT directories into a fresh --adapters-dir (so their files sit in the page cache, as on a
serving host). Each scenario starts a fresh store process on loopback (--db :memory:, no
background validation, --shm-dir on /dev/shm, --trace-file), so every adapter is REGISTERED and
never used; each first use is what a request does: the router's Resolve, then the worker's
Fetch of that version through the worker's own StoreClient (shared memory, or a stream hashed
as it arrives), on threads as the worker's loaders run it:

- `burst_shm`: all N at once, the worker on the store's host (shared memory);
- `burst_stream`: all N at once, streamed (a worker on another host);
- `one_at_a_time`: the first N/4 one after another (shared memory);
- `refetch_one`: the source tier of a used adapter, as Zipf churn meets it: the first N/4 used
  once, one after another, with a store host tier of one adapter (so each use evicts the one
  before), then each fetched again one after another (measured): READY, its bytes read from the
  source again and checked against the file's identity (shared memory).

Per scenario: per-adapter first-use latency (Resolve + Fetch) p50/p99 and the burst's wall
time, and where the store's time went, from its spans (mean ms per adapter: store.validate,
its read/digest/finite parts where the store records them, store.source_read, store.verify,
store.fetch). `floor` is this machine's physical limit for the same bytes, measured in this
process: one page-cache read into memory, one SHA-256, one finite check per adapter, spread
over the CPUs.

    python -m bench.stack.first_use --adapters 32 --rank 8 --label after --out bench/results

Writes OUT/first-use-cpu.{json,md}; a run appends to what is there ({"header", "runs": [{
"label", "header", "rows", "floor"}]}), so before/after runs sit side by side.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np

from bench.lib.header import RESULTS, base_header
from bench.lib.synthetic import TARGETS, model_config, module_shapes

NAME = "first-use-cpu"
STAGES = ("store.validate", "store.source_read", "store.verify", "store.fetch")
PARTS = ("lora.read_s", "lora.digest_s", "lora.finite_s", "lora.wait_s")


# ---------------------------------------------------------------------------------- the fleet
def write_adapter(folder: pathlib.Path, rank: int, seed: int, layers: int) -> int:
    """A PEFT directory of random bf16 A/B tensors (q/k/v/o of `layers` layers); its bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    shapes = module_shapes(model_config("7b"))
    rng = np.random.default_rng(seed)
    header, parts, at = {}, [], 0
    for layer in range(layers):
        for m in TARGETS:
            k, n = shapes[m]
            for part, shape in (("A", (rank, k)), ("B", (n, rank))):
                bits = (rng.standard_normal(shape, dtype=np.float32) * 0.01).view(np.uint32)
                data = (bits >> 16).astype("<u2").tobytes()      # bf16: the top half
                name = f"base_model.model.model.layers.{layer}.self_attn.{m}.lora_{part}.weight"
                header[name] = {"dtype": "BF16", "shape": list(shape),
                                "data_offsets": [at, at + len(data)]}
                parts.append(data)
                at += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(folder / "adapter_model.safetensors", "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for data in parts:
            f.write(data)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "bias": "none", "task_type": "CAUSAL_LM"}))
    return 8 + len(head) + at


def make_fleet(root: pathlib.Path, n: int, rank: int, layers: int) -> tuple[pathlib.Path, int]:
    adapters = root / "adapters"
    sizes = [write_adapter(adapters / f"f{i:03d}", rank, 1000 + i, layers) for i in range(n)]
    base = root / "base"
    base.mkdir(parents=True, exist_ok=True)
    (base / "config.json").write_text(json.dumps(model_config("7b")))
    return adapters, sizes[0]


# ---------------------------------------------------------------------------------- the floor
def floor(adapters: pathlib.Path, n: int) -> dict:
    """This machine's limit for n adapters' first use: per adapter, one read from the page
    cache into memory, one SHA-256, one finite check of its bf16 words; the burst's floor is
    their sum spread over the CPUs."""
    path = next(adapters.iterdir()) / "adapter_model.safetensors"
    size = path.stat().st_size
    buf = bytearray(size)
    read, sha, finite = [], [], []
    for _ in range(5):
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            f.readinto(buf)
        read.append(time.perf_counter() - t)
        t = time.perf_counter()
        hashlib.sha256(buf).digest()
        sha.append(time.perf_counter() - t)
        words = np.frombuffer(buf, dtype="<u2", count=size // 2)
        t = time.perf_counter()
        bool(((words & np.uint16(0x7F80)) == 0x7F80).any())
        finite.append(time.perf_counter() - t)
    one = {k: 1e3 * min(v) for k, v in (("read_ms", read), ("sha256_ms", sha),
                                         ("finite_ms", finite))}
    cpus = os.cpu_count() or 1
    return {**one, "bytes": size, "cpus": cpus,
            "one_ms": sum(one.values()), "burst_ms": n * sum(one.values()) / cpus}


# ---------------------------------------------------------------------------------- a scenario
def start_store(work: pathlib.Path, adapters: pathlib.Path, shm: pathlib.Path, traces: str,
                extra: list[str]):
    from tests.support import Service
    return Service("adapter_store", [
        "--model", str(adapters.parent / "base"), "--adapters-dir", str(adapters),
        "--db", ":memory:", "--background-validate-threads", "0", "--shm-dir", str(shm),
        "--host-cache-bytes", "4GiB", "--trace-file", traces, *extra], work).wait()


def first_use(addr: str, ids: list[str], shm_dir: str | None, at_once: bool,
              arena) -> list[float]:
    """Resolve then Fetch each id (the worker's StoreClient, its bytes into the next slot of
    `arena`, touched beforehand as the worker's host tier is), all at once on threads or one
    after another; seconds each."""
    import itertools
    from services.common.gen.lorafleet.v1 import adapter_store_pb2 as pb
    from services.common.gen.lorafleet.v1 import adapter_store_pb2_grpc
    from services.common.server import sync_channel
    from services.worker.adapters.store_client import StoreClient
    chan = sync_channel(addr)
    stub, client = adapter_store_pb2_grpc.AdapterStoreStub(chan), StoreClient(chan, shm_dir)
    slots = itertools.count()

    def one(adapter_id: str) -> float:
        t = time.perf_counter()
        version = stub.Resolve(pb.ResolveRequest(name=adapter_id), timeout=300).adapter.version
        client.fetch(adapter_id, version, 300, lambda n: SimpleNamespace(
            view=arena[next(slots)][:n]))
        return time.perf_counter() - t
    try:
        if not at_once:
            return [one(i) for i in ids]
        with ThreadPoolExecutor(len(ids)) as pool:
            return list(pool.map(one, ids))
    finally:
        chan.close()


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stages(traces: pathlib.Path) -> dict:
    """Mean ms per adapter of the store's spans (and the parts a span records)."""
    by: dict[str, list[float]] = {}
    for line in traces.read_text().splitlines() if traces.exists() else ():
        span = json.loads(line)
        if span["name"] in STAGES:
            by.setdefault(span["name"], []).append((span["end_ns"] - span["start_ns"]) / 1e6)
            for part in PARTS:
                if part in span["attributes"]:
                    key = f"{span['name']}.{part[5:-2]}"
                    by.setdefault(key, []).append(1e3 * float(span["attributes"][part]))
    return {k: round(statistics.fmean(v), 2) for k, v in sorted(by.items())}


def scenario(name: str, work: pathlib.Path, adapters: pathlib.Path, n: int,
             extra: list[str]) -> dict:
    ids = sorted(p.name for p in adapters.iterdir())[:n]
    shm = pathlib.Path(tempfile.mkdtemp(prefix="lorafleet-bench-", dir="/dev/shm"))
    traces = work / f"traces-{name}.jsonl"
    import torch
    load = round(os.getloadavg()[0], 2)       # others' work on this machine, at the start
    size = max((adapters / i / "adapter_model.safetensors").stat().st_size for i in ids)
    arena = torch.ones((n, size), dtype=torch.uint8)      # the worker's host tier, touched
    if name == "refetch_one":       # a host tier of one adapter: every use evicts the last
        extra = [*extra, "--host-cache-bytes", str(size + size // 2)]
    store = start_store(work, adapters, shm, str(traces), extra)
    try:
        if name == "refetch_one":
            first_use(store.addr, ids, str(shm), False, arena)
            traces.write_text("")           # the spans of the measured pass only
        t, cpu, mine = time.perf_counter(), cpu_s(store.proc.pid), os.times()
        xs = first_use(store.addr, ids, None if name == "burst_stream" else str(shm),
                       name not in ("one_at_a_time", "refetch_one"), arena)
        wall = time.perf_counter() - t
        cpu, after = cpu_s(store.proc.pid) - cpu, os.times()
        client = after.user + after.system - mine.user - mine.system
    finally:
        store.terminate()
        for f in shm.iterdir():
            f.unlink()
        shm.rmdir()
    xs = sorted(xs)
    row = {"scenario": name, "adapters": n, "loadavg_1m": load, "wall_ms": round(1e3 * wall, 1),
           "p50_ms": round(1e3 * statistics.median(xs), 1),
           "p99_ms": round(1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))], 1),
           "max_ms": round(1e3 * xs[-1], 1), "store_cpu_ms": round(1e3 * cpu),
           "client_cpu_ms": round(1e3 * client), "stages_ms": stages(traces)}
    print(json.dumps(row), flush=True)
    return row


# ---------------------------------------------------------------------------------- output
def markdown(doc: dict) -> str:
    lines = [f"# First use of never-used adapters through the store, {doc['header']['card']}",
             "", "Each run: a fresh store process on loopback, N never-used 7B-shaped bf16 "
             "adapters, Resolve + Fetch each (the worker's StoreClient). Latency per adapter; "
             "stages are the store's spans, mean ms per adapter; load is the machine's 1-minute "
             "load average as the scenario starts (others' work: compare runs of like load).",
             "",
             "| label | commit | scenario | N | MB each | load | wall ms | p50 ms | p99 ms | "
             "floor ms | store / client CPU ms | stages (mean ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in doc["runs"]:
        fl = run["floor"]
        for r in run["rows"]:
            limit = {"one_at_a_time": fl["one_ms"], "refetch_one": fl["read_ms"]}.get(
                r["scenario"], fl["burst_ms"])
            parts = ", ".join(f"{k}: {v}" for k, v in r["stages_ms"].items())
            lines.append(f"| {run['label']} | {run['header']['commit']} | {r['scenario']} | "
                         f"{r['adapters']} | {fl['bytes'] / 1e6:.1f} | {r.get('loadavg_1m', '')} | "
                         f"{r['wall_ms']} | "
                         f"{r['p50_ms']} | {r['p99_ms']} | {limit:.0f} | "
                         f"{r['store_cpu_ms']} / {r['client_cpu_ms']} | {parts} |")
    fl = doc["runs"][-1]["floor"]
    lines += ["", f"Floor (last run, in process, per adapter): page-cache read "
              f"{fl['read_ms']:.1f} ms, SHA-256 {fl['sha256_ms']:.1f} ms, finite check "
              f"{fl['finite_ms']:.1f} ms on {fl['cpus']} CPUs; a burst's floor is N x their sum "
              "/ CPUs, one at a time their sum."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stack.first_use", description=__doc__
                                .split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS), help="results directory (bench/results)")
    p.add_argument("--adapters", type=int, default=32, help="adapters in a burst (32)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (8: 16.8 MB in bf16)")
    p.add_argument("--layers", type=int, default=32, help="layers the adapters cover (32)")
    p.add_argument("--label", default="run", help="this run's label in the results (run)")
    p.add_argument("--scenarios", default="burst_shm,burst_stream,one_at_a_time",
                   help="which scenarios, comma-separated")
    p.add_argument("--commit", default=None,
                   help="what the run's code is, when its checkout's git does not know (a "
                        "copy of an older tree: the before run)")
    p.add_argument("--store-arg", action="append", default=[],
                   help="one more flag for the store (repeatable, e.g. --store-arg=--x=1)")
    a = p.parse_args(argv)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    header = base_header("cpu", a.commit)
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        adapters, _ = make_fleet(work, a.adapters, a.rank, a.layers)
        fl = floor(adapters, a.adapters)
        print(json.dumps({"floor": fl}), flush=True)
        rows = [scenario(s, work, adapters,
                         max(2 if s == "refetch_one" else 1, a.adapters // 4)
                         if s in ("one_at_a_time", "refetch_one") else a.adapters,
                         a.store_arg) for s in a.scenarios.split(",")]
    path = out / f"{NAME}.json"
    doc = json.loads(path.read_text()) if path.exists() else {"header": header, "runs": []}
    doc["header"] = header
    doc["runs"].append({"label": a.label, "header": header, "rows": rows, "floor": fl})
    path.write_text(json.dumps(doc, indent=1))
    (out / f"{NAME}.md").write_text(markdown(doc))
    print((out / f"{NAME}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
