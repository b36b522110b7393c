"""A forward pass that raises (the --fault-inject-after-steps test hook stands for a device
error) through the running services: every request in flight ends INTERNAL (none hangs), the
worker's health goes NOT_SERVING, both worker processes exit 1 for their supervisor, and the
router takes the worker as gone (a new request: UNAVAILABLE)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.client.client import LorafleetClient
from services.common.gen.lorafleet.v1 import common_pb2, worker_pb2 as wpb, worker_pb2_grpc
from tests.conftest import Stack

pytestmark = pytest.mark.slow
N = 4                                   # concurrent requests in flight when the fault hits


def _stream(addr: str, i: int) -> tuple:
    """(status code, tokens received, seconds) of one long streamed request to the worker."""
    req = wpb.WorkerGenerateRequest(
        request_id=f"r{i}", prompt_token_ids=[1, 5, 9, 14 + i],
        stopping=common_pb2.StoppingCriteria(max_new_tokens=200, ignore_eos=True))
    got, start = 0, time.monotonic()
    with grpc.insecure_channel(addr) as ch:
        try:
            for resp in worker_pb2_grpc.WorkerStub(ch).Generate(req, timeout=60):
                got += len(resp.token_ids)
            return grpc.StatusCode.OK, got, time.monotonic() - start
        except grpc.RpcError as err:
            return err.code(), got, time.monotonic() - start, err.details()


def _watch_health(addr: str, seen: list, ready: threading.Event) -> None:
    with grpc.insecure_channel(addr) as ch:
        try:
            for resp in health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(),
                                                             timeout=60):
                seen.append(resp.status)
                ready.set()
        except grpc.RpcError:
            pass


@pytest.mark.parametrize("frontend", ["process", "inline"])
def test_a_failed_forward_pass_stops_the_worker(lora_fleet, tmp_path, frontend):
    base, adapters = lora_fleet
    stack = Stack(base, adapters, tmp_path, worker_args=[
        "--fault-inject-after-steps", "30", "--frontend", frontend, "--grace", "20"],
        router_args=["--worker-wait", "1"])        # no worker comes back: answer soon
    worker = stack.workers[0]
    seen, ready = [], threading.Event()
    watcher = threading.Thread(target=_watch_health, args=(worker.addr, seen, ready),
                               daemon=True)
    try:
        watcher.start()
        assert ready.wait(10) and seen[0] == health_pb2.HealthCheckResponse.SERVING
        with ThreadPoolExecutor(N) as pool:
            results = list(pool.map(lambda i: _stream(worker.addr, i), range(N)))
        for r in results:
            assert r[0] == grpc.StatusCode.INTERNAL, r
            assert "injected fault" in r[3] and r[1] < 200 and r[2] < 30, r
        assert sum(r[1] for r in results) > 0          # they were running when it failed
        assert worker.proc.wait(30) == 1
        watcher.join(10)
        assert health_pb2.HealthCheckResponse.NOT_SERVING in seen, seen
        log = worker.log()
        assert "a forward pass failed" in log
        if frontend == "process":
            assert "the front end exited (1)" in log, log[-3000:]
        with LorafleetClient(stack.router.addr, timeout=30) as c:
            with pytest.raises(grpc.RpcError) as err:
                c.generate(prompt_ids=[5, 6, 7], max_new_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    finally:
        codes = stack.terminate()
        assert codes[0] == 0 and codes[-1] == 0                  # router, store: clean
