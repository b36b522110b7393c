"""`make run` (services.devstack) on ports of the caller's choosing: the three services serve
on --port-base .. +2, the gateway on --http-port and /metrics on --metrics-base .. +2, and
SIGTERM stops them all."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.support import ROOT

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


def test_make_run_serves_on_the_ports_it_is_given(tmp_path):
    grpc_base, http, metrics = free_run(3), free_run(1), free_run(3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.devstack", "--port-base", str(grpc_base),
         "--http-port", str(http), "--metrics-base", str(metrics), "--db", ":memory:"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, "".join(out[-20:]) + rest[-3000:]
