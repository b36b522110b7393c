"""The worker's adapter tiers under pressure, through running store and worker processes:
100 adapters through a device pool that holds 4, and per-tenant caps against plain LRU."""
from __future__ import annotations

import json
import pathlib
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from safetensors.torch import save_file

from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb
from services.common.gen.lorafleet.v1 import adapter_store_pb2_grpc, common_pb2
from services.common.gen.lorafleet.v1 import worker_pb2 as wpb, worker_pb2_grpc
from services.worker.adapters.layout import staged_from_peft_dir
from services.worker.config import EngineOptions
from services.worker.engine.sequence import Sequence, Stopping
from services.worker.startup.factory import build_engine
from tests.hf_fixtures import make_base
from tests.support import Service

pytestmark = pytest.mark.slow
N_ADAPTERS, RANK = 100, 4


def write_adapters(root: pathlib.Path, n: int) -> None:
    """n rank-4 q/v adapters for the 2-layer, hidden-64 base, written straight as safetensors."""
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        d = root / f"a{i:03d}"
        d.mkdir(parents=True)
        t = {}
        for layer in range(2):
            for m, out in (("q_proj", 64), ("v_proj", 32)):
                p = f"base_model.model.model.layers.{layer}.self_attn.{m}"
                t[f"{p}.lora_A.weight"] = torch.randn(RANK, 64, generator=g) * 0.5
                t[f"{p}.lora_B.weight"] = torch.randn(out, RANK, generator=g) * 0.5
        save_file(t, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": RANK, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
            "bias": "none", "task_type": "CAUSAL_LM"}))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    make_base(root / "base")
    write_adapters(root / "adapters", N_ADAPTERS)
    return root


def pool_bytes_for(root: pathlib.Path, k: int) -> int:
    """Bytes of a device pool that holds exactly k of these (equal-sized) adapters."""
    from services.worker.adapters.range_alloc import RangeAllocator
    from services.worker.model.spec import load_spec
    spec = load_spec(root / "base")
    lay = staged_from_peft_dir(root / "adapters" / "a000", spec)
    return k * RangeAllocator.rounded(lay.plan.numel) * 4


def start(root, tmp, tenant_share: float, pool_bytes: int | None = None):
    store = Service("adapter_store", ["--adapters-dir", str(root / "adapters"), "--model",
                                      str(root / "base"), "--db", ":memory:"], tmp).wait()
    worker = Service("worker", ["--model", str(root / "base"), "--store", store.addr,
                                "--device", "cpu", "--kv-cache-bytes", "4MiB",
                                "--gpu-pool-bytes", str(pool_bytes or pool_bytes_for(root, 4)),
                                "--host-pool-bytes", "64KiB",
                                "--tenant-share", str(tenant_share)], tmp).wait()
    return store, worker


def versions(store_addr: str) -> dict[str, str]:
    with grpc.insecure_channel(store_addr) as ch:
        stub = adapter_store_pb2_grpc.AdapterStoreStub(ch)
        listed = stub.List(spb.ListRequest(all_tenants=True), timeout=10).adapters
    return {a.id: a.version for a in listed}


def gen(stub, adapter: str, version: str, tenant: str, prompt: list[int], n: int = 6):
    req = wpb.WorkerGenerateRequest(request_id=f"{tenant}-{adapter}", tenant=tenant,
                                    prompt_token_ids=prompt)
    req.adapter.id, req.adapter.version, req.adapter.tenant = adapter, version, tenant
    req.stopping.max_new_tokens, req.stopping.ignore_eos = n, True
    tokens, tier = [], None
    for resp in stub.Generate(req, timeout=120):
        tokens += resp.token_ids
        if resp.stop_reason:
            tier = resp.timings.adapter_tier
    return tokens, tier


def expected_outputs(root, jobs):
    """The same requests run in-process with every adapter resident (the engine's parity with
    PEFT is shown elsewhere): a request whose adapter were evicted mid-flight would differ."""
    built = build_engine(root / "base", EngineOptions(device="cpu", dtype="float32",
                                                      pool_bytes=64 << 20, pool_slots=128))
    slots = {}
    out, done = {}, []
    for i, (name, prompt) in enumerate(jobs):
        if name not in slots:
            slots[name] = built.pool.place(name, staged_from_peft_dir(
                root / "adapters" / name, built.spec))
        out[i] = []
        built.engine.submit(Sequence(str(i), prompt, slot=slots[name],
                                     stopping=Stopping(6, ignore_eos=True)),
                            lambda ev, i=i: (out[i].extend(ev.token_ids), ev.stop and done.append(i)))
    while len(done) < len(jobs):
        built.engine.step()
    return out


def test_hundred_adapters_through_a_pool_of_four(world, tmp_path):
    rng = random.Random(1)
    jobs = [(f"a{rng.randrange(N_ADAPTERS):03d}", [rng.randrange(2, 256) for _ in range(5)])
            for _ in range(160)]
    jobs[:N_ADAPTERS] = [(f"a{i:03d}", jobs[i][1]) for i in range(N_ADAPTERS)]   # every adapter
    expected = expected_outputs(world, jobs)
    store, worker = start(world, tmp_path, tenant_share=0.5)
    try:
        ver = versions(store.addr)
        with grpc.insecure_channel(worker.addr) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            with ThreadPoolExecutor(24) as pool:
                results = list(pool.map(
                    lambda j: gen(stub, j[0], ver[j[0]], f"t{int(j[0][1:]) % 5}", j[1]), jobs))
            info = stub.Info(wpb.WorkerInfoRequest(), timeout=10)
        assert [r[0] for r in results] == [expected[i] for i in range(len(jobs))]
        assert info.gpu_resident <= 4
        misses = {c.tier: c.misses for c in info.cache}
        assert misses["gpu"] >= N_ADAPTERS            # the pool really turned over
    finally:
        worker.terminate()
        store.terminate()


def light_hit_rate(world, tmp, tenant_share: float) -> float:
    """A light tenant re-uses one adapter while a heavy tenant sweeps 40 others in bursts."""
    store, worker = start(world, tmp, tenant_share)
    try:
        ver = versions(store.addr)
        hits = total = 0
        with grpc.insecure_channel(worker.addr) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            rng = random.Random(7)
            with ThreadPoolExecutor(8) as pool:
                for burst in range(12):
                    heavy = [f"a{10 + rng.randrange(40):03d}" for _ in range(8)]
                    futs = [pool.submit(gen, stub, a, ver[a], "heavy", [5, 6, 7]) for a in heavy]
                    _, tier = gen(stub, "a000", ver["a000"], "light", [9, 8, 7])
                    hits += tier == common_pb2.GPU
                    total += 1
                    for f in futs:
                        f.result()
        return hits / total
    finally:
        worker.terminate()
        store.terminate()


def test_per_tenant_caps_protect_a_light_tenant(world, tmp_path):
    with_caps = light_hit_rate(world, tmp_path, tenant_share=0.5)
    without = light_hit_rate(world, tmp_path, tenant_share=0.0)
    print(f"light tenant GPU hit rate: caps {with_caps:.2f}, plain LRU {without:.2f}")
    assert with_caps > without


def test_an_adapter_larger_than_the_pool_is_refused_at_once(world, tmp_path):
    """An adapter that can never fit the device pool answers RESOURCE_EXHAUSTED (naming the
    pool flag) at once, not after the request's deadline; the worker goes on serving."""
    import time
    store, worker = start(world, tmp_path, 0.5, pool_bytes=pool_bytes_for(world, 1) // 2)
    try:
        ver = versions(store.addr)
        with grpc.insecure_channel(worker.addr) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                gen(stub, "a001", ver["a001"], "t", [5, 6, 7])      # (a 120 s deadline)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--gpu-pool-bytes" in err.value.details()
            assert time.monotonic() - t0 < 30
            tokens, tier = gen(stub, "", "", "t", [5, 6, 7])         # base model: still served
            assert len(tokens) == 6
    finally:
        worker.terminate()
        store.terminate()
