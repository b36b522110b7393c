"""Cold-load latency of a Llama-7B-shaped LoRA adapter from each tier.

Tiers, as a request meets them: the worker's host tier (a blob already in host memory copied
into the device pool), the store's host tier (gRPC Fetch from the running store, digest check,
unpack, place), and the source (S3 on loopback: moto's server; the store reads, validates and
serves it). Ranks 8, 16 and 64 on q/k/v/o (rank 16 = 33.6 MB in bf16).

On a GPU (`--gpu`), also: staging a rank-16 adapter from the pinned host tier into the GPU pool,
against one pinned copy of the same size and 256 separate tensor copies, and the staging time as
the number of registered (host-resident) adapters grows from 10 to 1,000.

    python -m bench.stack.cold_load --out bench/results          # CPU tiers, this machine
    python -m bench.stack.cold_load --gpu --out DIR              # H2D on a GPU
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import torch

from bench.lib.synthetic import TARGETS, adapter_tensors, llama7b_spec, model_config
from services.worker.adapters.device_pool import DevicePool
from services.worker.adapters.layout import staged_from_tensors
from services.worker.model.spec import ModelSpec

def stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "p50_ms": 1e3 * statistics.median(xs),
            "p95_ms": 1e3 * xs[min(len(xs) - 1, int(0.95 * len(xs)))], "min_ms": 1e3 * xs[0]}


# ---------------------------------------------------------------------------------- CPU tiers
def write_peft(dirpath: pathlib.Path, spec: ModelSpec, rank: int, seed: int) -> None:
    from safetensors.torch import save_file
    dirpath.mkdir(parents=True, exist_ok=True)
    save_file(adapter_tensors(spec, rank, seed, dtype=torch.bfloat16),
              str(dirpath / "adapter_model.safetensors"))
    (dirpath / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "bias": "none", "base_model_name_or_path": "llama-7b-shaped", "task_type": "CAUSAL_LM"}))


def base_config(path: pathlib.Path, spec: ModelSpec) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model_config("7b")))


async def cpu_tiers(work: pathlib.Path, ranks: list[int], reps: int) -> list[dict]:
    from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb
    from services.common.gen.lorafleet.v1 import adapter_store_pb2_grpc
    from services.common.server import channel, sync_channel
    from services.worker.adapters.store_client import StoreClient
    from tests.support import S3_ENV, MotoS3, Service
    spec = llama7b_spec()
    base_config(work / "base", spec)
    s3 = MotoS3(work)
    client = s3.client()
    client.create_bucket(Bucket="adapters")
    for r in ranks:                  # a distinct object per rep: each first fetch is SOURCE
        for i in range(reps):
            d = work / "src" / f"r{r}-{i}"
            write_peft(d, spec, r, seed=100 * r + i)
            for f in d.iterdir():
                client.upload_file(str(f), "adapters", f"r{r}-{i}/{f.name}")
            for f in d.iterdir():
                f.unlink()
    store = Service("adapter_store", ["--model", str(work / "base"), "--db", ":memory:",
                                      "--s3-endpoint", s3.endpoint, "--bucket", "adapters",
                                      "--host-cache-bytes", "1GiB"], work, env=S3_ENV).wait()
    rows = []
    try:
        chan = channel(store.addr)
        stub = adapter_store_pb2_grpc.AdapterStoreStub(chan)
        for r in ranks:
            await stub.Register(spb.RegisterRequest(id=f"r{r}", source=f"s3://adapters/r{r}-{i}"),
                                timeout=300)
        pool = DevicePool(spec, torch.device("cpu"), torch.bfloat16, 1 << 30, 8)
        fetcher = StoreClient(sync_channel(store.addr))
        for r in ranks:
            rows += await _measure_rank(r, reps, pool, spec, fetcher, stub)
            print(f"rank {r} done", flush=True)
        await chan.close()
    finally:
        store.terminate()
        s3.stop()
    return rows


async def _measure_rank(r, reps, pool, spec, store_client, stub) -> list[dict]:
    """Per rep: a fresh id over the same S3 object (the store reads the source: SOURCE), then
    the worker host tier (offloaded from the pool, kept on the host: WORKER_HOST), then a fresh
    worker (empty tiers) fetching again (the store's host tier: STORE_HOST)."""
    from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb
    from services.worker.adapters.host_tier import HostTier
    from services.worker.adapters.manager import AdapterManager
    by_tier: dict[str, list[float]] = {"source": [], "store_host": [], "worker_host": []}
    names = {4: "source", 3: "store_host", 2: "worker_host"}
    nbytes = 0
    for i in range(reps):
        info = (await stub.Register(spb.RegisterRequest(id=f"r{r}-{i}",
                                                        source=f"s3://adapters/r{r}-{i}"),
                                    timeout=300)).adapter
        nbytes = info.bytes
        for fresh in (True, False, True):
            mgr = fresh_mgr = (AdapterManager(pool, spec, HostTier(1 << 30, None, False, spec),
                                              store_client, None) if fresh else mgr)
            acq = await mgr.acquire(info.id, info.version, "bench", None)
            by_tier[names.get(acq.tier, str(acq.tier))].append(acq.seconds)
            mgr.release(acq.key)
            mgr.offload(info.id, to_host=True)
        del fresh_mgr
        await stub.Delete(spb.DeleteRequest(id=info.id), timeout=30)
    rows = []
    for tier, xs in by_tier.items():
        if xs:
            rows.append({"tier": tier, "rank": r, "bytes": nbytes, "device": "cpu", **stats(xs)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


# ---------------------------------------------------------------------------------- GPU
def gpu_rows(reps: int, counts: list[int]) -> list[dict]:
    spec = llama7b_spec()
    dev = torch.device("cuda")
    layout = staged_from_tensors(adapter_tensors(spec, 16, 1, dtype=torch.bfloat16),
                                 {"r": 16, "lora_alpha": 32}, spec)
    blob = layout.blob.pin_memory()
    nbytes = layout.nbytes
    dst = torch.empty(blob.numel(), dtype=torch.uint8, device=dev)
    rows = [{"what": "one pinned copy", "bytes": nbytes, **stats(_time_gpu(
        lambda: dst.copy_(blob, non_blocking=True), reps))}]
    parts = [t.contiguous().pin_memory() for t in tensors(spec, 16, 2).values()]
    dparts = [torch.empty_like(t, device=dev) for t in parts]
    def many():
        for d, s in zip(dparts, parts):
            d.copy_(s, non_blocking=True)
    rows.append({"what": f"{len(parts)} separate pinned copies", "bytes": nbytes,
                 **stats(_time_gpu(many, reps))})
    for n in counts:
        rows.append({"what": "pool staging from the pinned host tier", "registered": n,
                     "bytes": nbytes, **stats(_staging(spec, n, reps))})
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def _time_gpu(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps + 3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out[3:]


def _staging(spec: ModelSpec, registered: int, reps: int) -> list[float]:
    """Adapters 0..registered-1 live in the pinned host tier (views of one pinned arena, each
    contiguous); the GPU pool holds 64. Stage random ones in: evict the LRU, place (one copy,
    the layout kernel, the slot tables), time it."""
    from services.common.cache_policy import CachePolicy
    from services.worker.adapters.host_tier import HostTier
    base = staged_from_tensors(adapter_tensors(spec, 16, 3, dtype=torch.bfloat16),
                               {"r": 16, "lora_alpha": 32}, spec)
    n = base.nbytes
    host = HostTier(registered * (n + 64), None, True, spec)
    layouts = []
    for i in range(registered):
        res, _ = host.reserve(f"a{i}", "t", n)
        res.view.copy_(base.blob)
        layouts.append(host.commit(res, {"r": 16, "lora_alpha": 32}))
    pool = DevicePool(spec, torch.device("cuda"), torch.bfloat16,
                      64 * 2 * base.plan.numel + (1 << 24), 64)
    pool.warm_up()
    policy = CachePolicy.plain_lru(pool.capacity_bytes)
    g = torch.Generator().manual_seed(registered)
    times = []
    for _ in range(reps + 3):
        key = f"a{int(torch.randint(registered, (1,), generator=g))}"
        if pool.slot_of(key) is not None:
            policy.touch(key)
            continue
        t = time.perf_counter()
        for victim in policy.admit(key, "t", pool.alloc.rounded(base.plan.numel) * 2):
            pool.remove(victim)
        pool.place(key, layouts[int(key[1:])])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times[3:]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--ranks", default="8,16,64")
    p.add_argument("--counts", default="10,100,1000")
    a = p.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    header = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "python": platform.python_version(),
              "machine": (torch.cuda.get_device_name() if a.gpu else _cpu_name())}
    if a.gpu:
        rows = gpu_rows(max(a.reps, 20), [int(x) for x in a.counts.split(",")])
        name = "cold-load-h200"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            rows = asyncio.run(cpu_tiers(pathlib.Path(tmp), [int(x) for x in a.ranks.split(",")],
                                         a.reps))
        name = "cold-load-cpu"
    (out / f"{name}.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    (out / f"{name}.md").write_text(_markdown(header, rows))
    print((out / f"{name}.md").read_text())
    return 0


def _cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _markdown(header: dict, rows: list[dict]) -> str:
    lines = [f"# Adapter cold-load latency, {header['machine']}, {header['date']}", "",
             f"torch {header['torch']}, Python {header['python']}; Llama-7B-shaped LoRA on "
             "q/k/v/o, bf16.", "", "| what | rank / registered | MB | p50 ms | p95 ms | min ms |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        what = r.get("tier") or r.get("what")
        extra = r.get("rank", r.get("registered", ""))
        lines.append(f"| {what} | {extra} | {r['bytes']/1e6:.1f} | {r['p50_ms']:.2f} | "
                     f"{r['p95_ms']:.2f} | {r['min_ms']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
