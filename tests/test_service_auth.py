"""Internal calls authenticated by a shared service token (--service-token-file): the router
and the workers send it, the worker and the store refuse calls without it (health checks
excepted), each service says in its log how internal calls are authenticated, and an
unreadable or empty token file is a configuration error."""
from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.client.client import LorafleetClient
from services.common.gen.lorafleet.v1 import (adapter_store_pb2 as spb, adapter_store_pb2_grpc,
                                              worker_pb2 as wpb, worker_pb2_grpc)
from services.common.service_auth import HEADER
from tests.conftest import Stack
from tests.support import DEMO_ADAPTERS, MODEL_DIR, ROOT, Service

pytestmark = pytest.mark.slow
TOKEN = "s3cret-internal-token"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("svc-auth")
    path = tmp / "token"
    path.write_text(TOKEN + "\n")
    flags = ["--service-token-file", str(path)]
    s = Stack(MODEL_DIR, DEMO_ADAPTERS, tmp, worker_args=flags, store_args=flags,
              router_args=flags)
    yield s
    s.terminate()


def test_the_fleet_serves_with_the_token_and_refuses_calls_without_it(stack):
    with LorafleetClient(stack.router.addr) as c:            # router -> worker -> store
        assert c.generate("Hello!", adapter="poet", max_new_tokens=4).token_ids
    good = [(HEADER, TOKEN)]
    with grpc.insecure_channel(stack.workers[0].addr) as ch:
        worker = worker_pb2_grpc.WorkerStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            worker.Info(wpb.WorkerInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            worker.Info(wpb.WorkerInfoRequest(), timeout=10, metadata=[(HEADER, "wrong")])
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert worker.Info(wpb.WorkerInfoRequest(), timeout=10, metadata=good).model_name
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                    timeout=10).status == 1
    with grpc.insecure_channel(stack.store.addr) as ch:
        store = adapter_store_pb2_grpc.AdapterStoreStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            store.Resolve(spb.ResolveRequest(name="poet"), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:           # a stream too
            list(store.Fetch(spb.FetchRequest(id="poet"), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert store.Resolve(spb.ResolveRequest(name="poet"), timeout=10,
                             metadata=good).adapter.id == "poet"
    for service in (stack.store, stack.workers[0]):
        assert "internal calls authenticated by the service token" in service.log()


def test_without_a_token_the_services_say_they_are_open(tmp_path):
    store = Service("adapter_store", ["--model", str(MODEL_DIR), "--db", ":memory:"],
                    tmp_path).wait()
    try:
        assert "internal calls are NOT authenticated" in store.log()
    finally:
        assert store.terminate() == 0


@pytest.mark.parametrize("content", [None, ""])
def test_an_unreadable_or_empty_token_file_exits_2(tmp_path, content):
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    proc = subprocess.run([sys.executable, "-m", "services.adapter_store", "--model",
                           str(MODEL_DIR), "--metrics-port", "0", "--service-token-file",
                           str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--service-token-file" in proc.stderr
