"""A rank-64 adapter gets room in a worker's pool while rank-8 requests keep coming, through
running store and worker processes (the CPU, the tiny model, fp32 adapters: rank 8 = 112 KiB,
rank 64 = 896 KiB, a pool of 1536 KiB that holds one rank-64 adapter beside a few rank-8 ones).
Before the room queue (services/worker/adapters/room_queue.py) each release's room went to the next
rank-8 load, and the rank-64 requests waited until their deadlines, "waiting, loading"."""
from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from services.common.gen.lorafleet.v1 import worker_pb2 as wpb, worker_pb2_grpc
from tests.conftest import ResidencyWatch
from tests.support import MODEL_DIR, Service
from tests.test_adapter_cache import versions
from tests.test_room_queue import write_adapters

pytestmark = pytest.mark.slow


def generate(stub, adapter: str, version: str, tokens: int, timeout: float) -> None:
    req = wpb.WorkerGenerateRequest(request_id=adapter, tenant=f"t-{adapter}",
                                    prompt_token_ids=[5, 6, 7, 8])
    req.adapter.id, req.adapter.version, req.adapter.tenant = adapter, version, f"t-{adapter}"
    req.stopping.max_new_tokens, req.stopping.ignore_eos = tokens, True
    for _ in stub.Generate(req, timeout=timeout):
        pass


def test_rank_64_requests_get_room_among_a_stream_of_rank_8_ones(tmp_path):
    man = write_adapters(tmp_path)
    store = Service("adapter_store", ["--adapters-dir", man["dir"], "--model", str(MODEL_DIR),
                                      "--db", ":memory:"], tmp_path).wait()
    worker = Service("worker", ["--model", str(MODEL_DIR), "--store", store.addr, "--device",
                                "cpu", "--kv-cache-bytes", "8MiB", "--gpu-pool-bytes", "1536KiB",
                                "--host-pool-bytes", "16MiB", "--warmup", "off"], tmp_path).wait()
    try:
        ver = versions(store.addr)
        with grpc.insecure_channel(worker.addr) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            for name in man["ids"][8] + man["ids"][64]:      # every one in the host tier
                generate(stub, name, ver[name], 1, 30)
            took, small = stream_with_large(stub, man["ids"], ver)
            watch = ResidencyWatch(worker.addr)
            watch.wait(lambda w: w.adapters and not any(     # nothing left loading or held
                a.loading or a.running or a.waiting for a in w.adapters.values()))
    finally:
        worker.terminate()
        store.terminate()
    print("rank-64 seconds:", took, "rank-8:", small)
    assert all(isinstance(t, float) and t < 4.0 for t in took.values()), (took, small)
    assert small["ok"] > 20 and not small["failed"], small


def stream_with_large(stub, ids: dict, ver: dict) -> tuple[dict, dict]:
    """Sixteen threads send rank-8 requests (32 tokens) over sixteen adapters; after 2 s, two
    rank-64 requests (deadline 20 s) are sent. Returns their seconds (or the error) and the
    rank-8 tally."""
    stop, small, lock = threading.Event(), {"ok": 0, "failed": []}, threading.Lock()

    def client(i: int) -> None:
        rng = random.Random(i)
        while not stop.is_set():
            name = rng.choice(ids[8])
            try:
                generate(stub, name, ver[name], 32, 30)
                with lock:
                    small["ok"] += 1
            except grpc.RpcError as e:
                small["failed"].append(e.code().name)
    took: dict = {}

    def large(name: str) -> None:
        t = time.monotonic()
        try:
            generate(stub, name, ver[name], 4, 20)
            took[name] = time.monotonic() - t
        except grpc.RpcError as e:
            took[name] = f"{e.code().name} after {time.monotonic() - t:.1f}s"
    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    bigs = [threading.Thread(target=large, args=(n,)) for n in ids[64]]
    for t in bigs:
        t.start()
    for t in bigs:
        t.join()
    stop.set()
    for t in threads:
        t.join()
    return took, small
