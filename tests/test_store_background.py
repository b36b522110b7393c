"""Issue 43: the store validates its REGISTERED --adapters-dir adapters in the background once it
is SERVING (services/adapter_store/background.py), as their first use would: READY with their
version, or FAILED with the reason, before anyone asks; SERVING first, the store answering
meanwhile; a first use during it shares the validation; --background-validate-threads 0 leaves
them REGISTERED; a restart with the kept --db reads nothing that is READY and unchanged. Real
store processes on loopback, the tiny model's pirate adapter hard-linked K times."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc

from bench.stack.registry import FILES, SEED, adapter_id, make_fleet
from services.adapter_store.sources import SETTLED_S
from tests.support import FreePort, MODEL_DIR, ROOT, Service
from tests.test_store_support import StoreClient

SHAPE = 7                   # the adapter whose lora_A has the wrong width


def fleet(tmp, n: int, nan=(), shape=()):
    """n adapters a00000..; those in `nan` hold a NaN, those in `shape` a tensor of the wrong
    shape (both found only by reading the weights)."""
    adapters = make_fleet(tmp / "fleet", n, nan=tuple(nan))
    from safetensors.numpy import load_file, save_file
    for i in shape:
        weights = adapters / adapter_id(i) / FILES[1]
        tensors = load_file(str(weights))
        name = next(k for k in sorted(tensors) if "lora_A" in k)
        tensors[name] = tensors[name][:, : tensors[name].shape[1] // 2].copy()
        weights.unlink()
        save_file(tensors, str(weights))
    return adapters


def start(tmp, adapters, *args, db: str = ":memory:") -> tuple[Service, StoreClient, int]:
    metrics_port = FreePort()
    store = Service("adapter_store", ["--model", str(MODEL_DIR), "--adapters-dir", str(adapters),
                                      "--db", db, "--metrics-port", metrics_port, *args],
                    tmp).wait(timeout=30)
    return store, StoreClient(store.addr), metrics_port


def states(client: StoreClient) -> dict[str, tuple[str, str, str]]:
    return {a.id: (a.state, a.failure_reason, a.version)
            for a in client.list(all_tenants=True)}


def settled(client: StoreClient, timeout: float = 20.0) -> dict[str, tuple[str, str, str]]:
    """The states once none is REGISTERED (no request made but List)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        now = states(client)
        if all(state != "REGISTERED" for state, *_ in now.values()):
            return now
        time.sleep(0.1)
    raise AssertionError(f"still REGISTERED after {timeout} s: {now}")


def finished(store: Service, timeout: float = 20.0) -> str:
    """The store's log once the background validation has gone through every adapter."""
    end = time.monotonic() + timeout
    while "background validation finished" not in (log := store.log()):
        assert time.monotonic() < end, log[-2000:]
        time.sleep(0.1)
    return log


def background_metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {m[1]: float(m[2]) for m in re.finditer(
        r'^lorafleet_store_background_validations_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}
    out["left"] = float(re.search(r"^lorafleet_store_background_left (\S+)$", text, re.M)[1])
    return out


def test_every_adapter_is_validated_before_anyone_asks(tmp_path):
    adapters = fleet(tmp_path, 12, nan=(3,), shape=(SHAPE,))
    store, client, port = start(tmp_path, adapters)
    try:
        now = settled(client)
        bad = {adapter_id(3): "NaN", adapter_id(SHAPE): "shape"}
        for name, (state, reason, version) in now.items():
            if name in bad:
                assert state == "FAILED" and bad[name] in reason, (name, reason)
            else:
                assert state == "READY" and reason == "" and version, (name, state)
        assert len({v for s, _, v in now.values() if s == "READY"}) == 1    # one seed's bytes
        assert background_metrics(port) == {"ready": 10, "failed": 2, "error": 0,
                                            "skipped": 0, "left": 0}
        code, details = client.error(client.resolve, adapter_id(3))    # as a first use says
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "NaN" in details
        assert client.resolve(adapter_id(0)).version == now[adapter_id(0)][2]
        assert "background validation finished: 12 of 12" in store.log()
    finally:
        client.close()
        assert store.terminate() == 0


def test_serving_comes_first_and_the_store_answers_meanwhile(tmp_path):
    adapters = fleet(tmp_path, 16)             # 16 x 0.53 MB at 3 MiB/s: about 2.7 s
    store, client, _ = start(tmp_path, adapters, "--background-validate-bytes-per-s", "3MiB")
    try:
        assert "REGISTERED" in {s for s, *_ in states(client).values()}   # SERVING first
        seen_partial = False
        end = time.monotonic() + 20
        while time.monotonic() < end:
            t0 = time.monotonic()
            now = states(client)
            assert time.monotonic() - t0 < 1.0            # List answers while it runs
            ready = sum(s == "READY" for s, *_ in now.values())
            seen_partial |= 0 < ready < len(now)
            if ready == len(now):
                break
            time.sleep(0.1)
        assert seen_partial and ready == 16, now
    finally:
        client.close()
        assert store.terminate() == 0


def big_adapter(folder, r: int = 2048) -> None:
    """The pirate adapter's shape at rank r (67 MB at 2048: its validation takes a while)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(SEED / FILES[1]))
    for f in FILES:
        (folder / f).unlink()
    save_file({k: np.full((r, v.shape[1]) if "lora_A" in k else (v.shape[0], r), 1e-3,
                          np.float32) for k, v in tensors.items()}, str(folder / FILES[1]))
    config = json.loads((SEED / FILES[0]).read_text())
    (folder / FILES[0]).write_text(json.dumps({**config, "r": r}))


def test_a_first_use_meanwhile_gets_its_answer_from_one_validation(tmp_path):
    n = 8
    adapters = fleet(tmp_path, n)
    big_adapter(adapters / adapter_id(0))      # the first the background reads (id order)
    store, client, port = start(tmp_path, adapters, "--log-level", "DEBUG", "--max-rank", "2048")
    try:
        end = time.monotonic() + 20             # until the background begins (with a00000)
        while f"background validation: {n} REGISTERED" not in store.log():
            assert time.monotonic() < end
            time.sleep(0.01)
        names = [adapter_id(i) for i in range(n)]
        with ThreadPoolExecutor(n) as pool:
            answers = dict(zip(names, pool.map(client.resolve, names)))
        assert {a.state for a in answers.values()} == {"READY"}
        assert len({a.version for a in answers.values()}) == 2        # pirate, and the big one
        now = settled(client)
        assert all(now[name] == ("READY", "", answers[name].version) for name in names)
        log = finished(store)       # (whether a00000 was shared: test_..._shares_it below)
        for name in names:                      # each read and validated once, by either
            assert len(re.findall(rf"adapter '{name}' validated (in the background|on first "
                                  "use)", log)) == 1, name
        m = background_metrics(port)
        assert m["ready"] + m["skipped"] == n and m["failed"] == m["error"] == m["left"] == 0
    finally:
        client.close()
        assert store.terminate() == 0


def test_the_drain_stops_it(tmp_path):
    adapters = fleet(tmp_path, 16)             # 16 x 0.53 MB at 1 MiB/s: about 8 s
    store, client, _ = start(tmp_path, adapters, "--background-validate-bytes-per-s", "1MiB")
    client.close()
    end = time.monotonic() + 20
    while "background validation: 16 REGISTERED" not in store.log():
        assert time.monotonic() < end
        time.sleep(0.05)
    t0 = time.monotonic()
    assert store.terminate() == 0 and time.monotonic() - t0 < 5
    assert re.search(r"background validation stopped: \d+ of 16", store.log())
    assert "background validation finished" not in store.log()
    assert "Traceback" not in store.log()


def test_zero_threads_leave_them_registered(tmp_path):
    adapters = fleet(tmp_path, 3)
    store, client, _ = start(tmp_path, adapters, "--background-validate-threads", "0")
    try:
        time.sleep(1.0)                         # the background would have begun by now
        assert {s for s, *_ in states(client).values()} == {"REGISTERED"}
        assert "background validation off" in store.log()
        assert client.resolve(adapter_id(1)).state == "READY"    # first use, as before
    finally:
        client.close()
        assert store.terminate() == 0


def test_a_restart_with_the_kept_db_reads_nothing_ready_again(tmp_path):
    adapters = fleet(tmp_path, 5, nan=(2,))
    time.sleep(SETTLED_S + 0.1)       # the files' identities are kept once this old
    db = str(tmp_path / "state" / "registry.sqlite")
    store, client, _ = start(tmp_path, adapters, db=db)
    before = settled(client)
    client.close()
    assert store.terminate() == 0
    store, client, port = start(tmp_path, adapters, db=db)
    try:
        log = finished(store)
        assert states(client) == before
        # only the FAILED one is read again (a FAILED record keeps no file identity)
        assert "background validation finished: 1 of 1" in log
        assert background_metrics(port) == {"ready": 0, "failed": 1, "error": 0, "skipped": 0,
                                            "left": 0}
    finally:
        client.close()
        assert store.terminate() == 0


def test_a_first_use_of_the_adapter_the_background_reads_shares_its_read(tmp_path):
    """In process (a fresh interpreter: the store's metrics must not meet the worker's of
    other in-process tests), deterministic: the background's read of a00000 is held until a
    first use of a00000 is waiting; both get the one READY record from one read."""
    code = ("import json, sys; from tests.test_store_background import shared_read; "
            "print(json.dumps(shared_read(sys.argv[1])))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["state"] == "READY" and got["version"] == got["stored_version"]
    assert got["reads_of_a0"] == [f"file://{adapter_id(0)}"]     # one read of its weights
    assert all(thread.startswith("store-background") for thread in got["threads"])
    assert got["done"] == {"ready": 3, "failed": 0, "error": 0, "skipped": 0}


def shared_read(tmp: str) -> dict:
    """The scenario of the test above, run in its own interpreter."""
    import asyncio
    import pathlib
    import threading
    from services.adapter_store import background
    from services.adapter_store.host_cache import HostCache
    from services.adapter_store.registry import Registry
    from services.adapter_store.scan import scan_dir
    from services.adapter_store.sources import SourceReader
    from services.adapter_store.store import AdapterStore
    from services.adapter_store.validate import load_base_shapes

    adapters = fleet(pathlib.Path(tmp), 3)
    entered, release, reads = threading.Event(), threading.Event(), []

    class HeldReader(SourceReader):
        def open_weights(self, ref, *args, **kwargs):     # what a validating read opens
            reads.append((ref.uri, threading.current_thread().name))
            if ref.uri == f"file://{adapter_id(0)}":
                entered.set()
                assert release.wait(10)
            return super().open_weights(ref, *args, **kwargs)

    async def run():
        background.START_DELAY_S = 0.0
        base = load_base_shapes(MODEL_DIR / "config.json")
        registry = Registry(":memory:")
        reader = HeldReader(adapters, None, 1 << 30)
        scan_dir(registry, reader, base, 128, adapters, 2)
        store = AdapterStore(base, registry, reader, HostCache(1 << 30, None), 128, None)
        validator = background.BackgroundValidator(store, registry, 1)
        validator.start()
        await asyncio.to_thread(entered.wait, 10)       # the background reads a00000 now
        first_use = asyncio.ensure_future(store.resolve(adapter_id(0), "tenant", 10.0))
        await asyncio.sleep(0.2)
        assert not first_use.done()                     # it waits for that read
        release.set()
        record = await first_use
        await validator._task
        await validator.stop()
        store.close()
        return record, registry.get(adapter_id(0)), validator.progress.done

    record, stored, done = asyncio.run(run())
    return {"state": record.state, "version": record.version, "stored_version": stored.version,
            "reads_of_a0": [uri for uri, _ in reads if uri.endswith(adapter_id(0))],
            "threads": [thread for _, thread in reads], "done": dict(done)}


def test_the_scan_records_the_same_inline_and_on_threads(tmp_path):
    """--scan-threads 1 scans in the calling thread (the default), more on a pool: both record
    every adapter of a directory alike, a refused config FAILED with its reason in both (in a
    fresh interpreter, as the test above: the store's metrics)."""
    adapters = make_fleet(tmp_path, 40)
    bad = adapters / adapter_id(7) / FILES[0]
    bad.unlink()
    bad.write_text(json.dumps({**json.loads((SEED / FILES[0]).read_text()), "r": 0}))
    code = ("import json, sys; from tests.test_store_background import scanned; "
            "print(json.dumps([scanned(sys.argv[1], t) for t in (1, 4)]))")
    proc = subprocess.run([sys.executable, "-c", code, str(adapters)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    inline, pooled = json.loads(proc.stdout.strip().splitlines()[-1])
    assert inline == pooled and len(inline) == 40
    states = {i: (state, why) for i, state, why, _ in inline}
    assert states[adapter_id(7)][0] == "FAILED" and "r: 0" in states[adapter_id(7)][1]
    assert {st for i, (st, _) in states.items() if i != adapter_id(7)} == {"REGISTERED"}


def scanned(adapters: str, threads: int) -> list:
    """(id, state, reason, rank) of every adapter a scan of the directory records."""
    import pathlib
    from services.adapter_store.registry import Registry
    from services.adapter_store.scan import scan_dir
    from services.adapter_store.sources import SourceReader
    from services.adapter_store.validate import load_base_shapes
    root = pathlib.Path(adapters)
    registry = Registry(":memory:")
    scan_dir(registry, SourceReader(root, None, 1 << 30),
             load_base_shapes(MODEL_DIR / "config.json"), 128, root, threads)
    records = [registry.get(adapter_id(i)) for i in range(40)]
    return sorted((r.id, r.state, r.reason, r.rank) for r in records)
