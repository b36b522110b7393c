"""`make run` (services.devstack) on ports of the caller's choosing: the three services serve
on --port-base .. +2, the gateway on --http-port and /metrics on --metrics-base .. +2, and
SIGTERM stops them all. A stack keeps to what it started (issue 41, defect 5): a second one on
the same ports refuses to start, naming what holds them, and leaves the first whole; SERVING
counts only from its own processes; it removes only its own /dev/shm directory."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from services import devstack
from services.common.port_holders import holders
from tests.support import DEMO_ADAPTERS, MODEL_DIR, ROOT, Service

pytestmark = pytest.mark.slow


def free_run(n: int) -> int:
    """The first of n consecutive free loopback ports."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        socks = []
        try:
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no run of free ports")


def stack_args(grpc_base: int, http: int, metrics: int) -> list[str]:
    return [sys.executable, "-m", "services.devstack", "--port-base", str(grpc_base),
            "--http-port", str(http), "--metrics-base", str(metrics), "--db", ":memory:"]


def own_shm(pid: int) -> list[pathlib.Path]:
    return list(pathlib.Path("/dev/shm").glob(f"{devstack.shm_prefix()}{pid}-*"))


def second_stack_refused(args: list[str], router_pid: int) -> None:
    """A second stack on the same ports exits 1 before starting anything, naming the first
    stack's router as what holds the router port."""
    before = set(pathlib.Path("/dev/shm").glob(devstack.shm_prefix() + "*"))
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "not starting" in proc.stderr and "starting router" not in proc.stdout, proc.stderr
    assert f"(router gRPC) is held by pid {router_pid} " in proc.stderr, proc.stderr
    assert set(pathlib.Path("/dev/shm").glob(devstack.shm_prefix() + "*")) == before


def test_make_run_serves_on_the_ports_it_is_given(tmp_path):
    grpc_base, http, metrics = free_run(3), free_run(1), free_run(3)
    args = stack_args(grpc_base, http, metrics)
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    out = []
    try:
        end = time.monotonic() + 240
        for line in proc.stdout:
            out.append(line)
            if "Ctrl-C stops all three" in line or time.monotonic() > end:
                break
        assert any("lorafleet is serving" in x for x in out), "".join(out[-30:])
        assert any(f"--router 127.0.0.1:{grpc_base}" in x for x in out)
        health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=10))
        assert health["workers"] == 1
        for i, name in enumerate(("router", "worker", "adapter_store")):
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics + i}/metrics",
                                          timeout=10).read().decode()
            assert "python_info" in text, name
        from services.client.client import LorafleetClient
        with LorafleetClient(f"127.0.0.1:{grpc_base}") as c:
            assert c.generate("Hello!", adapter="pirate", max_new_tokens=4).token_ids
            shm = own_shm(proc.pid)
            assert len(shm) == (1 if os.access("/dev/shm", os.W_OK) else 0), shm
            (router_pid,) = holders(grpc_base)
            second_stack_refused(args, router_pid)
            assert all(p.is_dir() for p in shm)             # the first stack's, untouched
            # a cold load after the refusal still works (the store's files are where it left them)
            assert c.generate("Hello!", adapter="poet", max_new_tokens=4).token_ids
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, "".join(out[-20:]) + rest[-3000:]
    assert not own_shm(proc.pid)                            # its own, removed


def test_serving_counts_only_from_the_process_started(tmp_path):
    """Another process's SERVING on the port is not the stack's: wait_serving keeps waiting
    (the old one returned at once) and fails at its timeout."""
    other = Service("adapter_store", ["--adapters-dir", str(DEMO_ADAPTERS), "--model",
                                      str(MODEL_DIR), "--db", ":memory:"], tmp_path).wait()
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(SystemExit, match="did not become SERVING"):
            devstack.wait_serving(other.addr, mine, timeout=3)
        devstack.wait_serving(other.addr, other.proc, timeout=10)     # its own process: yes
    finally:
        mine.kill()
        mine.wait()
        assert other.terminate() == 0


def test_each_stack_gets_its_own_shm_dir_and_clears_only_dead_ones(tmp_path):
    prefix = devstack.shm_prefix()
    a, b = devstack.shm_dir(str(tmp_path)), devstack.shm_dir(str(tmp_path))
    assert a != b and {pathlib.Path(a).name, pathlib.Path(b).name} <= \
        {p.name for p in tmp_path.iterdir()}
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = tmp_path / f"{prefix}{dead.pid}-x1"             # a stack SIGKILLed: removed
    kept = tmp_path / f"{prefix}{dead.pid}-x2"             # ... but its store still runs
    old_style = tmp_path / f"{prefix}7001"                  # no owner in the name: never
    for d in (gone, kept, old_style):
        d.mkdir()
    (kept / f"lorafleet-store-{os.getpid()}-abcd-v1").write_bytes(b"x")
    devstack.shm_dir(str(tmp_path))
    assert not gone.exists() and kept.exists() and old_style.exists()
    assert pathlib.Path(a).exists() and pathlib.Path(b).exists()   # owner (this pid) alive
