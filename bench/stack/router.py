"""The router's cost: added latency (client -> router -> worker vs client -> worker, same request)
and requests/s through the router, with the store, one worker and the router as processes on
this machine (CPU worker, the tiny random Llama of tests/hf_fixtures, one rank-4 adapter).

Latency: one request at a time, router and direct interleaved so drift hits both alike; p50 /
p99 of each and of the difference per request pair. Throughput: C requests kept in flight for a
fixed time, through the router and straight to the worker. Requests generate 1 token (the
router's cost, not the model's, is what is measured) and, for latency, also 16.

    python -m bench.stack.router                    # about a minute; writes bench/results/
    python -m bench.stack.router --quick --out /tmp/x
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

import grpc

from bench.lib.header import RESULTS, ROOT
from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb
from services.common.gen.lorafleet.v1 import adapter_store_pb2_grpc
from services.common.gen.lorafleet.v1 import router_pb2 as rpb, router_pb2_grpc
from services.common.gen.lorafleet.v1 import worker_pb2 as wpb, worker_pb2_grpc
from services.router.stats import percentile

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def make_model(root: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    from tests.conftest import write_lora
    from tests.hf_fixtures import make_base
    make_base(root / "base")
    config = json.loads((root / "base" / "config.json").read_text())
    write_lora(root / "adapters" / "bench", config, seed=1)
    return root / "base", root / "adapters"


class Calls:
    """The same request, through the router and straight to the worker."""

    def __init__(self, router: str, worker: str, version: str, new_tokens: int):
        self._rch = grpc.aio.insecure_channel(router)
        self._wch = grpc.aio.insecure_channel(worker)
        self.router = router_pb2_grpc.GenerationServiceStub(self._rch)
        self.worker = worker_pb2_grpc.WorkerStub(self._wch)
        self.rreq = rpb.GenerateRequest(adapter_id="bench", prompt_token_ids=PROMPT)
        self.rreq.stopping.max_new_tokens = new_tokens
        self.wreq = wpb.WorkerGenerateRequest(
            prompt_token_ids=PROMPT, tenant="bench",
            adapter=wpb.AdapterRef(id="bench", version=version, tenant="bench"))
        self.wreq.stopping.max_new_tokens = new_tokens

    async def via_router(self) -> float:
        start = time.perf_counter()
        async for _ in self.router.GenerateStream(self.rreq, timeout=30):
            pass
        return time.perf_counter() - start

    async def direct(self) -> float:
        start = time.perf_counter()
        async for _ in self.worker.Generate(self.wreq, timeout=30):
            pass
        return time.perf_counter() - start

    async def close(self) -> None:
        await self._rch.close()
        await self._wch.close()


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_ms": percentile(xs, 50) * 1e3, "p99_ms": percentile(xs, 99) * 1e3}


async def latency(calls: Calls, n: int) -> dict:
    for _ in range(20):                                  # warm both paths
        await calls.via_router()
        await calls.direct()
    router, direct = [], []
    for i in range(n):
        pair = (calls.via_router, calls.direct) if i % 2 else (calls.direct, calls.via_router)
        a, b = await pair[0](), await pair[1]()
        router.append(a if i % 2 else b)
        direct.append(b if i % 2 else a)
    added = [r - d for r, d in zip(router, direct)]
    return {"router": summary(router), "direct": summary(direct), "added": summary(added)}


async def throughput(call, concurrency: int, seconds: float) -> float:
    done, end = 0, time.perf_counter() + seconds

    async def loop() -> None:
        nonlocal done
        while time.perf_counter() < end:
            await call()
            done += 1
    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / (time.perf_counter() - start)


async def measure(router: str, worker: str, version: str, args) -> dict:
    out: dict = {"latency": {}, "throughput_rps": {}}
    for new_tokens in (1, 16):
        calls = Calls(router, worker, version, new_tokens)
        out["latency"][f"new_tokens={new_tokens}"] = await latency(calls, args.n)
        await calls.close()
    calls = Calls(router, worker, version, 1)
    for c in args.concurrency:
        out["throughput_rps"][f"concurrency={c}"] = {
            "router": await throughput(calls.via_router, c, args.seconds),
            "direct": await throughput(calls.direct, c, args.seconds)}
    await calls.close()
    return out


def environment() -> dict:
    import google.protobuf
    import torch
    cpu = next((line.split(":", 1)[1].strip() for line in
                pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    import os
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu, "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
            "python": platform.python_version(), "grpcio": grpc.__version__,
            "protobuf": google.protobuf.__version__, "torch": torch.__version__,
            "commit": commit}


def write(results: dict, out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "router-cpu.json").write_text(json.dumps(results, indent=2) + "\n")
    env = results["environment"]
    lines = [f"# Router overhead ({env['date']})", "",
             f"{env['cpu']}, {env['cpus']} CPUs (load {env['load_avg_1m']:.1f} at start), "
             f"Python {env['python']}, grpcio {env['grpcio']}, protobuf {env['protobuf']}, "
             f"torch {env['torch']}, commit {env['commit']}.", "",
             "Store, one CPU worker (tiny random Llama, rank-4 adapter) and the router as "
             "processes on loopback; one client request at a time, router and direct "
             "interleaved.", "",
             "| request | direct p50 / p99 ms | via router p50 / p99 ms | added p50 / p99 ms |",
             "|---|---|---|---|"]
    for name, r in results["latency"].items():
        d, v, a = r["direct"], r["router"], r["added"]
        lines.append(f"| {name} | {d['p50_ms']:.2f} / {d['p99_ms']:.2f} | {v['p50_ms']:.2f} / "
                     f"{v['p99_ms']:.2f} | {a['p50_ms']:.2f} / {a['p99_ms']:.2f} |")
    lines += ["", "| requests in flight (1 new token) | direct req/s | via router req/s |",
              "|---|---|---|"]
    for name, r in results["throughput_rps"].items():
        lines.append(f"| {name.split('=')[1]} | {r['direct']:.0f} | {r['router']:.0f} |")
    lines += ["", "Client, router, worker and store share the machine's cores, so the router's "
              "CPU is taken from the worker: on separate hosts the added latency is the router "
              "hop alone."]
    (out / "router-cpu.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--n", type=int, default=200, help="request pairs per latency measurement")
    p.add_argument("--seconds", type=float, default=5.0, help="per throughput measurement")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--quick", action="store_true", help="a smoke run: few requests")
    args = p.parse_args()
    if args.quick:
        args.n, args.seconds, args.concurrency = 20, 1.0, [4]
    from tests.conftest import Stack
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp:
        base, adapters = make_model(pathlib.Path(tmp))
        stack = Stack(base, adapters, pathlib.Path(tmp))
        try:
            with grpc.insecure_channel(stack.store.addr) as ch:
                version = adapter_store_pb2_grpc.AdapterStoreStub(ch).Resolve(
                    spb.ResolveRequest(name="bench"), timeout=10).adapter.version
            env = environment()
            results = {"environment": env, **asyncio.run(
                measure(stack.router.addr, stack.workers[0].addr, version, args))}
        finally:
            stack.terminate()
    write(results, pathlib.Path(args.out))
    print((pathlib.Path(args.out) / "router-cpu.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
