"""The worker's operator RPCs through a running store and worker: LoadAdapter and Prefetch need
the version to stage (a ref without one staged a copy no request used), OffloadAdapter refuses a
malformed id, and a residency snapshot lists no removed adapters."""
from __future__ import annotations

import grpc
import pytest

from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb
from services.common.gen.lorafleet.v1 import adapter_store_pb2_grpc, common_pb2
from services.common.gen.lorafleet.v1 import worker_pb2 as wpb, worker_pb2_grpc
from tests.support import DEMO_ADAPTERS, MODEL_DIR, Service

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rpcs")
    store = Service("adapter_store", ["--adapters-dir", str(DEMO_ADAPTERS), "--model",
                                      str(MODEL_DIR), "--db", ":memory:"], tmp).wait()
    work = Service("worker", ["--model", str(MODEL_DIR), "--store", store.addr,
                              "--device", "cpu"], tmp).wait()
    with grpc.insecure_channel(store.addr) as ch:         # Resolve: validated, versioned
        stub = adapter_store_pb2_grpc.AdapterStoreStub(ch)
        listed = [stub.Resolve(spb.ResolveRequest(name=a.id), timeout=10).adapter
                  for a in stub.List(spb.ListRequest(all_tenants=True), timeout=10).adapters]
    channel = grpc.insecure_channel(work.addr)
    yield worker_pb2_grpc.WorkerStub(channel), {a.id: a.version for a in listed}
    channel.close()
    assert work.terminate() == 0 and store.terminate() == 0


def ref(name: str, version: str = "") -> wpb.AdapterRef:
    return wpb.AdapterRef(id=name, version=version, tenant="ops")


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_a_ref_without_a_version_is_refused(worker):
    stub, _ = worker
    code, details = code_of(lambda: stub.LoadAdapter(
        wpb.LoadAdapterRequest(adapter=ref("pirate")), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "adapter.version" in details
    code, details = code_of(lambda: stub.Prefetch(
        wpb.PrefetchRequest(adapters=[ref("pirate")]), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "adapters[0].version" in details


def test_offload_refuses_a_malformed_id(worker):
    stub, _ = worker
    code, details = code_of(lambda: stub.OffloadAdapter(
        wpb.OffloadAdapterRequest(id="../x"), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "id" in details
    stub.OffloadAdapter(wpb.OffloadAdapterRequest(id="not-resident"), timeout=30)  # idempotent


def test_snapshot_lists_no_removed_adapters(worker):
    stub, versions = worker
    loaded = stub.LoadAdapter(wpb.LoadAdapterRequest(adapter=ref("poet", versions["poet"])),
                              timeout=60)
    assert loaded.from_tier != common_pb2.TIER_UNSPECIFIED
    stub.OffloadAdapter(wpb.OffloadAdapterRequest(id="poet", to_host=False), timeout=30)
    watch = stub.WatchResidency(wpb.WatchResidencyRequest(), timeout=30)
    snapshot = next(iter(watch))
    watch.cancel()
    assert snapshot.snapshot
    assert all(a.tier != common_pb2.TIER_UNSPECIFIED for a in snapshot.adapters), snapshot
    assert "poet" not in {a.id for a in snapshot.adapters}


def test_a_text_that_cannot_fit_is_refused_unencoded(worker):
    """A prompt text longer than the model could hold whatever its tokens is refused without
    encoding it (encoding 16 MiB on the event loop stalled every stream of the worker for
    18 s); a long text that may fit is encoded (off the loop) to the tokenizer's very ids."""
    stub, _ = worker
    huge = "word " * 2_000_000
    code, details = code_of(lambda: stub.Tokenize(wpb.WorkerTokenizeRequest(text=huge),
                                                  timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "cannot fit" in details
    req = wpb.WorkerGenerateRequest(request_id="huge", text=huge)
    code, details = code_of(lambda: list(stub.Generate(req, timeout=30)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "cannot fit" in details
    from tokenizers import Tokenizer
    long = "The weather is fine today. " * 400                  # 10,800 characters
    ids = stub.Tokenize(wpb.WorkerTokenizeRequest(text=long), timeout=30).token_ids
    assert list(ids) == Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")).encode(long).ids
