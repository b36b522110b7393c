"""Ordinary client behaviour leaves no tracebacks in the logs (issue 29, item 7), so the real
errors stand out: an SSE client that goes away mid-stream (the HTTP gateway logged a
ClientConnectionResetError traceback each time), and gRPC streams cancelled or cut by their
deadline mid-generation ("Failed to detach context" from OpenTelemetry: spans made current
across the servicers' yields were closed in another context). Each abandoned request is
still cancelled down to the worker."""
from __future__ import annotations

import http.client
import json
import time

import grpc
import pytest

from services.common.gen.lorafleet.v1 import common_pb2, router_pb2 as rpb, router_pb2_grpc
from tests.conftest import ResidencyWatch, Stack
from tests.support import DEMO_ADAPTERS, FreePort, MODEL_DIR
pytestmark = pytest.mark.slow
NOISE = ("Traceback", "Failed to detach context", "ClientConnectionResetError",
         "ExecuteBatchError", " ERROR ")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    port = FreePort("127.0.0.1:")
    s = Stack(MODEL_DIR, DEMO_ADAPTERS, tmp_path_factory.mktemp("noise"),
              router_args=["--http-listen", port])
    s.http_port = port.port
    yield s
    s.terminate()


def idle(watch: ResidencyWatch) -> None:
    watch.wait(lambda w: w.load.running == 0 and w.load.waiting == 0, timeout=20)


def assert_quiet(stack) -> None:
    for svc in stack.services:
        log = svc.log()
        for bad in NOISE:
            assert bad not in log, (svc.name, bad, log[-3000:])


def test_sse_clients_that_leave_mid_stream_log_nothing(stack):
    watch = ResidencyWatch(stack.workers[0].addr)
    try:
        body = json.dumps({"model": "pirate", "prompt": "Tell me about the weather.",
                           "max_tokens": 200, "stream": True, "ignore_eos": True})
        for _ in range(4):
            conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=30)
            conn.request("POST", "/v1/completions", body,
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200
            assert resp.read(6) == b"data: "                    # the stream has begun
            conn.sock.close()                                   # the client goes away
            conn.close()
        time.sleep(1.0)
        idle(watch)                     # each request was cancelled down to the worker
    finally:
        watch.close()
    assert_quiet(stack)


def test_grpc_streams_cancelled_or_past_their_deadline_log_nothing(stack):
    watch = ResidencyWatch(stack.workers[0].addr)
    request = rpb.GenerateRequest(
        text="Tell me about the weather.", adapter_id="poet",
        stopping=common_pb2.StoppingCriteria(max_new_tokens=200, ignore_eos=True))
    try:
        with grpc.insecure_channel(stack.router.addr) as ch:
            stub = router_pb2_grpc.GenerationServiceStub(ch)
            for i in range(6):
                call = stub.GenerateStream(request, timeout=30 if i % 2 else 0.4)
                try:
                    next(call)                                  # streaming
                    if i % 2:
                        call.cancel()
                    else:
                        for _ in call:                          # until the deadline cuts it
                            pass
                except grpc.RpcError as err:
                    assert err.code() in (grpc.StatusCode.CANCELLED,
                                          grpc.StatusCode.DEADLINE_EXCEEDED), err
        time.sleep(1.0)
        idle(watch)
    finally:
        watch.close()
    assert_quiet(stack)


def test_the_router_and_both_worker_processes_freeze_their_start_up_objects(stack):
    """Start-up objects are moved out of the garbage collector's generations before serving
    (services.common.runtime.freeze_startup_objects), in the router, the worker's core and its
    gRPC front end: each logs how many."""
    import re
    for svc in stack.services:
        if svc.name == "adapter_store":
            continue
        counts = [int(n) for n in re.findall(
            r"start-up objects frozen for the garbage collector: (\d+)", svc.log())]
        expected = 2 if svc.name == "worker" else 1      # the worker: its core and front end
        assert len(counts) == expected and all(n > 1000 for n in counts), (svc.name, counts)
