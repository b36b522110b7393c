"""CPU seconds a worker's threads spend per streamed token (the core's event loop above all).

Starts `python -m services.worker` on the tiny model on CPU (no store: base model only), keeps
N Generate streams of T tokens in flight straight at the worker, and reads each thread's CPU
time from /proc before and after. With `--frontend process` the per-token gRPC work is in the
front end's process and the core's main thread (its event loop) should do almost none.

    python -m bench.stack.worker_loop --frontend inline
    python -m bench.stack.worker_loop --frontend process
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import grpc

from bench.lib.header import ROOT
from bench.serve.stack import free_port
from services.common.gen.lorafleet.v1 import common_pb2, worker_pb2 as wpb
from services.common.gen.lorafleet.v1 import worker_pb2_grpc


def thread_cpu(pid: int) -> dict[int, float]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        fields = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


async def run(args) -> None:
    port = free_port()
    log = open(args.log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "services.worker", "--listen",
                             f"127.0.0.1:{port}", "--metrics-port", "0", "--model",
                             str(ROOT / "models" / "tiny-llama"), "--store", "127.0.0.1:1",
                             "--device", "cpu", "--max-running", str(args.streams),
                             "--frontend", args.frontend], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        stub = worker_pb2_grpc.WorkerStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
        for _ in range(300):
            try:
                await stub.Info(wpb.WorkerInfoRequest(), timeout=1)
                break
            except grpc.RpcError:
                await asyncio.sleep(0.2)

        async def one(i: int) -> int:
            n = 0
            async for r in stub.Generate(wpb.WorkerGenerateRequest(
                    request_id=f"r{i}", prompt_token_ids=list(range(1, 9)),
                    stopping=common_pb2.StoppingCriteria(max_new_tokens=args.tokens,
                                                         ignore_eos=True))):
                n += len(r.token_ids)
            return n
        await asyncio.gather(*(one(i) for i in range(4)))                # warm
        before, t0 = thread_cpu(proc.pid), time.time()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(args.streams))))
        elapsed, after = time.time() - t0, thread_cpu(proc.pid)
        print(f"--frontend {args.frontend}: {tokens} tokens in {elapsed:.2f}s = "
              f"{tokens / elapsed:.0f} tok/s")
        for cpu, tid in sorted(((after[t] - before.get(t, 0.0), t) for t in after),
                               reverse=True)[:4]:
            label = " (main thread: the event loop)" if tid == proc.pid else ""
            print(f"  thread {tid}{label}: {cpu:.2f} s CPU, {cpu / tokens * 1e6:.1f} us a token")
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frontend", default="process", choices=("process", "inline"))
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--log", default="/tmp/worker_loop_cpu.log")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
