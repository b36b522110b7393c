"""The cold path's parts on their own: the worker's host tier (an arena with LRU, pins and
fragmentation), the worker's store client against a real gRPC server on loopback that lies
(bad digest, too many bytes, a stream cut short, a shared-memory file that is gone), and the
store's shared-memory host tier (files appear, match the stream, go with eviction, stale ones
of a dead store are cleared)."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest
import torch

from services.common.errors import DataLoss, InvalidArgument
from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb
from services.common.gen.lorafleet.v1 import adapter_store_pb2_grpc, common_pb2
from services.worker.adapters.host_tier import HostTier
from services.worker.adapters.layout import staged_from_peft_dir
from services.worker.adapters.store_client import StoreClient
from services.worker.model.spec import load_spec
from tests.support import DEMO_ADAPTERS, MODEL_DIR, Service
from tests.test_store_support import StoreClient as StoreApi, sha256

SPEC = load_spec(MODEL_DIR)
ADAPTER = DEMO_ADAPTERS / "pirate"
BLOB = (ADAPTER / "adapter_model.safetensors").read_bytes()
CONFIG = json.loads((ADAPTER / "adapter_config.json").read_text())


def _fill(tier: HostTier, key: str, tenant: str = "t"):
    res, victims = tier.reserve(key, tenant, len(BLOB))
    res.view.copy_(torch.frombuffer(bytearray(BLOB), dtype=torch.uint8))
    staged = tier.commit(res, CONFIG)
    tier.unpin(key)
    return staged, victims, res


def test_host_tier_keeps_staged_adapters_in_its_arena_and_evicts_the_least_recent():
    tier = HostTier(2 * len(BLOB) + 4096, None, pin=False, spec=SPEC)
    a, _, res_a = _fill(tier, "a")
    plan = staged_from_peft_dir(ADAPTER, SPEC).plan
    assert res_a.cached and a.plan.numel == plan.numel and (a.plan.segs == plan.segs).all()
    assert bytes(a.blob.numpy()) == BLOB
    _fill(tier, "b")
    assert tier.lookup("a") is not None                 # a is now the most recent
    _, victims, _ = _fill(tier, "c")
    assert victims == ["b"] and "b" not in tier and len(tier) == 2
    assert tier.free_bytes < len(BLOB)


def test_host_tier_never_evicts_a_pinned_entry_and_serves_it_uncached_instead():
    tier = HostTier(len(BLOB) + 64, None, pin=False, spec=SPEC)
    _fill(tier, "a")
    assert tier.lookup("a", pin=True) is not None       # a placement is copying it
    res, victims = tier.reserve("b", "t", len(BLOB))
    assert not res.cached and victims == [] and "a" in tier
    res.view.copy_(torch.frombuffer(bytearray(BLOB), dtype=torch.uint8))
    staged = tier.commit(res, CONFIG)
    assert "b" not in tier and staged.nbytes == len(BLOB)
    tier.unpin("a")
    assert not tier.remove("missing") and tier.remove("a") and len(tier) == 0


def test_a_failed_fetch_gives_its_reservation_back():
    tier = HostTier(len(BLOB) + 64, None, pin=False, spec=SPEC)
    free = tier.free_bytes
    res, _ = tier.reserve("a", "t", len(BLOB))
    assert tier.free_bytes < free
    tier.abort(res)
    assert tier.free_bytes == free and "a" not in tier
    res, _ = tier.reserve("a", "t", len(BLOB))
    res.view.fill_(0)                                      # not a safetensors file
    with pytest.raises(InvalidArgument, match="header length"):
        tier.commit(res, CONFIG)
    assert tier.free_bytes == free and "a" not in tier


class _LyingStore(adapter_store_pb2_grpc.AdapterStoreServicer):
    """A store whose Fetch misbehaves as `mode` says."""

    def __init__(self):
        self.mode, self.calls = "ok", []

    def Fetch(self, request, context):
        self.calls.append(request.shm)
        header = spb.AdapterHeader(config_json=json.dumps(CONFIG), total_bytes=len(BLOB),
                                   tier=common_pb2.STORE_HOST)
        if request.shm and self.mode == "gone":
            header.shm_file = "lorafleet-store-1-00000000-gone"
            yield spb.FetchChunk(header=header)
            yield spb.FetchChunk(sha256=sha256(BLOB))
            return
        yield spb.FetchChunk(header=header)
        data = BLOB + (b"x" if self.mode == "long" else b"")
        if self.mode == "short":
            data = data[:100]
        for at in range(0, len(data), 1 << 16):
            yield spb.FetchChunk(data=data[at:at + (1 << 16)])
        digest = sha256(b"other") if self.mode == "digest" else sha256(BLOB)
        yield spb.FetchChunk(sha256=digest)


@pytest.fixture
def lying_store(tmp_path):
    server = grpc.server(futures.ThreadPoolExecutor(2))
    store = _LyingStore()
    adapter_store_pb2_grpc.add_AdapterStoreServicer_to_server(store, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield store, channel, tmp_path
    channel.close()
    server.stop(0)


def _reserve_in(tier: HostTier, made: list):
    def reserve(n):
        made.append(tier.reserve("k", "t", n)[0])
        return made[-1]
    return reserve


def test_the_store_client_checks_what_it_is_streamed(lying_store):
    store, channel, _ = lying_store
    client = StoreClient(channel)
    tier, made = HostTier(4 * len(BLOB), None, pin=False, spec=SPEC), []
    free = tier.free_bytes
    fetched, res = client.fetch("pirate", "v", 10, _reserve_in(tier, made))
    assert bytes(res.view.numpy()) == BLOB and fetched.digest_s > 0 and not fetched.shm
    tier.abort(res)
    for mode, message in (("digest", "digest mismatch"), ("long", "more bytes"),
                          ("short", "ended early")):
        store.mode = mode
        with pytest.raises(DataLoss, match=message):
            client.fetch("pirate", "v", 10, _reserve_in(tier, made))
        tier.abort(made[-1])
        assert tier.free_bytes == free


def test_a_shared_memory_file_that_is_gone_is_fetched_again_as_a_stream(lying_store):
    store, channel, shm = lying_store
    store.mode = "gone"
    tier = HostTier(2 * len(BLOB), None, pin=False, spec=SPEC)
    fetched, res = StoreClient(channel, shm_dir=str(shm)).fetch("pirate", "v", 10,
                                                                 _reserve_in(tier, []))
    assert store.calls == [True, False] and not fetched.shm and fetched.digest_s > 0
    assert bytes(res.view.numpy()) == BLOB


def validated(api: StoreApi, name: str, timeout: float = 20.0) -> str:
    """The adapter's version once the store's background validation made it READY (without a
    first use, which would leave its bytes in the host tier)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = {a.id: a for a in api.list(all_tenants=True)}
        if found[name].state == "READY":
            return found[name].version
        time.sleep(0.05)
    raise AssertionError(f"{name} still {found[name].state} after {timeout} s")


def test_the_store_keeps_its_host_tier_in_shared_memory(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    stale = shm / "lorafleet-store-999999-deadbeef-0123"       # a store long gone
    stale.write_bytes(b"old")
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    shutil.copytree(ADAPTER, adapters / "pirate")
    store = Service("adapter_store", ["--model", str(MODEL_DIR), "--db", ":memory:",
                                      "--adapters-dir", str(adapters), "--shm-dir", str(shm)],
                    tmp_path).wait()
    api = StoreApi(store.addr)
    try:
        assert not stale.exists()
        chunks = list(api.stub.Fetch(spb.FetchRequest(id="pirate", shm=True), timeout=10))
        header = chunks[0].header
        assert header.tier == common_pb2.SOURCE and header.shm_file
        version = api.resolve("pirate").version
        assert [c.WhichOneof("part") for c in chunks[1:]] == ["sha256"]
        assert (shm / header.shm_file).read_bytes() == BLOB
        assert chunks[1].sha256 == hashlib.sha256(BLOB).hexdigest()
        _, streamed, _ = api.fetch("pirate")                      # without shm: a stream
        assert streamed == BLOB
        again = list(api.stub.Fetch(spb.FetchRequest(id="pirate", shm=True), timeout=10))
        assert again[0].header.tier == common_pb2.STORE_HOST
        assert again[0].header.shm_file == header.shm_file and version in header.shm_file
        api.delete("pirate")
        assert not (shm / header.shm_file).exists()
    finally:
        api.close()
        assert store.terminate() == 0
    assert not list(shm.glob("lorafleet-store-*"))               # nothing left behind


@pytest.mark.parametrize("shm", [True, False])
def test_a_local_source_changed_since_registration_is_data_loss(tmp_path, shm):
    """A local blob is hashed as it is read into its place in the host tier: bytes that no
    longer match the registration (for an adapter of --adapters-dir, its validation in the
    background, which keeps nothing in the host tier) are refused DATA_LOSS and leave nothing
    behind (no file in the shared-memory directory, not even the half-written one); put back,
    they serve."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    adapters = tmp_path / "adapters"
    shutil.copytree(ADAPTER, adapters / "pirate")
    weights = adapters / "pirate" / "adapter_model.safetensors"
    store = Service("adapter_store", ["--model", str(MODEL_DIR), "--db", ":memory:",
                                      "--adapters-dir", str(adapters),
                                      *(["--shm-dir", str(shm_dir)] if shm else [])],
                    tmp_path).wait()
    api = StoreApi(store.addr)
    try:
        assert validated(api, "pirate")
        flipped = bytearray(BLOB)
        flipped[-1] ^= 1                                           # same size, one bit
        for changed in (bytes(flipped), BLOB[:-7]):               # ... and a shorter file
            weights.write_bytes(changed)
            with pytest.raises(grpc.RpcError) as err:
                list(api.stub.Fetch(spb.FetchRequest(id="pirate", shm=shm), timeout=10))
            assert err.value.code() == grpc.StatusCode.DATA_LOSS
            assert "re-register" in err.value.details()
            assert list(shm_dir.iterdir()) == []
        weights.write_bytes(BLOB)
        chunks = list(api.stub.Fetch(spb.FetchRequest(id="pirate", shm=shm), timeout=10))
        assert chunks[0].header.tier == common_pb2.SOURCE
        if shm:
            assert (shm_dir / chunks[0].header.shm_file).read_bytes() == BLOB
            assert [p.name for p in shm_dir.iterdir()] == [chunks[0].header.shm_file]
        else:
            assert b"".join(c.data for c in chunks[1:]) == BLOB
        assert chunks[-1].sha256 == hashlib.sha256(BLOB).hexdigest()
    finally:
        api.close()
        assert store.terminate() == 0


def test_read_into_hashes_what_it_reads_chunk_by_chunk(tmp_path, monkeypatch):
    from services.adapter_store import landing, sources
    monkeypatch.setattr(landing, "CHUNK", 4096)
    data = os.urandom(4096 * 5 + 123)
    path = tmp_path / "blob"
    path.write_bytes(data)
    for size in (len(data), len(data) + 1000):                    # the file shorter than said
        dest = sources.Destination(size)
        with open(path, "rb") as f:
            digest = sources.read_into(f, size, dest)
        assert bytes(dest.view) == data and digest == hashlib.sha256(data).hexdigest()


def test_a_verified_file_is_read_again_without_hashing_only_while_unchanged(tmp_path):
    """The identity a hashed read saw (device, inode, size, mtime, ctime) lets the next read
    of the same file skip the hash; any write to the file changes it, and the read hashes."""
    from services.adapter_store import sources
    shutil.copytree(ADAPTER, tmp_path / "pirate")
    ref = sources.parse_source("file://pirate", None)
    fresh = sources.SourceReader(tmp_path, None, 1 << 30)            # settled after 2 s
    assert fresh.read(ref, landing=sources.Destination).identity is None    # just copied
    reader = sources.SourceReader(tmp_path, None, 1 << 30, settled_s=0)
    first = reader.read(ref, landing=sources.Destination)
    assert first.sha256 == hashlib.sha256(BLOB).hexdigest() and first.identity
    again = reader.read(ref, landing=sources.Destination, trusted=first.identity)
    assert again.trusted and again.sha256 == "" and bytes(again.blob) == BLOB
    weights = tmp_path / "pirate" / "adapter_model.safetensors"
    weights.write_bytes(BLOB)                                     # same bytes, written again
    rewritten = reader.read(ref, landing=sources.Destination, trusted=first.identity)
    assert not rewritten.trusted and rewritten.sha256 == first.sha256
    assert rewritten.identity != first.identity


def test_a_bad_shm_dir_is_refused_at_start(tmp_path):
    for service, flag in (("adapter_store", "--shm-dir"), ("worker", "--store-shm-dir")):
        run = subprocess.run([sys.executable, "-m", f"services.{service}", "--model",
                              str(MODEL_DIR), flag, str(tmp_path / "none")],
                             capture_output=True, text=True, timeout=60,
                             cwd=pathlib.Path(__file__).resolve().parent.parent)
        assert run.returncode == 2 and "not a directory" in run.stderr, run.stderr[-500:]


@pytest.mark.parametrize("shm,placement", [(True, "inline"), (False, "loader")])
def test_a_worker_loads_through_shared_memory_or_a_stream_and_records_every_stage(
        tmp_path, shm, placement):
    """The worker's cold loads stage by stage (WorkerInfoResponse.cold_load_records): from the
    source, the store's host tier, its own host tier; through the store's shared memory (no
    digest: the bytes never left host memory) or a stream (digest checked). A load that fetches
    runs on a loader thread (its handoff is timed); one from the worker's host tier is placed on
    the event loop (no handoff), or with --host-placement loader on a loader thread too."""
    from services.common.gen.lorafleet.v1 import worker_pb2 as wpb, worker_pb2_grpc
    adapters, shm_dir = tmp_path / "adapters", tmp_path / "shm"
    adapters.mkdir()
    shm_dir.mkdir()
    shutil.copytree(ADAPTER, adapters / "pirate")
    store = Service("adapter_store", ["--model", str(MODEL_DIR), "--db", ":memory:",
                                      "--adapters-dir", str(adapters), "--shm-dir", str(shm_dir)],
                    tmp_path).wait()
    worker = Service("worker", ["--model", str(MODEL_DIR), "--store", store.addr,
                                "--device", "cpu", "--host-placement", placement] +
                     (["--store-shm-dir", str(shm_dir)] if shm else []), tmp_path).wait()
    try:
        version = validated(StoreApi(store.addr), "pirate")     # in the background
        with grpc.insecure_channel(worker.addr) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            ref = wpb.AdapterRef(id="pirate", version=version, tenant="t")
            tiers = []
            for to_host in (None, False, True):          # source, store host, worker host
                if to_host is not None:
                    stub.OffloadAdapter(wpb.OffloadAdapterRequest(id="pirate", to_host=to_host),
                                        timeout=10)
                tiers.append(stub.LoadAdapter(wpb.LoadAdapterRequest(adapter=ref),
                                              timeout=30).from_tier)
            info = stub.Info(wpb.WorkerInfoRequest(cold_load_records=True), timeout=10)
            later = stub.Info(wpb.WorkerInfoRequest(cold_load_records=True, cold_loads_since=2),
                              timeout=10)
            plain = stub.Info(wpb.WorkerInfoRequest(), timeout=10)
    finally:
        worker.terminate()
        store.terminate()
    assert tiers == [common_pb2.SOURCE, common_pb2.STORE_HOST, common_pb2.WORKER_HOST]
    recs = list(info.cold_load_records)
    assert [r.seq for r in recs] == [1, 2, 3] and info.cold_load_seq == 3
    assert [r.seq for r in later.cold_load_records] == [3]
    assert not plain.cold_load_records and plain.cold_load_seq == 3      # asked for none
    assert [r.tier for r in recs] == tiers and all(r.adapter_id == "pirate" for r in recs)
    for r in recs:
        assert r.bytes == len(BLOB) and r.total_s > 0 and r.host_to_device_s > 0
        assert r.end_unix_s > 0
        # its parts: a CPU worker copies inline (no device wait); one load at a time here, so
        # any wait for the copy path is short, and within the stage
        assert r.device_s == 0 and 0 <= r.copy_wait_s < r.host_to_device_s
        assert 0 < r.launch_s < r.host_to_device_s
    source, store_host, worker_host = recs
    assert source.source_s > 0 and store_host.source_s == 0
    for r in (source, store_host):
        assert r.fetch_s > 0 and r.layout_s > 0
        assert (r.digest_s == 0) == shm
    assert worker_host.fetch_s == 0 and worker_host.digest_s == 0
    assert source.handoff_s > 0 and store_host.handoff_s > 0
    assert (worker_host.handoff_s == 0) == (placement == "inline")


def test_a_blob_the_store_cannot_keep_is_streamed_not_named(tmp_path):
    """A host tier too small for the adapter keeps no file: a shared-memory Fetch gets the
    bytes as a stream (no shm_file pointing at a file already gone)."""
    shm, adapters = tmp_path / "shm", tmp_path / "adapters"
    shm.mkdir()
    adapters.mkdir()
    shutil.copytree(ADAPTER, adapters / "pirate")
    store = Service("adapter_store", ["--model", str(MODEL_DIR), "--db", ":memory:",
                                      "--adapters-dir", str(adapters), "--shm-dir", str(shm),
                                      "--host-cache-bytes", "1KiB"], tmp_path).wait()
    api = StoreApi(store.addr)
    try:
        chunks = list(api.stub.Fetch(spb.FetchRequest(id="pirate", shm=True), timeout=10))
        assert not chunks[0].header.shm_file
        assert b"".join(c.data for c in chunks[1:-1]) == BLOB
        assert not list(shm.glob("lorafleet-store-*"))
    finally:
        api.close()
        store.terminate()


def test_host_tier_loads_that_arrive_together_place_one_on_the_event_loop():
    """Loads from the worker's host tier are placed on the event loop, at most one a loop
    iteration: of three that arrive together the first is placed there (no handoff) and the
    others on loader threads, so a burst never holds the loop for more than one placement; a
    load that comes alone later is placed on the loop again. With host_placement="loader" none
    is. Every one is usable (a slot, its tier WORKER_HOST), and none called the store (its
    address is a closed loopback port)."""
    import asyncio
    from services.common.server import sync_channel
    from services.worker.adapters.device_pool import DevicePool
    from services.worker.adapters.manager import AdapterManager

    def run(placement: str) -> dict[str, float]:
        host = HostTier(5 * len(BLOB) + (1 << 16), None, pin=False, spec=SPEC)
        for name in "abcd":
            _fill(host, f"{name}@v1")
        pool = DevicePool(SPEC, torch.device("cpu"), torch.float32, 64 << 20, 8)
        mgr = AdapterManager(pool, SPEC, host, StoreClient(sync_channel("127.0.0.1:1")), None,
                             host_placement=placement)

        async def loads():
            together = await asyncio.gather(*(mgr.acquire(n, "v1", "t", None) for n in "abc"))
            return together + [await mgr.acquire("d", "v1", "t", None)]
        got = asyncio.run(loads())
        assert all(a.tier == common_pb2.WORKER_HOST and pool.slot_of(a.key) == a.slot
                   for a in got)
        recs = mgr.log.since(0)
        assert len(recs) == 4 and all(r.tier == common_pb2.WORKER_HOST for r in recs)
        return {r.adapter_id: r.handoff_s for r in recs}

    inline = run("inline")
    assert inline["a"] == 0 and inline["d"] == 0, inline
    assert inline["b"] > 0 and inline["c"] > 0, inline
    assert all(h > 0 for h in run("loader").values())
