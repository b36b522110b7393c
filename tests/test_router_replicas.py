"""Quotas that hold across router replicas: two routers, each told of the other (--peer),
enforce half of a tenant's quota each while both answer health, and the survivor takes the
whole quota back once the other is gone."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services.client.client import LorafleetClient
from services.common.gen.lorafleet.v1 import worker_pb2 as wpb  # noqa: F401 - stubs present
from tests.support import DEMO_ADAPTERS, MODEL_DIR, Service, free_port

pytestmark = pytest.mark.slow
TENANTS = {"tenants": {"acme": {"tokens": ["tok-acme"], "quota": {"max_in_flight": 4}}}}


def outcomes(router: str, n: int) -> list[str]:
    """n long requests of acme at once: which were served and which refused."""
    def one(_):
        with LorafleetClient(router, "tok-acme") as c:
            try:
                c.generate("Hello!", max_new_tokens=300, ignore_eos=True)
                return "OK"
            except grpc.RpcError as err:
                return err.code().name
    with ThreadPoolExecutor(n) as pool:
        return sorted(pool.map(one, range(n)))


def test_two_routers_share_a_quota_and_the_survivor_takes_it_back(tmp_path):
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps(TENANTS))
    store = Service("adapter_store", ["--adapters-dir", str(DEMO_ADAPTERS), "--model",
                                      str(MODEL_DIR), "--db", ":memory:"], tmp_path).wait()
    worker = Service("worker", ["--model", str(MODEL_DIR), "--store", store.addr, "--device",
                                "cpu"], tmp_path).wait()
    pa, pb = free_port(), free_port()
    common = ["--store", store.addr, "--worker", worker.addr, "--tenants", str(tenants),
              "--insecure-internal", "--peer-period", "0.3"]
    a = Service("router", [*common, "--peer", f"127.0.0.1:{pb}"], tmp_path, port=pa)
    b = Service("router", [*common, "--peer", f"127.0.0.1:{pa}"], tmp_path, port=pb)
    try:
        a.wait(), b.wait()
        end = time.monotonic() + 30          # (both: under a loaded machine one may lag)
        while not ("1/2 of each quota" in a.log() and "1/2 of each quota" in b.log()) \
                and time.monotonic() < end:
            time.sleep(0.1)
        assert "1/2 of each quota" in a.log() and "1/2 of each quota" in b.log()
        assert outcomes(a.addr, 4) == ["OK", "OK", "RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED"]
        assert b.terminate() == 0
        end = time.monotonic() + 10
        while "1/1 of each quota" not in a.log() and time.monotonic() < end:
            time.sleep(0.1)
        assert outcomes(a.addr, 4) == ["OK"] * 4          # the whole quota, alone
    finally:
        for s in (a, b, worker, store):
            s.terminate()
