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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="run the whole lorafleet stack locally")
    p.add_argument("--model", default="models/tiny-llama")
    p.add_argument("--adapters-dir", default="models/adapters")
    p.add_argument("--host", default="127.0.0.1", help="where every service listens (127.0.0.1)")
    p.add_argument("--port-base", type=int, default=7001,
                   help="gRPC ports: router this, worker +1, store +2 (7001)")
    p.add_argument("--http-port", type=int, default=8080,
                   help="the router's OpenAI-compatible HTTP port (8080)")
    p.add_argument("--metrics-base", type=int, default=9101,
                   help="/metrics ports: router this, worker +1, store +2; 0 = off (9101)")
    p.add_argument("--db", default="state/adapter_store.sqlite", help="the store's registry")
    a = p.parse_args(argv)
    for name in ("port_base", "http_port", "metrics_base"):
        value = getattr(a, name)
        if not (name == "metrics_base" and value == 0) and not 0 < value <= 65533:
            p.error(f"--{name.replace('_', '-')}: {value} is not a port")
    return a


def service_specs(a, py: str, shm: str | None) -> list[tuple[str, list[str], str]]:
    """(name, command, gRPC address) of the store, the worker and the router."""
    h, base = a.host, a.port_base
    router, worker, store = (f"{h}:{base + i}" for i in range(3))

    def metrics(i: int) -> list[str]:
        return ["--metrics-port", str(a.metrics_base + i if a.metrics_base else 0)]
    return [
        ("adapter-store", [py, "-m", "services.adapter_store", "--listen", store,
                           "--adapters-dir", a.adapters_dir, "--model", a.model, "--db", a.db,
                           *metrics(2), *(["--shm-dir", shm] if shm else [])], store),
        ("worker", [py, "-m", "services.worker", "--listen", worker, "--model", a.model,
                    "--store", store, *metrics(1), *(["--store-shm-dir", shm] if shm else [])],
         worker),
        ("router", [py, "-m", "services.router", "--listen", router, "--http-listen",
                    f"{h}:{a.http_port}", "--store", store, "--worker", worker, *metrics(0)],
         router),
    ]


def main(argv=None) -> int:
    a = parse_args(argv)
    h = a.host
    shm = shm_dir(a.port_base)
    specs = service_specs(a, sys.executable, shm)
    procs = []
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        for name, cmd, addr in specs:
            print(f"starting {name} on {addr} ...", flush=True)
            proc = subprocess.Popen(cmd, cwd=ROOT)
            procs.append(proc)
            wait_serving(addr, proc, timeout=180)
            print(f"{name} SERVING on {addr}", flush=True)
        cli = ".venv/bin/lorafleet" + ("" if a.port_base == 7001 and h == "127.0.0.1"
                                       else f" --router {h}:{a.port_base}")
        print("\nlorafleet is serving. Try:\n"
              f"  {cli} adapters\n"
              f"  {cli} generate --adapter pirate --max-new-tokens 24 "
              "'Tell me about the weather.'\n"
              f"  {cli} stats\n"
              f"  curl -s {h}:{a.http_port}/v1/chat/completions -H 'Content-Type: application/json' "
              "-d '{\"model\": \"poet\", \"messages\": [{\"role\": \"user\", \"content\": "
              "\"Hello!\"}], \"max_tokens\": 24}'\n"
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


def shm_dir(port_base: int) -> str | None:
    """A directory of this user's on /dev/shm for the store's host tier (one a stack, by its
    port base), or None without one."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        return None
    path = f"/dev/shm/lorafleet-devstack-{os.getuid()}-{port_base}"
    os.makedirs(path, exist_ok=True)
    return path


if __name__ == "__main__":
    sys.exit(main())
