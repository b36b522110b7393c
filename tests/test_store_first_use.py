"""Issue 43: an adapter's first use at the limit. One pass over its bytes (header and shapes
before the body, then the digests and the finite check chunk by chunk: first_pass.py), off the
event loop on a pool sized to the machine with a per-tenant share, the bytes landing in the host
tier so the Fetch after it neither reads nor hashes them again; concurrent first uses of one
adapter share one read; a bad adapter in a burst fails alone, with its reason; the digests are
the registry's as before (versions survive a restart). Real store processes on loopback, real
safetensors files; the tenant-share scenario in its own interpreter, its reads held."""
from __future__ import annotations

import hashlib
import io
import json
import pathlib
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from safetensors.numpy import save

from services.adapter_store.first_pass import BlobPass, feed_bytes, read_checked
from services.adapter_store.landing import Destination, ShmLanding
from services.adapter_store.validate import AdapterCheck, canonical_json
from services.common.errors import Refusal
from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb, common_pb2
from tests.support import ROOT, Service
from tests.test_store_support import (StoreClient, good_adapter, key, lora_tensors,
                                      peft_config, sha256, write_adapter, write_base)

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def reference_digests(folder: pathlib.Path) -> tuple[str, str]:
    """(version, sha256) as the registry has always computed them, by hashlib directly."""
    config = canonical_json(json.loads((folder / CONFIG).read_bytes()))
    blob = (folder / WEIGHTS).read_bytes()
    return (hashlib.sha256(config.encode() + b"\n" + blob).hexdigest()[:16], sha256(blob))


# ---- the pass itself --------------------------------------------------------------------------

def mixed_blob(nan_at: int | None = None) -> bytes:
    """An F16 tensor of 3 values (so the F32 tensor after it starts 2 bytes off its values'
    grid), then an F32 tensor of 40 values, NaN at nan_at if given."""
    b = np.arange(40, dtype=np.float32)
    if nan_at is not None:
        b[nan_at] = np.nan
    return save({"a": np.ones(3, dtype=np.float16), "b": b})


def refusal(check: BlobPass, blob: bytes, chunk: int) -> Refusal | None:
    """The pass over blob in pieces of `chunk` bytes: its refusal, or None."""
    try:
        feed_bytes(check, blob, chunk)
    except Refusal as exc:
        return exc
    return None


def assert_nonfinite(exc: Refusal | None, tensor: str, at: int) -> None:
    assert exc is not None and exc.reason == "nonfinite", exc
    assert f"tensor {tensor!r}: 1 NaN/Inf values" in exc.message
    assert f"first at flat index {at}" in exc.message


@pytest.mark.parametrize("helper", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 5, 7, 64, 1 << 20])
def test_the_pass_finds_a_nan_and_digests_alike_whatever_the_chunks(chunk, helper):
    """Pieces that split values, and the blob's SHA-256 hashed here or on a helper thread."""
    beside = ThreadPoolExecutor(1) if helper else None
    for nan_at in (None, 0, 17, 39):
        blob = mixed_blob(nan_at)
        check = BlobPass("{}", lambda tensors: None, helper=beside)
        exc = refusal(check, blob, chunk)
        if nan_at is not None:
            assert_nonfinite(exc, "b", nan_at)
            continue
        assert exc is None
        assert check.finish() == (hashlib.sha256(b"{}\n" + blob).hexdigest()[:16], sha256(blob))


def uniform_blob(dtype, nan_in: str | None, nan_at: int = 0) -> bytes:
    """Three tensors of one dtype (7, 40 and 13 values: a tensor's end between two values of
    the chunk grid), NaN in one of them at nan_at if given."""
    tensors = {"a": np.arange(7, dtype=dtype), "b": np.arange(40, dtype=dtype) / 7,
               "c": -np.arange(13, dtype=dtype)}
    if nan_in is not None:
        tensors[nan_in][nan_at] = np.inf if nan_in == "c" else np.nan
    return save(tensors)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("chunk", [1, 3, 5, 7, 64, 1 << 20])
def test_one_dtype_is_checked_a_chunk_at_a_time_with_the_same_refusals(chunk, dtype):
    """Every tensor of one dtype: the data is checked as one array a chunk (not tensor by
    tensor), and a bad value is still refused naming its tensor and its index there."""
    for nan_in, nan_at in ((None, 0), ("a", 6), ("b", 0), ("b", 39), ("c", 12)):
        blob = uniform_blob(dtype, nan_in, nan_at)
        check = BlobPass("{}", lambda tensors: None)
        exc = refusal(check, blob, chunk)
        assert check._uniform is not None          # (the one-array path was taken)
        if nan_in is not None:
            assert_nonfinite(exc, nan_in, nan_at)
            continue
        assert exc is None
        assert check.finish()[1] == sha256(blob)


def test_a_bad_shape_is_refused_from_the_header_before_the_body_is_read(tmp_path):
    tensors = lora_tensors()
    tensors[key(1, "v_proj", "A")] = np.zeros((4, 32), dtype=np.float32)    # in 64, not 32
    blob = save(tensors)
    f = io.BytesIO(blob)
    check = AdapterCheck(json.dumps(peft_config()).encode(), _base(tmp_path), 128)
    with pytest.raises(Refusal) as err:
        read_checked(f, len(blob), check.blob)
    assert err.value.reason == "shape" and key(1, "v_proj", "A") in err.value.message
    assert f.tell() == 8 + int.from_bytes(blob[:8], "little")               # the header only
    cut = save(lora_tensors())[:-100]                                        # truncated
    check = AdapterCheck(json.dumps(peft_config()).encode(), _base(tmp_path), 128)
    with pytest.raises(Refusal) as err:
        read_checked(io.BytesIO(cut), len(cut), check.blob)
    assert err.value.reason == "truncated"


def test_the_passes_digests_are_the_registrys(tmp_path):
    folder = good_adapter(tmp_path / "a", seed=3)
    blob = (folder / WEIGHTS).read_bytes()
    shm = tmp_path / "shm"
    shm.mkdir()
    for dest in (None, Destination(len(blob)), ShmLanding(shm, "v", len(blob))):
        check = AdapterCheck((folder / CONFIG).read_bytes(), _base(tmp_path), 128)
        read_checked(io.BytesIO(blob), len(blob), check.blob, dest)     # kept, or read through
        summary = check.summary()
        assert (summary.version, summary.sha256) == reference_digests(folder)
        if dest is not None:
            view, name = dest.keep()
            assert bytes(view) == blob and (not name or (shm / name).read_bytes() == blob)
    check = AdapterCheck((folder / CONFIG).read_bytes(), _base(tmp_path), 128)
    feed_bytes(check.blob, blob)
    assert (check.summary().version, check.summary().sha256) == reference_digests(folder)


def _base(tmp_path: pathlib.Path):
    from services.adapter_store.validate import load_base_shapes
    return load_base_shapes(write_base(tmp_path / "base"))


# ---- through the store process ----------------------------------------------------------------

def fleet(root: pathlib.Path, n: int) -> pathlib.Path:
    """n good adapters g0.. with distinct bytes."""
    for i in range(n):
        good_adapter(root / f"g{i}", seed=i)
    return root


def start(tmp: pathlib.Path, adapters: pathlib.Path, *args: str, db: str = ":memory:"
          ) -> tuple[Service, StoreClient, pathlib.Path, pathlib.Path]:
    shm, traces = tmp / "shm", tmp / f"spans-{time.monotonic_ns()}.jsonl"
    shm.mkdir(exist_ok=True)
    store = Service("adapter_store", [
        "--base-config", str(write_base(tmp / "base")), "--adapters-dir", str(adapters),
        "--db", db, "--shm-dir", str(shm), "--trace-file", str(traces),
        "--background-validate-threads", "0", *args], tmp).wait()
    return store, StoreClient(store.addr), shm, traces


def spans(traces: pathlib.Path, name: str) -> list[dict]:
    if not traces.exists():
        return []
    return [s for s in map(json.loads, traces.read_text().splitlines()) if s["name"] == name]


def test_a_burst_reads_each_adapter_once_and_its_fetches_serve_those_bytes(tmp_path):
    adapters = fleet(tmp_path / "adapters", 6)
    store, client, shm, traces = start(tmp_path, adapters, "--first-use-threads", "4")
    names = [f"g{i}" for i in range(6)]

    def use(call: tuple[str, int]):
        name, k = call
        if k % 2:
            return name, client.resolve(name, tenant=f"t{k}").version
        chunks = list(client.stub.Fetch(spb.FetchRequest(id=name, shm=True), timeout=30))
        return name, (chunks[0].header, chunks[-1].sha256)
    try:
        with ThreadPoolExecutor(24) as pool:
            answers = list(pool.map(use, [(n, k) for k in range(4) for n in names]))
        for name in names:
            version, sha = reference_digests(adapters / name)
            got = [a for n, a in answers if n == name]
            assert {a if isinstance(a, str) else a[0].adapter.version for a in got} == {version}
            fetched = [a for a in got if not isinstance(a, str)]
            tiers = sorted(header.tier for header, _ in fetched)    # the first one: SOURCE
            assert tiers == [common_pb2.STORE_HOST] * (len(fetched) - 1) + [common_pb2.SOURCE]
            for header, digest in fetched:
                assert digest == sha
                assert (shm / header.shm_file).read_bytes() == (adapters / name / WEIGHTS
                                                                ).read_bytes()
            assert client.resolve(name).state == "READY"
        log = store.log()
        for name in names:                      # one read and validation each
            assert log.count(f"adapter {name!r} validated on first use") == 1, name
        reads = [s["attributes"]["lora.source"] for s in spans(traces, "store.validate")]
        assert sorted(reads) == sorted(f"file://{n}" for n in names)
        assert spans(traces, "store.source_read") == []       # no second read for a Fetch
        again = list(client.stub.Fetch(spb.FetchRequest(id="g0"), timeout=30))   # a stream
        assert b"".join(c.data for c in again[1:-1]) == (adapters / "g0" / WEIGHTS).read_bytes()
        assert again[0].header.tier == common_pb2.STORE_HOST
        stats = client.stats()          # each adapter's first Fetch: a source load, a miss
        assert (stats.host_misses, stats.source_loads.count) == (6, 6)
    finally:
        client.close()
        assert store.terminate() == 0


def bad_fleet(root: pathlib.Path) -> dict[str, str]:
    """Bad adapters beside good ones (config fine: only their weights tell): name -> the
    reason's words."""
    cfg = peft_config()
    nan = lora_tensors()
    nan[key(0, "q_proj", "B")][3, 1] = np.nan
    write_adapter(root / "nan", cfg, nan)
    shape = lora_tensors()
    shape[key(1, "v_proj", "A")] = np.zeros((4, 32), dtype=np.float32)
    write_adapter(root / "shape", cfg, shape)
    write_adapter(root / "truncated", cfg, blob=save(lora_tensors())[:-100])
    return {"nan": "NaN/Inf", "shape": "shape [4, 32], expected [4, 64]", "truncated": "truncated"}


def test_bad_adapters_in_a_burst_fail_with_their_reasons_and_leave_the_others_be(tmp_path):
    adapters = fleet(tmp_path / "adapters", 5)
    bad = bad_fleet(adapters)
    store, client, shm, _ = start(tmp_path, adapters)
    names = sorted(p.name for p in adapters.iterdir())
    try:
        with ThreadPoolExecutor(len(names) * 2) as pool:
            outcomes = list(pool.map(lambda n: (n, client.error(client.resolve, n)
                                                if n in bad else client.resolve(n).state),
                                     names * 2))
        for name, got in outcomes:
            if name in bad:
                code, details = got
                assert code == grpc.StatusCode.FAILED_PRECONDITION, (name, details)
                assert bad[name] in details, (name, details)
            else:
                assert got == "READY", name
        files = sorted(p.name for p in shm.iterdir())
        assert len(files) == 5 and not [f for f in files if f.endswith(".tmp")]
        for name in (n for n in names if n not in bad):
            _, blob, digest = client.fetch(name)
            assert blob == (adapters / name / WEIGHTS).read_bytes() and digest == sha256(blob)
    finally:
        client.close()
        assert store.terminate() == 0


def test_first_use_digests_are_the_registrys_and_survive_a_restart(tmp_path):
    adapters = fleet(tmp_path / "adapters", 2)
    from services.adapter_store.sources import SETTLED_S
    time.sleep(SETTLED_S + 0.1)        # the files' identities are kept once this old
    db = str(tmp_path / "state" / "registry.sqlite")
    store, client, _, _ = start(tmp_path, adapters, db=db)
    before = {n: client.resolve(n) for n in ("g0", "g1")}
    client.close()
    assert store.terminate() == 0
    for name, rec in before.items():
        assert rec.version == reference_digests(adapters / name)[0]
    store, client, _, traces = start(tmp_path, adapters, db=db)
    try:
        for name, rec in before.items():
            again = client.resolve(name)
            assert (again.state, again.version) == ("READY", rec.version)
            header, blob, digest = client.fetch(name)        # a source read, checked
            assert header.tier == common_pb2.SOURCE and digest == reference_digests(
                adapters / name)[1] and blob == (adapters / name / WEIGHTS).read_bytes()
        assert spans(traces, "store.validate") == []          # nothing validated again
    finally:
        client.close()
        assert store.terminate() == 0


# ---- one tenant's burst and another's first use -----------------------------------------------

def test_one_tenants_burst_leaves_another_tenant_its_first_use(tmp_path):
    """In its own interpreter (the store's metrics apart from other in-process tests): alice's
    burst of 4 first uses, on a pool of 4 threads with 2 a tenant, has 2 reads held and 2
    waiting; bob's first use meanwhile goes through; then alice's finish."""
    code = ("import json, sys; from tests.test_store_first_use import tenant_burst; "
            "print(json.dumps(tenant_burst(sys.argv[1])))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["bob"] == "READY"
    assert got["while_bob"] == {"alice_running": 2, "alice_waiting": 2, "alice_done": 0}
    assert got["alice"] == ["READY"] * 4
    assert got["threads"] and all(t.startswith("store-first-use") for t in got["threads"])


def tenant_burst(tmp: str) -> dict:
    """The scenario of the test above."""
    import asyncio
    import threading
    from services.adapter_store.host_cache import HostCache
    from services.adapter_store.registry import Registry
    from services.adapter_store.scan import scan_dir
    from services.adapter_store.sources import SourceReader
    from services.adapter_store.store import AdapterStore
    from services.adapter_store.work_pool import ValidationPool

    root = pathlib.Path(tmp)
    adapters = fleet(root / "adapters", 5)
    base = _base(root)
    release, entered, threads = threading.Event(), threading.Semaphore(0), []

    class HeldReader(SourceReader):
        def open_weights(self, ref, *args, **kwargs):
            threads.append(threading.current_thread().name)
            if ref.uri != "file://g4":                       # alice's: held
                entered.release()
                assert release.wait(30)
            return super().open_weights(ref, *args, **kwargs)

    async def run():
        registry = Registry(":memory:")
        reader = HeldReader(adapters, None, 1 << 30)
        scan_dir(registry, reader, base, 128, adapters, 2)
        pool = ValidationPool(4, 2, name="store-first-use")
        store = AdapterStore(base, registry, reader, HostCache(1 << 30, None), 128, None,
                             first_use=pool)
        alice = [asyncio.ensure_future(store.resolve(f"g{i}", "alice", 30)) for i in range(4)]
        for _ in range(2):
            assert await asyncio.to_thread(entered.acquire, True, 30)
        bob = await store.resolve("g4", "bob", 30)
        meanwhile = {"alice_running": pool.busy("alice"), "alice_waiting": pool.waiting("alice"),
                     "alice_done": sum(a.done() for a in alice)}
        release.set()
        done = await asyncio.gather(*alice)
        store.close()
        return bob.state, meanwhile, [r.state for r in done]

    bob, meanwhile, alice = asyncio.run(run())
    return {"bob": bob, "while_bob": meanwhile, "alice": alice, "threads": threads}


def test_adapters_of_one_header_check_it_once_and_a_bad_one_every_time(tmp_path, monkeypatch):
    """AdapterCheck keeps a checked header (the adapters of one fleet share theirs): the
    second adapter of one shape and config skips the tensor checks and gets the same tensors;
    a header that fails is refused each time it comes (nothing kept of it); another config
    (another rank) checks again."""
    from services.adapter_store import validate
    base = validate.BaseShapes(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
                               head_dim=16)
    monkeypatch.setattr(validate, "_HEADERS", {})     # (other tests' headers kept)
    calls = []
    real = validate.AdapterCheck._check_tensors
    monkeypatch.setattr(validate.AdapterCheck, "_check_tensors",
                        lambda self, t: (calls.append(len(t)), real(self, t))[1])
    config = json.dumps(peft_config()).encode()
    blob = save(lora_tensors())
    head = blob[:8 + int.from_bytes(blob[:8], "little")]
    first, second = (validate.AdapterCheck(config, base, 64) for _ in range(2))
    first.blob.header(head, len(blob))
    second.blob.header(head, len(blob))
    assert len(calls) == 1 and second.blob.tensors == first.blob.tensors
    bad_tensors = lora_tensors()
    bad_tensors[key(1, "v_proj", "A")] = np.zeros((4, 32), dtype=np.float32)
    bad = save(bad_tensors)
    bad_head = bad[:8 + int.from_bytes(bad[:8], "little")]
    for _ in range(2):
        with pytest.raises(Refusal, match="shape"):
            validate.AdapterCheck(config, base, 64).blob.header(bad_head, len(bad))
    assert len(calls) == 3
    other = json.dumps(peft_config(r=8)).encode()
    with pytest.raises(Refusal, match="shape"):
        validate.AdapterCheck(other, base, 64).blob.header(head, len(blob))
    assert len(calls) == 4
