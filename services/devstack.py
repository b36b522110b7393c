"""`make run`: the adapter store, one worker and the router on this machine, with the embedded
tiny model and demo adapters. Serves until Ctrl-C, then drains all three. Where the machine has
a tmpfs at /dev/shm, the store keeps its host tier there and the worker reads adapters from it
(--shm-dir / --store-shm-dir) instead of a gRPC stream.

A stack keeps to what it started (issue 41: a second `make run` reported the first one's health
as its own, then deleted its shared memory): it refuses to start while any of its ports is
taken, naming what holds it; it reports SERVING only for a port its own process (or one under
it) listens on; its /dev/shm directory is its own (named for its pid, made fresh), and it
removes only that one, and stale ones of stacks that died with no live store left in them.
On a --host beyond loopback the three share a fresh service token (--service-token-file), as
a store or worker listening there refuses to start with internal calls open."""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.internal_auth import loopback
from services.common.owned_dirs import alive, clear_stale, make_owned_dir
from services.common.port_holders import describe, held_by
from services.common.ports import PortError, check_free

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_serving(addr: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until `proc`'s service answers SERVING on addr: an answer counts only while the port is
    held by proc or a process under it (the worker's front end), never by another process."""
    end, port = time.monotonic() + timeout, int(addr.rpartition(":")[2])
    with grpc.insecure_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise SystemExit(f"{addr}: process exited with {proc.returncode}")
            if held_by(port, proc.pid) is not False and serving(stub):
                return
            time.sleep(0.2)
    raise SystemExit(f"{addr} did not become SERVING within {timeout}s")


def serving(stub) -> bool:
    try:
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1
    except grpc.RpcError:
        return False


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


def service_specs(a, py: str, shm: str | None,
                  token: str | None = None) -> list[tuple[str, list[str], str]]:
    """(name, command, gRPC address) of the store, the worker and the router; with `token`
    (a file), all three authenticate internal calls with it."""
    h, base = a.host, a.port_base
    router, worker, store = (f"{h}:{base + i}" for i in range(3))
    auth = ["--service-token-file", token] if token else []

    def metrics(i: int) -> list[str]:
        return ["--metrics-port", str(a.metrics_base + i if a.metrics_base else 0)]
    return [
        ("adapter-store", [py, "-m", "services.adapter_store", "--listen", store,
                           "--adapters-dir", a.adapters_dir, "--model", a.model, "--db", a.db,
                           *metrics(2), *auth, *(["--shm-dir", shm] if shm else [])], store),
        ("worker", [py, "-m", "services.worker", "--listen", worker, "--model", a.model,
                    "--store", store, *metrics(1), *auth,
                    *(["--store-shm-dir", shm] if shm else [])],
         worker),
        ("router", [py, "-m", "services.router", "--listen", router, "--http-listen",
                    f"{h}:{a.http_port}", "--store", store, "--worker", worker, *metrics(0),
                    *auth],
         router),
    ]


def stack_ports(a) -> list[tuple[str, int]]:
    """(what, port) of every port the stack listens on."""
    ports = [("router gRPC", a.port_base), ("worker gRPC", a.port_base + 1),
             ("adapter-store gRPC", a.port_base + 2), ("router HTTP", a.http_port)]
    if a.metrics_base:
        ports += [(f"{name} /metrics", a.metrics_base + i)
                  for i, name in enumerate(("router", "worker", "adapter-store"))]
    return ports


def taken_ports(a) -> list[str]:
    """One line for each of the stack's ports that is taken, naming what holds it."""
    lines = []
    for what, port in stack_ports(a):
        try:
            check_free(what, f"{a.host}:{port}")
        except PortError:
            lines.append(f"  port {port} ({what}) is held by {describe(port)}")
    return lines


def print_banner(a) -> None:
    h = a.host
    cli = ".venv/bin/lorafleet" + ("" if a.port_base == 7001 and h == "127.0.0.1"
                                   else f" --router {h}:{a.port_base}")
    print("\nlorafleet is serving. Try:\n"
          f"  {cli} adapters\n"
          f"  {cli} generate --adapter pirate --max-new-tokens 24 "
          "'Tell me about the weather.'\n"
          f"  {cli} stats\n"
          f"  curl -s {h}:{a.http_port}/v1/chat/completions -H 'Content-Type: application/json' "
          "-d '{\"model\": \"poet\", \"messages\": [{\"role\": \"user\", \"content\": "
          "\"Hello!\"}], \"max_tokens\": 24, \"temperature\": 0}'\n"
          "Ctrl-C stops all three.\n", flush=True)


def stack_dirs(a) -> tuple[list[str], str | None, str | None]:
    """(the directories this stack made, its /dev/shm directory or None, its service token
    file or None): a token only beyond loopback, where internal calls need one."""
    shm = shm_dir()
    own = [shm] if shm else []
    if loopback(a.host):
        return own, shm, None
    own += [] if shm else [shm_dir(tempfile.gettempdir())]
    return own, shm, write_token(own[-1])


def main(argv=None) -> int:
    a = parse_args(argv)
    taken = taken_ports(a)
    if taken:
        print("devstack: not starting: ports this stack needs are in use (another `make run`?)\n"
              + "\n".join(taken) + "\nStop that stack, or choose free ports: make run "
              "PORT_BASE=... HTTP_PORT=... METRICS_BASE=... (0: no /metrics)", file=sys.stderr)
        return 1
    own, shm, token = stack_dirs(a)
    specs = service_specs(a, sys.executable, shm, token)
    procs = []
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        for name, cmd, addr in specs:
            print(f"starting {name} on {addr} ...", flush=True)
            proc = subprocess.Popen(cmd, cwd=ROOT)
            procs.append(proc)
            wait_serving(addr, proc, timeout=180)
            print(f"{name} SERVING on {addr}", flush=True)
        print_banner(a)
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
        for path in own:
            shutil.rmtree(path, ignore_errors=True)


def shm_dir(root: str = "/dev/shm") -> str | None:
    """A new directory on /dev/shm, this stack's own, for the store's host tier (or None
    without a writable /dev/shm). Stale ones of stacks that died (SIGKILL) are removed first,
    unless a store still runs with files in them."""
    if not os.path.isdir(root) or not os.access(root, os.W_OK):
        return None
    prefix = shm_prefix()
    clear_stale(root, prefix, in_use=store_files_alive)
    return str(make_owned_dir(root, prefix))


def write_token(directory: str) -> str:
    """A fresh service token in a file of the stack's own (private) directory."""
    path = os.path.join(directory, "service-token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))
    return path


def shm_prefix() -> str:
    return f"lorafleet-devstack-{os.getuid()}-"


def store_files_alive(path) -> bool:
    """Whether a store that is still running has files in `path` (host_cache names each
    file PREFIX + its store's pid + '-' ...)."""
    from services.adapter_store.host_cache import PREFIX
    for f in path.iterdir():
        name = f.name.lstrip(".")
        pid = name[len(PREFIX):].split("-", 1)[0] if name.startswith(PREFIX) else ""
        if pid.isdigit() and alive(int(pid)):
            return True
    return False


if __name__ == "__main__":
    sys.exit(main())
