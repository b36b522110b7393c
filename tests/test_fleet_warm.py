"""A worker that rejoins the fleet empty is warmed with the fleet's hot set, through the running
services: the router counted the requests of the first worker's life; the restarted worker, on
the same address, gets the hottest adapters staged (host tier, and the GPU pool within
--warm-gpu-share) before anyone asks for them, without a request of its own, and the first
request for the hottest then hits the pool. With --warm-adapters 0 nothing is staged."""
from __future__ import annotations

import time

import pytest

from services.client.client import LorafleetClient
from services.common.gen.lorafleet.v1 import common_pb2
from tests.conftest import ResidencyWatch, Stack
from tests.support import Service

pytestmark = pytest.mark.slow
HOT = [f"a{i:02d}" for i in range(6)]


def _serve_hot_set(stack: Stack) -> None:
    with LorafleetClient(stack.router.addr, timeout=60) as c:
        for n, adapter in enumerate(HOT):
            for _ in range(len(HOT) - n):               # a00 the hottest
                c.generate(adapter=adapter, prompt_ids=[3, 4, 5], max_new_tokens=2,
                           ignore_eos=True)


def _restart_worker(stack: Stack, tmp_path, worker_args) -> Service:
    old = stack.workers[0]
    assert old.terminate() == 0
    new = Service("worker", ["--model", str(stack.model), "--store", stack.store.addr,
                             "--device", "cpu", *worker_args], tmp_path / "restarted",
                  port=old.port)
    stack.workers[0] = new
    return new.wait()


def _held(watch: ResidencyWatch) -> dict[str, int]:
    with watch._cond:
        return {a.id: a.tier for a in watch.adapters.values() if not a.loading}


def test_a_restarted_worker_is_warmed_with_the_fleets_hot_set(lora_fleet, tmp_path):
    base, adapters = lora_fleet
    (tmp_path / "restarted").mkdir()
    worker_args = ["--warm-gpu-share", "0.5"]
    stack = Stack(base, adapters, tmp_path, worker_args=worker_args)
    stack.model = base
    watch = None
    try:
        _serve_hot_set(stack)
        worker = _restart_worker(stack, tmp_path, worker_args)
        watch = ResidencyWatch(worker.addr)
        watch.wait(lambda w: set(_held(w)) == set(HOT), timeout=60)
        held = _held(watch)
        assert held["a00"] == common_pb2.GPU            # the hottest placed, within the share
        assert watch.load.running == 0 and watch.load.waiting == 0
        log = worker.log()
        assert "warm-up done" in log and "Traceback" not in log
        with LorafleetClient(stack.router.addr, timeout=60) as c:
            r = c.generate(adapter="a00", prompt_ids=[3, 4, 5], max_new_tokens=2,
                           ignore_eos=True)
        assert r.timings.adapter_tier == common_pb2.GPU and r.timings.cold_load_s == 0
    finally:
        if watch is not None:
            watch.close()
        assert all(code == 0 for code in stack.terminate())
