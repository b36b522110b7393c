"""A router started before its worker, through the running services: it answers health at once,
NOT_SERVING (its `liveness` name SERVING) until the worker's residency stream connects, then
SERVING; requests sent while the worker starts, and a burst sent the moment it says SERVING,
are answered whole, because a request
that finds no live worker waits for one (woken by the stream that brings it, within
--worker-wait and the request's deadline) instead of failing "no live worker"; with no worker at
all a request ends UNAVAILABLE before its deadline, saying why."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.client.client import LorafleetClient
from tests.support import DEMO_ADAPTERS, MODEL_DIR, Service, free_port, wait_serving

pytestmark = pytest.mark.slow
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
BURST = 32
EARLY = 8               # sent while the worker is still starting
ADAPTERS = ["", "pirate", "poet", "acme-support"]


def health(addr: str, service: str = "") -> int:
    with grpc.insecure_channel(addr) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5.0,
            wait_for_ready=True).status


def wait_health(addr: str, service: str, want: int, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if health(addr, service) == want:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{addr} health {service!r} never {want}")


def one(addr: str, i: int) -> str:
    with LorafleetClient(addr, timeout=120) as c:
        try:
            resp = c.generate(adapter=ADAPTERS[i % len(ADAPTERS)], prompt_ids=[3, 4, 5 + i],
                              max_new_tokens=4, temperature=0)
        except grpc.RpcError as err:
            return f"{err.code().name}: {err.details()}"
    return "OK" if resp.token_ids else "no tokens"


@pytest.fixture
def store(tmp_path):
    svc = Service("adapter_store", ["--adapters-dir", str(DEMO_ADAPTERS), "--model",
                                    str(MODEL_DIR), "--db", ":memory:"], tmp_path).wait()
    yield svc
    svc.terminate()


def test_a_burst_sent_as_the_worker_says_serving_loses_nothing(store, tmp_path):
    wport = free_port()
    router = Service("router", ["--store", store.addr, "--worker", f"127.0.0.1:{wport}"],
                     tmp_path)
    worker = None
    try:
        wait_health(router.addr, "liveness", SERVING)
        assert health(router.addr) == NOT_SERVING
        assert health(router.addr, "lorafleet.v1.GenerationService") == NOT_SERVING
        worker = Service("worker", ["--model", str(MODEL_DIR), "--store", store.addr,
                                    "--device", "cpu"], tmp_path, port=wport)
        with ThreadPoolExecutor(BURST + EARLY) as pool:
            early = [pool.submit(one, router.addr, i) for i in range(EARLY)]  # none live yet
            wait_serving(worker.addr, 180, worker.proc)
            burst = list(pool.map(lambda i: one(router.addr, i), range(BURST)))  # at once
            results = [f.result() for f in early] + burst
        assert results == ["OK"] * (EARLY + BURST), [r for r in results if r != "OK"]
        assert health(router.addr) == SERVING
        assert "a worker is live: ready" in router.log()
        worker.terminate()                 # the only worker gone: not ready again
        wait_health(router.addr, "", NOT_SERVING)
        assert health(router.addr, "liveness") == SERVING
    finally:
        if worker is not None:
            worker.terminate()
        assert router.terminate() == 0


def test_with_no_worker_a_request_ends_unavailable_before_its_deadline(store, tmp_path):
    router = Service("router", ["--store", store.addr, "--worker", f"127.0.0.1:{free_port()}",
                                "--worker-wait", "1"], tmp_path)
    try:
        wait_health(router.addr, "liveness", SERVING)
        for timeout, bound in ((30.0, 1.0), (0.75, 0.5)):    # --worker-wait, then the deadline
            with LorafleetClient(router.addr, timeout=timeout) as c:
                start = time.monotonic()
                with pytest.raises(grpc.RpcError) as err:
                    c.generate(prompt_ids=[3, 4, 5], max_new_tokens=2)
                took = time.monotonic() - start
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert f"no live worker within {bound:.1f}s" in err.value.details()
            assert bound <= took < timeout, took
    finally:
        router.terminate()
