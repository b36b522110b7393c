"""The worker's adapter tiers: the device pool (GPU) and the pinned host tier, both governed by
services.common.cache_policy (LRU, pins, per-tenant caps, footholds), filled from the store.

A request `acquire`s its adapter: a GPU hit pins it at once; otherwise one cold load runs for
it (later requests for the same adapter join it) while the engine keeps stepping every other
row. The request enters the engine only once its adapter is usable, so a load never holds the
batch back. The pin is held until the engine has finished the request, so an adapter in use is
never evicted.

A cold load is one job: the store fetch straight into a host-tier reservation
(services.worker.adapters.store_client), the layout plan, the device-pool admission (evicting
unpinned adapters) and the placement (services.worker.adapters.device_pool), a handful of device
operations. A job that fetches runs on a loader thread, never on the event loop, which only starts
it and hears when it is done: loads run side by side and no stream's tokens wait for a fetch. One
from the worker's host tier is the placement alone, a millisecond or two, and by default runs on the
event loop, one a loop iteration: the hop to a loader thread and back cost as much again under
decode load (two thread switches, each waiting for the GIL behind the engine thread). When the pool
has no room the job hands back and waits its turn (room_queue.py: first come, first served), then
runs again. Each finished load leaves a record of its stages (ColdLoadLog).
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from services.common.cache_policy import CachePolicy, NoRoom
from services.common.errors import ResourceExhausted
from services.common.gen.lorafleet.v1 import common_pb2, worker_pb2 as wpb
from services.common.telemetry import tracer
from services.worker import metrics
from services.worker.adapters import cold_fetch, gil
from services.worker.adapters.device_pool import DevicePool, PoolFull
from services.worker.adapters.host_tier import HostTier
from services.worker.adapters.layout import StagedAdapter
from services.worker.adapters.room_queue import RoomQueue, next_victim, window_busy
from services.worker.adapters.state import Acquired, Residency
from services.worker.model.spec import ModelSpec
from services.worker.adapters.cold_records import (ColdJob, ColdLoadLog, LoopTurns, count_cold,
                                                   observe_stages, reload_cost)
from services.worker.adapters.store_client import StoreClient

log = logging.getLogger(__name__)
_tracer = tracer("lorafleet.worker")


class AdapterManager:
    def __init__(self, pool: DevicePool, spec: ModelSpec, host: HostTier, store: StoreClient,
                 tenant_share: float | None = 0.5,
                 on_change: Callable[[str], None] = lambda key: None, loader_threads: int = 8,
                 evictions: metrics.Evictions | None = None, eviction: str = "lru",
                 host_placement: str = "inline"):
        """host_placement: a load from the host tier is placed "inline" (on the event loop) or
        on a "loader" thread like the loads that fetch."""
        if host_placement not in ("inline", "loader"):
            raise ValueError(f"host_placement must be inline or loader, not {host_placement!r}")
        self.inline_host = host_placement == "inline"
        self._inline_turns = LoopTurns()
        self.pool, self.spec, self.store, self.host = pool, spec, store, host
        self.evictions = evictions or metrics.Evictions()   # per tenant, on /metrics
        self.gpu = CachePolicy(pool.capacity_bytes, tenant_share, foothold=tenant_share is not None,
                               eviction=eviction)
        self.info: dict[str, Residency] = {}
        self.pinned_versions: set[str] = set()      # keys asked for as ID@VERSION pins
        self._loading: dict[str, asyncio.Future] = {}
        self._tails: dict[str, asyncio.Future] = {}  # loader runs their cancelled callers left
        self.room = RoomQueue()                    # loads waiting for room, oldest first
        self._gpu_lock = threading.Lock()      # policy + pool steps that must go together
        self._loader = ThreadPoolExecutor(max(1, loader_threads), "adapter-load")
        self.on_change = on_change            # key -> None: residency changed (the feed)
        self.log = ColdLoadLog()
        self.cold_loads: dict[int, list[float]] = {}   # tier -> recent seconds
        self.cold_load_count: dict[int, int] = {}

    @staticmethod
    def key(adapter_id: str, version: str) -> str:
        return f"{adapter_id}@{version}"

    async def acquire(self, adapter_id: str, version: str, tenant: str,
                      deadline: float | None, pinned: bool = False) -> Acquired:
        """Pin the adapter on the device, staging it first if needed. pinned: the version was
        asked for (the store serves it while it keeps it, current or not)."""
        key = self.key(adapter_id, version)
        if pinned:
            self.pinned_versions.add(key)
        while True:
            with self._gpu_lock:
                slot = self.pool.slot_of(key)
                wait = bool(self.room) and self.room.blocks(self.pool.span_of(key), key)
                hit = not wait and slot is not None and self.gpu.touch(key)
                if hit:
                    self.gpu.pin(key)
            if not wait:
                break
            await self.room.wait(deadline, key)     # its range is kept for an older waiter
        if hit:
            self._use(key, +1)
            metrics.count_lookup("gpu", True)
            return Acquired(key, slot, common_pb2.GPU, 0.0)
        metrics.count_lookup("gpu", False)
        start = time.monotonic()
        with _tracer.start_as_current_span("lora.cold_load") as span:
            span.set_attributes({"lora.adapter_id": adapter_id, "lora.version": version,
                                 "lora.tenant": tenant})
            tier = await self._stage(key, adapter_id, version, tenant, deadline)
            seconds = time.monotonic() - start
            span.set_attributes({"lora.tier": common_pb2.Tier.Name(tier),
                                 "lora.bytes": self.info[key].nbytes})
        metrics.adapter_tiers(self)
        count_cold(self.cold_loads, self.cold_load_count, tier, seconds)
        return Acquired(key, self.pool.slot_of(key), tier, seconds)

    def release(self, key: str) -> None:
        """The engine is done with one request using this adapter."""
        self.gpu.unpin(key)
        self._use(key, -1)
        asyncio.get_running_loop().create_task(self.room.notify())

    def _use(self, key: str, delta: int) -> None:
        self.info[key].users += delta
        self.on_change(key)

    async def _stage(self, key, adapter_id, version, tenant, deadline) -> int:
        """Bring key into the device pool pinned for this caller; return the source tier."""
        while True:
            pending = self._loading.get(key)
            if pending is not None:
                await asyncio.shield(pending)
                with self._gpu_lock:
                    ready = self.pool.slot_of(key) is not None and self.gpu.contains(key)
                    if ready:
                        self.gpu.pin(key)
                if ready:
                    self._use(key, +1)
                    return common_pb2.GPU
                continue
            fut = asyncio.get_running_loop().create_future()
            self._loading[key] = fut
            try:
                return await self._load(key, adapter_id, version, tenant, deadline)
            finally:        # a run left behind on a loader thread holds the key till it ends
                tail = self._tails.get(key)
                if tail is None:
                    self._settle(key, fut)
                else:
                    tail.add_done_callback(lambda _: self._settle(key, fut))

    def _settle(self, key: str, fut: asyncio.Future) -> None:
        del self._loading[key]
        fut.set_result(None)

    async def _load(self, key, adapter_id, version, tenant, deadline) -> int:
        info = self.info.setdefault(key, Residency(adapter_id, version, tenant, 0))
        info.loading = True
        self.on_change(key)
        start = time.monotonic()
        job = ColdJob(key, adapter_id, version, tenant, deadline, wpb.ColdLoadRecord(
            adapter_id=adapter_id, tier=common_pb2.WORKER_HOST))
        try:
            while True:
                try:
                    # from the host tier on the event loop, one a loop iteration (of loads that
                    # arrive together the rest go to loader threads)
                    inline = self.inline_host and key in self.host and self._inline_turns.take()
                    with gil.first():       # the placement's device calls, the hops
                        if not (inline and self._cold_job(job, fetch=False)):
                            await self._on_loader(job)
                finally:
                    if key not in self._tails:      # else _abandon applies it
                        self._apply(job)
                if job.placed:
                    break
                waited = time.monotonic()
                await self.room.wait(deadline, key, self.info[key])
                job.record.room_wait_s += time.monotonic() - waited
        except BaseException:
            if job.placed and key not in self._tails:   # the caller went after its placement
                self._unpin_placed(key)
            raise
        finally:
            info.loading = False
            if key not in self._tails:
                self._leave_room(key)
        info.gpu = True
        self._use(key, +1)
        job.record.total_s = time.monotonic() - start
        job.record.end_unix_s = time.time()
        self.log.add(job.record)
        observe_stages(job.record)
        return job.record.tier

    async def _on_loader(self, job: ColdJob) -> None:
        """The job on a loader thread; its record gets the time the two hops took. A caller
        cancelled meanwhile leaves the run behind: `_abandon` undoes its pin when it ends."""
        ctx, asked = contextvars.copy_context(), time.monotonic()
        run = asyncio.get_running_loop().run_in_executor(
            self._loader, ctx.run, self._timed_job, job)
        try:
            ran = await asyncio.shield(run)
        except asyncio.CancelledError:
            if not run.done():
                self._tails[job.key] = run
                run.add_done_callback(lambda _: self._abandon(job))
            raise
        job.record.handoff_s += time.monotonic() - asked - ran

    def _abandon(self, job: ColdJob) -> None:
        """A run whose caller was cancelled has ended: apply it, drop its pin (if it placed)."""
        del self._tails[job.key]
        self._apply(job)
        self._leave_room(job.key)
        if job.placed:
            self._unpin_placed(job.key)

    def _unpin_placed(self, key: str) -> None:
        self.gpu.unpin(key)                 # (the policy has its own lock)
        self._mark(key, gpu=True)
        asyncio.get_running_loop().create_task(self.room.notify())

    def _timed_job(self, job: ColdJob) -> float:
        t = time.monotonic()
        self._cold_job(job)
        return time.monotonic() - t

    # ---- the job, on a loader thread (or inline, from the host tier) -------------------------

    def _cold_job(self, job: ColdJob, fetch: bool = True) -> bool:
        """Host tier (else the store, where fetch) -> device pool; returns False (nothing done)
        when the bytes must be fetched and fetch is False. Sets job.placed, or leaves it False
        when the pool has no room (every adapter in it in use: the loop waits, then runs it
        again)."""
        staged = self.host.lookup(job.key, pin=True)
        if staged is None and not fetch:
            return False
        job.runs += 1
        if staged is None:
            staged = cold_fetch.fetch(job, self.host, self.store,
                                      job.key in self.pinned_versions)
        elif job.runs == 1:
            metrics.count_lookup("worker_host", True)
        job.nbytes = job.record.bytes = staged.nbytes
        try:
            reserved = self._admit(job, staged)
            if reserved is not None:
                t = time.monotonic()
                parts: dict = {}
                with _tracer.start_as_current_span("lora.host_to_device") as span:
                    span.set_attribute("lora.bytes", staged.nbytes)
                    self._fill(job.key, staged, reserved, parts)
                    span.set_attributes({f"lora.{k}_s": v for k, v in parts.items()})
                job.record.host_to_device_s += time.monotonic() - t
                job.record.copy_wait_s += parts.get("copy_wait", 0.0)
                job.record.device_s += parts.get("device", 0.0)
                job.record.launch_s += parts.get("launch", 0.0)
                job.placed = True
        finally:
            self.host.unpin(job.key)
        return True

    def _admit(self, job: ColdJob, staged: StagedAdapter) -> tuple[int, int] | None:
        """A slot and range in the pool for the adapter, admitted and pinned for this load:
        evicts unpinned adapters (policy order, then least recent first while the free space
        is too fragmented or the slots are out). None when the rest is in use: the load waits
        its turn in the room queue (room_queue.py: an older waiter's window is kept for it)."""
        nbytes = self.pool.alloc.rounded(staged.plan.numel) * self.pool.elem
        if nbytes > self.pool.capacity_bytes:          # would wait for room that never comes
            raise ResourceExhausted(
                f"adapter {job.key} needs {nbytes} bytes of adapter pool; this worker's pool "
                f"holds {self.pool.capacity_bytes} (--gpu-pool-bytes)", retry_after=1.0)
        with self._gpu_lock:
            reserved = self._reserve(job, staged, nbytes)
            if reserved is None:        # it waits its turn (the oldest: its window planned)
                self.room.join(job.key, nbytes // self.pool.elem)
                window_busy(self.room, self.pool, self.gpu, job.key, job.tenant, nbytes)
            return reserved

    def _reserve(self, job: ColdJob, staged: StagedAdapter, nbytes: int):
        """_admit's steps under the pool lock (room_queue: the oldest waiter's window)."""
        if window_busy(self.room, self.pool, self.gpu, job.key, job.tenant, nbytes):
            return None             # the oldest waiter: pinned adapters still in its window
        try:
            victims = self.gpu.admit(job.key, job.tenant, nbytes, pin=True,
                                     cost=reload_cost(job.record, nbytes))
        except NoRoom:
            return None
        for victim in victims:
            self._drop_slot(victim, job)
        while True:
            try:
                return self.pool.reserve(job.key, staged, self.room.avoid(job.key))
            except PoolFull:
                pass
            victim = next_victim(self.room, self.pool, self.gpu, job.key)
            if victim is None:
                self.gpu.unpin(job.key)
                self.gpu.remove(job.key)
                return None
            self.gpu.remove(victim)
            self._drop_slot(victim, job)

    def _fill(self, key: str, staged: StagedAdapter, reserved: tuple[int, int],
              timing: dict | None = None) -> None:
        try:
            self.pool.fill(key, staged, reserved, timing=timing)
        except BaseException:
            with self._gpu_lock:
                self.gpu.unpin(key)
                self.gpu.remove(key)
            raise

    def _drop_slot(self, key: str, job: ColdJob) -> None:
        if self.pool.slot_of(key) is not None:
            self.pool.remove(key)
        job.gpu_victims.append(key)

    # ---- back on the event loop ----------------------------------------------------------------

    def _apply(self, job: ColdJob) -> None:
        """The residency changes a job made (evictions, a new host-tier entry)."""
        for victim in job.gpu_victims:
            self._mark(victim, gpu=False)
        for victim in job.host_victims:
            self._mark(victim, host=False)
        job.gpu_victims, job.host_victims = [], []
        info = self.info[job.key]
        if job.nbytes:
            info.nbytes = job.nbytes
        if job.host_added:
            info.host = True
            job.host_added = False
        self.on_change(job.key)

    def _mark(self, key: str, **flags) -> None:
        info = self.info.get(key)
        if info is not None:
            for name, value in flags.items():
                setattr(info, name, value)
            self.on_change(key)

    def _leave_room(self, key: str) -> None:
        with self._gpu_lock:
            if self.room.leave(key):        # the window it kept (if the head) is open again
                asyncio.get_running_loop().create_task(self.room.notify())

    # ---- the fleet warm-up's steps (services.worker.adapters.warm) ------------------------------

    async def demand_settled(self) -> None:
        """Until no load a request asked for is in flight (each one ends by itself: no
        polling)."""
        while self._loading:
            await asyncio.wait(list(self._loading.values()))

    async def stage_on_host(self, adapter_id: str, version: str, tenant: str, deadline: float,
                            pinned: bool = False) -> int:
        """The store -> the host tier only, on a loader thread (never the event loop); the
        residency feed hears of it. Returns the adapter's bytes."""
        key = self.key(adapter_id, version)
        job = ColdJob(key, adapter_id, version, tenant, deadline,
                      wpb.ColdLoadRecord(adapter_id=adapter_id, tier=common_pb2.WORKER_HOST))
        info = self.info.setdefault(key, Residency(adapter_id, version, tenant, 0))

        def run() -> None:
            staged = cold_fetch.fetch(job, self.host, self.store, pinned)
            job.nbytes = staged.nbytes
            self.host.unpin(key)
        ctx = contextvars.copy_context()
        await asyncio.get_running_loop().run_in_executor(self._loader, ctx.run, run)
        self._apply(job)
        info.host = key in self.host
        return job.nbytes

    def offload(self, adapter_id: str, to_host: bool) -> int:
        """Drop every unpinned version of an adapter from the device (and host) tier."""
        dropped = 0
        for key, info in list(self.info.items()):
            if info.id != adapter_id:
                continue
            with self._gpu_lock:
                drop = info.gpu and not self.gpu.is_pinned(key) and key not in self._loading
                if drop:
                    self.gpu.remove(key)
                    if self.pool.slot_of(key) is not None:
                        self.pool.remove(key)
            if drop:
                self._mark(key, gpu=False)
                dropped += 1
            if not to_host and info.host and self.host.remove(key):
                self._mark(key, host=False)
        return dropped

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
