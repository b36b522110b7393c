"""Room in the adapter pool, first come first served (services/worker/adapters/room_queue.py),
through the AdapterManager and a CPU device pool of 1.5 MiB: the tiny model's fp32 adapters of rank
8 (112 KiB) and 64 (896 KiB), so the pool holds one rank-64 adapter beside a few rank-8 ones.
A rank-64 load gets room within a bound while rank-8 requests keep pinning the pool; a request
that is cancelled, or whose deadline passes, leaves no pin, no reservation, no "loading"."""
from __future__ import annotations

import asyncio
import json
import pathlib
import random
import time

import pytest
import torch

from bench.serve import model as serve_model
from services.common.errors import ResourceExhausted
from services.common.server import sync_channel
from services.worker.adapters.device_pool import DevicePool
from services.worker.adapters.host_tier import HostTier
from services.worker.adapters.manager import AdapterManager
from services.worker.adapters.range_alloc import ALIGN, RangeAllocator
from services.worker.adapters.store_client import StoreClient
from services.worker.model.spec import load_spec
from tests.support import MODEL_DIR

SPEC = load_spec(MODEL_DIR)
POOL_BYTES = 1536 << 10
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def write_adapters(root: pathlib.Path, small: int = 16) -> dict[int, list[str]]:
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    return serve_model.ensure_adapters(root, cfg, [(small, 8), (2, 64)], TARGETS, "fp32")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return write_adapters(tmp_path_factory.mktemp("room"))


def manager(man: dict, host_placement: str = "inline") -> AdapterManager:
    """A manager whose host tier holds every adapter (the store is a closed port: unused)."""
    host = HostTier(64 << 20, None, pin=False, spec=SPEC)
    for names in man["ids"].values():
        for name in names:
            d = pathlib.Path(man["dir"]) / name
            blob = (d / "adapter_model.safetensors").read_bytes()
            res, _ = host.reserve(f"{name}@v1", "t", len(blob))
            res.view.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
            host.commit(res, json.loads((d / "adapter_config.json").read_text()))
            host.unpin(f"{name}@v1")
    pool = DevicePool(SPEC, torch.device("cpu"), torch.float32, POOL_BYTES, 32)
    return AdapterManager(pool, SPEC, host, StoreClient(sync_channel("127.0.0.1:1")), 0.5,
                          host_placement=host_placement)


def assert_clean(mgr: AdapterManager) -> None:
    """Nothing pinned, nothing loading or waiting, nobody queued for room."""
    assert not [e.key for e in mgr.gpu.entries() if e.pins]
    assert not [k for k, i in mgr.info.items() if i.loading or i.users or i.waiters]
    assert not mgr.room and mgr.room.window is None and not mgr._loading and not mgr._tails


async def small_stream(mgr, names, stop: asyncio.Event, i: int, done: list) -> None:
    """One client of rank-8 requests: each holds its adapter 0.2-0.8 s (a running row)."""
    rng = random.Random(i)
    while not stop.is_set():
        a = await mgr.acquire(rng.choice(names), "v1", f"t{i % 3}", time.monotonic() + 30)
        await asyncio.sleep(0.2 + 0.6 * rng.random())
        mgr.release(a.key)
        done.append(a.key)
        await asyncio.sleep(0.005)


def test_a_large_adapter_gets_room_while_small_ones_keep_coming(adapters):
    """Twelve clients keep up to twelve of sixteen rank-8 adapters pinned, scattered over the pool;
    two rank-64 loads (deadline 10 s) must both be placed within 3 s. Before the room queue
    each release's room went to the next rank-8 load and the rank-64 ones waited till their
    deadline (RESOURCE_EXHAUSTED after 9.5 s)."""
    mgr = manager(adapters)

    async def run():
        stop, done, took = asyncio.Event(), [], {}

        async def large(name, delay):
            await asyncio.sleep(delay)
            t = time.monotonic()
            a = await mgr.acquire(name, "v1", "big", t + 10)
            took[name] = time.monotonic() - t
            await asyncio.sleep(0.1)
            mgr.release(a.key)
        smalls = [asyncio.ensure_future(small_stream(mgr, adapters["ids"][8], stop, i, done))
                  for i in range(12)]
        try:
            await asyncio.gather(*(large(n, 1.0 + 0.1 * j)
                                   for j, n in enumerate(adapters["ids"][64])))
        finally:
            stop.set()
            await asyncio.gather(*smalls)
        return took, len(done)
    took, small_done = asyncio.run(run())
    assert len(took) == 2 and max(took.values()) < 3.0, took
    assert small_done > 20                   # the rank-8 clients kept going
    assert_clean(mgr)
    mgr.close()


def test_a_cancelled_load_leaves_no_pin(adapters):
    """Requests cancelled while their load runs on a loader thread: the run ends, its pin is
    dropped, the adapter stays resident unpinned (before, the pin stayed for ever: the adapter
    could never be evicted and its range was lost to every other load)."""
    mgr = manager(adapters, host_placement="loader")

    async def run():
        for i in range(12):
            name = adapters["ids"][8][i]
            task = asyncio.ensure_future(mgr.acquire(name, "v1", "t", None))
            await asyncio.sleep(0.0005 * (i % 4))
            task.cancel()
            try:
                mgr.release((await task).key)
            except asyncio.CancelledError:
                pass
        await asyncio.sleep(0.3)
        a = await mgr.acquire(adapters["ids"][8][0], "v1", "t", None)     # usable again
        mgr.release(a.key)
        await asyncio.sleep(0.05)
    asyncio.run(run())
    assert_clean(mgr)
    mgr.close()


def test_a_waiter_whose_deadline_passes_leaves_the_queue(adapters):
    """A rank-64 load that cannot get room before its deadline (a rank-8 adapter pinned in
    every place it could go) fails with RESOURCE_EXHAUSTED and leaves nothing behind: the
    window it kept opens again for the rank-8 loads."""
    mgr = manager(adapters)
    names = adapters["ids"][8]

    async def run():
        held = [await mgr.acquire(n, "v1", "t", None) for n in names[:13]]   # pool full
        for a in held[1::2]:
            mgr.release(a.key)          # every other one: free room, none of it contiguous
        t = time.monotonic()
        with pytest.raises(ResourceExhausted):
            await mgr.acquire(adapters["ids"][64][0], "v1", "big", t + 1.5)
        assert 0.9 < time.monotonic() - t < 1.5
        for a in held[0::2]:
            mgr.release(a.key)
        more = [await mgr.acquire(n, "v1", "t", time.monotonic() + 5) for n in names[13:]]
        for a in more:
            mgr.release(a.key)
        await asyncio.sleep(0.05)
    asyncio.run(run())
    assert_clean(mgr)
    mgr.close()


def test_the_range_allocator_keeps_out_of_a_window():
    """First fit outside [start, end): every fit found, none overlapping, the books balanced."""
    for trial in range(200):
        rng = random.Random(trial)
        alloc, used, live = RangeAllocator(64 * ALIGN), [False] * 64, []
        for _ in range(60):
            if live and rng.random() < 0.4:
                s, n = live.pop(rng.randrange(len(live)))
                alloc.release(s, n)
                used[s // ALIGN:(s + n) // ALIGN] = [False] * (n // ALIGN)
                continue
            k, w = rng.randint(1, 10), rng.randint(0, 60)
            avoid = (w * ALIGN, (w + rng.randint(1, 20)) * ALIGN) if rng.random() < 0.5 else None
            fits = [i * ALIGN for i in range(65 - k) if not any(used[i:i + k]) and (
                avoid is None or not (i * ALIGN < avoid[1] and (i + k) * ALIGN > avoid[0]))]
            s = alloc.alloc(k * ALIGN, avoid)
            assert (s is None) == (not fits) and (s is None or s == fits[0])
            if s is not None:
                used[s // ALIGN:s // ALIGN + k] = [True] * k
                live.append((s, k * ALIGN))
            assert alloc.used == sum(used) * ALIGN
