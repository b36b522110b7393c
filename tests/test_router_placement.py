"""Placement keeps working sets apart, measured from the workers' residency streams: with two
workers and many adapters requested repeatedly, each adapter is resident on one worker; an
adapter whose rows exceed --spill-rows (its load needs two) becomes resident on both."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from services.client.client import LorafleetClient
from tests.conftest import ResidencyWatch, Stack
from tests.support import Service

pytestmark = pytest.mark.slow

ADAPTERS = [f"a{i:02d}" for i in range(30)]


def test_each_adapter_resident_on_one_worker_unless_it_needs_two(lora_fleet, tmp_path):
    base, adapters = lora_fleet
    stack = Stack(base, adapters, tmp_path, workers=2)
    watches = [ResidencyWatch(w.addr) for w in stack.workers]
    hot_router = None
    try:
        # Every adapter 4 times, 8 requests in flight, round-robin over the adapters.
        jobs = [(a, r) for r in range(4) for a in ADAPTERS]
        with LorafleetClient(stack.router.addr, timeout=60) as c, ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda j: c.generate(adapter=j[0], prompt_ids=[3, 5 + j[1], 7],
                                               max_new_tokens=8), jobs))
        sets = [w.gpu_resident() for w in watches]
        print(f"\nworking sets: {len(sets[0])} + {len(sets[1])} adapters, "
              f"{len(sets[0] & sets[1])} on both")
        assert sets[0] | sets[1] == set(ADAPTERS)
        assert not sets[0] & sets[1]                       # each adapter on one worker
        assert 5 <= len(sets[0]) <= 25                     # and the set is shared out

        # A second router that lets an adapter spill past 3 rows: a burst on one adapter.
        hot_router = Service("router", ["--store", stack.store.addr, "--spill-rows", "3",
                                        *[x for w in stack.workers for x in ("--worker", w.addr)]],
                             tmp_path).wait()
        with LorafleetClient(hot_router.addr, timeout=60) as c, ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda i: c.generate(adapter="a40", prompt_ids=[3, 4, i + 5],
                                               max_new_tokens=32, ignore_eos=True), range(16)))
        hot = [w.gpu_resident() for w in watches]
        assert "a40" in hot[0] & hot[1]                    # its load needed two
        assert not (hot[0] & hot[1]) & set(ADAPTERS)       # the others stayed apart
    finally:
        for w in watches:
            w.close()
        if hot_router is not None:
            assert hot_router.terminate() == 0
        assert all(code == 0 for code in stack.terminate())


def test_queued_request_prefetches_its_adapter(long_context, tmp_path):
    """With the gate full, a request for a cold adapter waits in the router; the worker stages
    the adapter meanwhile (the prefetch hint), before the request reaches it."""
    base, adapters = long_context
    stack = Stack(base, adapters, tmp_path, router_args=["--max-in-flight-per-worker", "1",
                                                         "--foothold-per-worker", "0"])
    watch = ResidencyWatch(stack.workers[0].addr)
    try:
        with LorafleetClient(stack.router.addr, "heavy", timeout=60) as heavy, \
                LorafleetClient(stack.router.addr, "light", timeout=60) as light, \
                ThreadPoolExecutor(1) as pool:
            holder = heavy.generate_stream(adapter="long", prompt_ids=[3, 4], ignore_eos=True,
                                           max_new_tokens=3000)
            next(holder)                                   # the only slot is taken
            queued = pool.submit(light.generate, adapter="other", prompt_ids=[3, 4],
                                 max_new_tokens=2)
            watch.wait(lambda w: "other" in w.gpu_resident(), timeout=10)
            assert not queued.done() and watch.rows("other") == 0   # staged, not yet sent
            holder.cancel()
            resp = queued.result(timeout=30)
            assert resp.adapter_id == "other" and resp.timings.cold_load_s == 0.0  # a GPU hit
            assert resp.timings.queue_s > 0
    finally:
        watch.close()
        assert all(code == 0 for code in stack.terminate())
