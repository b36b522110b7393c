"""Every port a service listens on is its alone (issue 41, defect 4): a second service on a
taken port exits non-zero at once with one line naming the port, and the first keeps answering.
With gRPC's default SO_REUSEPORT a second adapter-store on 7003 started without error and took
a share of the new connections."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb, adapter_store_pb2_grpc
from tests.support import (DEMO_ADAPTERS, FreePort, MODEL_DIR, ROOT, Service,
                           free_port, health_status)

pytestmark = pytest.mark.slow
SERVING = 1
STORE_ARGS = ["--adapters-dir", str(DEMO_ADAPTERS), "--model", str(MODEL_DIR), "--db", ":memory:"]


def second(module: str, args: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    """`python -m services.MODULE ARGS` run to its end (it should refuse to start)."""
    return subprocess.run([sys.executable, "-m", f"services.{module}", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def refused(proc: subprocess.CompletedProcess, service: str, flag: str, port: int) -> None:
    """Exit 1 with, as its last line, the one-line reason naming the flag and the port."""
    err = proc.stderr.strip()
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.splitlines()[-1]
    assert last.startswith(f"{service}: could not serve {flag} ") and f"port {port} is taken" \
        in last, err[-3000:]


def answers(addr: str, n: int = 20) -> None:
    """n fresh connections all reach a store that serves its registry (the demo adapters)."""
    for _ in range(n):
        with grpc.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            listed = adapter_store_pb2_grpc.AdapterStoreStub(ch).List(spb.ListRequest(), timeout=10)
            assert {"pirate", "poet"} <= {a.id for a in listed.adapters}
    assert health_status(addr) == SERVING


@pytest.fixture
def store(tmp_path):
    metrics = FreePort()
    s = Service("adapter_store", [*STORE_ARGS, "--metrics-port", metrics], tmp_path).wait()
    s.metrics = metrics.port
    yield s
    assert s.terminate() == 0


def test_a_second_store_on_the_grpc_port_exits_and_the_first_keeps_every_connection(store):
    proc = second("adapter_store", ["--listen", store.addr, "--metrics-port", "0", *STORE_ARGS])
    refused(proc, "adapter-store", "--listen", store.port)
    answers(store.addr)


def test_a_second_store_on_the_metrics_port_exits_with_one_line(store):
    proc = second("adapter_store", ["--listen", f"127.0.0.1:{free_port()}", "--metrics-port",
                                    str(store.metrics), *STORE_ARGS])
    refused(proc, "adapter-store", "--metrics-port", store.metrics)
    text = urllib.request.urlopen(f"http://127.0.0.1:{store.metrics}/metrics", timeout=10).read()
    assert b"python_info" in text
    answers(store.addr, 1)


def test_a_router_on_a_taken_http_port_exits_naming_it(store):
    """The router's OpenAI gateway port held by another service (the store's /metrics)."""
    proc = second("router", ["--listen", f"127.0.0.1:{free_port()}", "--metrics-port", "0",
                             "--http-listen", f"127.0.0.1:{store.metrics}", "--store", store.addr,
                             "--worker", f"127.0.0.1:{free_port()}"])
    refused(proc, "router", "--http-listen", store.metrics)
    answers(store.addr, 1)


def test_a_worker_on_a_taken_port_exits_before_loading_its_model(store):
    start = time.monotonic()
    proc = second("worker", ["--listen", store.addr, "--metrics-port", "0", "--model",
                             str(MODEL_DIR), "--store", store.addr, "--device", "cpu"])
    refused(proc, "worker", "--listen", store.port)
    assert "loading" not in proc.stderr.lower() and time.monotonic() - start < 45
    answers(store.addr, 1)


def test_create_server_binds_its_port_exclusively():
    """At the cause: a second gRPC server on a port another one serves is refused (grpc's
    default would have shared the port through SO_REUSEPORT)."""
    from services.common.ports import PortError
    from services.common.server import create_server

    async def run():
        first, port, _ = create_server("127.0.0.1:0", lambda s: [])
        await first.start()
        try:
            with pytest.raises(PortError, match=f"port {port} is taken"):
                create_server(f"127.0.0.1:{port}", lambda s: [])
        finally:
            await first.stop(0)
    asyncio.run(run())
