"""grpc.health.v1 and the server interceptor on every service (issue 29, item 1 and 5):
Watch streams (grpc_health's Watch is a coroutine that writes with context.write(); the
interceptor took every stream for an async generator and answered INTERNAL TypeError);
NOT_SERVING observable, by Check and by Watch, for the whole of a drain while in-flight calls
finish (the server used to stop at once, refusing health checks too); reflection behind
--reflection; bytes that are not the method's message answered INVALID_ARGUMENT with no
traceback (gRPC's own decoding answered UNKNOWN and logged an ERROR traceback each)."""
from __future__ import annotations

import hashlib
import json
import queue
import signal
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb, adapter_store_pb2_grpc
from tests.conftest import Stack
from tests.support import DEMO_ADAPTERS, MODEL_DIR, Service
from tests.test_store_support import BASE, StoreClient, peft_config, write_adapter

pytestmark = pytest.mark.slow
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICES = {"router": "lorafleet.v1.GenerationService", "worker": "lorafleet.v1.Worker",
            "adapter_store": "lorafleet.v1.AdapterStore"}
# one method of each service, given bytes that no protobuf parser accepts
MALFORMED = b"\xff\xff\xff\xff\xff"
PROBES = {"router": ("/lorafleet.v1.GenerationService/GenerateStream", True),
          "worker": ("/lorafleet.v1.Worker/Info", False),
          "adapter_store": ("/lorafleet.v1.AdapterStore/Resolve", False)}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    flags = ["--reflection"]
    s = Stack(MODEL_DIR, DEMO_ADAPTERS, tmp_path_factory.mktemp("health"), worker_args=flags,
              router_args=flags, store_args=flags)
    yield s
    s.terminate()


def first_watch(addr: str, service: str = "") -> int:
    with grpc.insecure_channel(addr) as ch:
        call = health_pb2_grpc.HealthStub(ch).Watch(
            health_pb2.HealthCheckRequest(service=service), timeout=5)
        status = next(iter(call)).status
        call.cancel()
        return status


def test_watch_streams_serving_on_every_service(stack):
    for svc in stack.services:
        assert first_watch(svc.addr) == SERVING, svc.name
        assert first_watch(svc.addr, SERVICES[svc.name]) == SERVING, svc.name


def test_reflection_lists_each_service_with_the_flag(stack):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase)
    for svc in stack.services:
        with grpc.insecure_channel(svc.addr) as ch:
            names = set(ProtoReflectionDescriptorDatabase(ch).get_services())
        assert {SERVICES[svc.name], "grpc.health.v1.Health"} <= names, (svc.name, names)


def test_malformed_request_bytes_are_invalid_argument_without_traceback(stack):
    for svc in stack.services:
        method, streaming = PROBES[svc.name]
        with grpc.insecure_channel(svc.addr) as ch:
            call = (ch.unary_stream(method) if streaming else ch.unary_unary(method))
            with pytest.raises(grpc.RpcError) as err:
                result = call(MALFORMED, timeout=10)
                if streaming:
                    list(result)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (svc.name, err.value)
        assert "not a valid" in err.value.details(), err.value.details()
    first_watch(stack.store.addr)                # each service still answers
    for svc in stack.services:
        log = svc.log()
        assert "Traceback" not in log and "DecodeError" not in log, (svc.name, log[-3000:])


def test_reflection_is_off_by_default(tmp_path):
    store = Service("adapter_store", ["--model", str(MODEL_DIR), "--db", ":memory:"],
                    tmp_path).wait()
    try:
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
            ProtoReflectionDescriptorDatabase)
        with grpc.insecure_channel(store.addr) as ch:
            with pytest.raises(grpc.RpcError) as err:
                ProtoReflectionDescriptorDatabase(ch).get_services()
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        assert store.terminate() == 0


# ---- drain ---------------------------------------------------------------------------------

WIDE = {**BASE, "hidden_size": 4096, "intermediate_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 32, "head_dim": 128, "num_hidden_layers": 2}


def big_adapter(folder, r: int = 128) -> None:
    """A 16 MiB adapter on WIDE (q and v, two layers): a Fetch of it outlasts what flow
    control lets the server send ahead to a client that does not read."""
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(2):
        for module in ("q_proj", "v_proj"):
            stem = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{stem}.lora_A.weight"] = rng.standard_normal((r, 4096), np.float32)
            tensors[f"{stem}.lora_B.weight"] = rng.standard_normal((4096, r), np.float32)
    write_adapter(folder, peft_config(r=r, lora_alpha=2 * r), tensors)


def watch_all(addr: str, seen: queue.Queue) -> grpc.Channel:
    ch = grpc.insecure_channel(addr)
    call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))

    def follow():
        try:
            for resp in call:
                seen.put(resp.status)
        except grpc.RpcError as err:
            seen.put(err.code())
        else:
            seen.put(None)                   # the server ended the stream (OK)
    threading.Thread(target=follow, daemon=True).start()
    return ch


def test_not_serving_is_answered_for_the_whole_drain(tmp_path):
    """SIGTERM with a Fetch in flight (its client reads slowly): for as long as it drains, Check
    answers NOT_SERVING, a Watch stream has seen NOT_SERVING, new calls are refused
    UNAVAILABLE; the in-flight Fetch completes intact and the store exits 0."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(WIDE))
    big_adapter(tmp_path / "adapters" / "big")
    store = Service("adapter_store", ["--base-config", str(base / "config.json"),
                                      "--adapters-dir", str(tmp_path / "adapters"),
                                      "--db", ":memory:", "--grace", "20",
                                      "--chunk-bytes", "256KiB"], tmp_path).wait()
    client = StoreClient(store.addr)
    seen: queue.Queue = queue.Queue()
    watch_channel = watch_all(store.addr, seen)
    assert seen.get(timeout=10) == SERVING
    fetch = iter(client.stub.Fetch(spb.FetchRequest(id="big"), timeout=60))
    chunks = [next(fetch)]                               # the header: the call is in flight
    store.proc.send_signal(signal.SIGTERM)
    assert seen.get(timeout=10) == NOT_SERVING           # Watch sees the drain begin
    with grpc.insecure_channel(store.addr) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        other = adapter_store_pb2_grpc.AdapterStoreStub(ch)
        end = time.monotonic() + 2.0
        while time.monotonic() < end:                   # the drain goes on: the Fetch waits
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status \
                == NOT_SERVING
            time.sleep(0.1)
        with pytest.raises(grpc.RpcError) as err:
            other.Resolve(spb.ResolveRequest(name="big"), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert store.proc.poll() is None
    chunks += list(fetch)                                # read the rest: the drain ends
    blob = b"".join(c.data for c in chunks[1:-1])
    assert len(blob) == chunks[0].header.total_bytes > 16 << 20
    assert chunks[-1].sha256 == hashlib.sha256(blob).hexdigest()
    client.close()
    assert store.proc.wait(30) == 0                      # the first SIGTERM's drain ends it
    assert seen.get(timeout=10) is None                  # the Watch stream was ended
    store.terminate()
    watch_channel.close()
    assert "Traceback" not in store.log_path.read_text()
