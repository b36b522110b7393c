"""`make run`: the adapter store, one worker and the router on this machine, with the embedded
tiny model and demo adapters. Serves until Ctrl-C, then drains all three. Where the machine has
a tmpfs at /dev/shm, the store keeps its host tier there and the worker reads adapters from it
(--shm-dir / --store-shm-dir) instead of a gRPC stream."""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_serving(addr: str, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    with grpc.insecure_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise SystemExit(f"{addr}: process exited with {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise SystemExit(f"{addr} did not become SERVING within {timeout}s")


def main() -> int:
    p = argparse.ArgumentParser(description="run the whole lorafleet stack locally")
    p.add_argument("--model", default="models/tiny-llama")
    p.add_argument("--adapters-dir", default="models/adapters")
    p.add_argument("--host", default="127.0.0.1")
    a = p.parse_args()
    h = a.host
    py = sys.executable
    shm = shm_dir()
    specs = [
        ("adapter-store", [py, "-m", "services.adapter_store", "--listen", f"{h}:7003",
                           "--adapters-dir", a.adapters_dir, "--model", a.model,
                           "--db", "state/adapter_store.sqlite",
                           *(["--shm-dir", shm] if shm else [])], f"{h}:7003"),
        ("worker", [py, "-m", "services.worker", "--listen", f"{h}:7002", "--model", a.model,
                    "--store", f"{h}:7003", *(["--store-shm-dir", shm] if shm else [])],
         f"{h}:7002"),
        ("router", [py, "-m", "services.router", "--listen", f"{h}:7001", "--http-listen",
                    f"{h}:8080", "--store", f"{h}:7003",
                    "--worker", f"{h}:7002"], f"{h}:7001"),
    ]
    procs = []
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        for name, cmd, addr in specs:
            print(f"starting {name} on {addr} ...", flush=True)
            proc = subprocess.Popen(cmd, cwd=ROOT)
            procs.append(proc)
            wait_serving(addr, proc, timeout=180)
            print(f"{name} SERVING on {addr}", flush=True)
        print("\nlorafleet is serving. Try:\n"
              "  .venv/bin/lorafleet adapters\n"
              "  .venv/bin/lorafleet generate --adapter pirate --max-new-tokens 24 "
              "'Tell me about the weather.'\n"
              "  .venv/bin/lorafleet stats\n"
              "  curl -s 127.0.0.1:8080/v1/completions -H 'Content-Type: application/json' "
              "-d '{\"model\": \"poet\", \"prompt\": \"Hello!\", \"max_tokens\": 24}'\n"
              "Ctrl-C stops all three.\n", flush=True)
        while all(pr.poll() is None for pr in procs):
            time.sleep(0.5)
        print("a service exited; stopping the rest", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if shm:
            shutil.rmtree(shm, ignore_errors=True)


def shm_dir() -> str | None:
    """A directory of this user's on /dev/shm for the store's host tier, or None without one."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        return None
    path = f"/dev/shm/lorafleet-devstack-{os.getuid()}"
    os.makedirs(path, exist_ok=True)
    return path


if __name__ == "__main__":
    sys.exit(main())
