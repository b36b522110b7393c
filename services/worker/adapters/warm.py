"""A joining worker's warm-up with the fleet's hot set (issue 43; the router's side:
services/router/hot_set.py).

Prefetch(warm) queues adapters here, hottest first. One at a time, behind any demand load: the
adapter is fetched into the host tier on a loader thread (never on the event loop), then placed
on the GPU while the pool has a free slot and free bytes to spare within `gpu_share` of its
capacity, so a warm-up never evicts and never takes room a request needs. Requests that come
meanwhile take their loads first: before each adapter the queue waits for every demand load in
flight to end. A failed warm load is only logged (the request that needs it fetches it again).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time

from services.common.gen.lorafleet.v1 import worker_pb2 as wpb

log = logging.getLogger(__name__)
WARM_LOAD_S = 60.0          # a warm fetch's deadline


class WarmQueue:
    """Fleet warm-up loads for one AdapterManager (services.worker.adapters.manager)."""

    def __init__(self, manager, gpu_share: float = 0.5, limit: int = 1024):
        if not 0.0 <= gpu_share <= 1.0:
            raise ValueError(f"gpu_share must be within [0, 1], not {gpu_share}")
        self.manager, self.gpu_share, self.limit = manager, gpu_share, limit
        self._queue: collections.deque[wpb.AdapterRef] = collections.deque()
        self._queued: set[str] = set()
        self._task: asyncio.Task | None = None
        self.done = {"host": 0, "gpu": 0, "failed": 0, "skipped": 0}
        self.idle = asyncio.Event()
        self.idle.set()

    def submit(self, refs) -> int:
        """Queue refs (hottest first) behind what is queued; returns how many were taken (a
        key already queued, or past `limit` queued, is not)."""
        taken = 0
        for ref in refs:
            key = self.manager.key(ref.id, ref.version)
            if key in self._queued or len(self._queue) >= self.limit:
                continue
            self._queue.append(ref)
            self._queued.add(key)
            taken += 1
        if self._queue and (self._task is None or self._task.done()):
            self.idle.clear()
            self._task = asyncio.get_running_loop().create_task(self._run())
        return taken

    async def _run(self) -> None:
        try:
            while self._queue:
                ref = self._queue[0]
                await self.manager.demand_settled()
                try:
                    await self._warm(ref)
                except asyncio.CancelledError:
                    raise
                except Exception as err:  # noqa: BLE001 - the request that needs it tries again
                    self.done["failed"] += 1
                    log.info("warm load of %s@%s failed: %s", ref.id, ref.version, err)
                finally:
                    self._queue.popleft()
                    self._queued.discard(self.manager.key(ref.id, ref.version))
            log.info("warm-up done: %s", self.done)
        finally:
            self.idle.set()

    async def _warm(self, ref: wpb.AdapterRef) -> None:
        m = self.manager
        key = m.key(ref.id, ref.version)
        if m.pool.slot_of(key) is not None:
            self.done["skipped"] += 1
            return
        if key not in m.host:
            await m.stage_on_host(ref.id, ref.version, ref.tenant,
                                  time.monotonic() + WARM_LOAD_S, ref.pinned)
            self.done["host"] += 1
        if self._gpu_room(key):
            acq = await m.acquire(ref.id, ref.version, ref.tenant, time.monotonic() + WARM_LOAD_S,
                                  pinned=ref.pinned)
            m.release(acq.key)
            self.done["gpu"] += 1

    def _gpu_room(self, key: str) -> bool:
        """A free slot, and the adapter's bytes fit the pool's free bytes without taking it
        past gpu_share of its capacity."""
        m = self.manager
        staged = m.host.lookup(key)
        if staged is None or self.gpu_share <= 0 or not m.pool.has_free_slot():
            return False
        nbytes = m.pool.alloc.rounded(staged.plan.numel) * m.pool.elem
        used_after = m.gpu.used_bytes + nbytes
        return (nbytes <= m.pool.free_bytes and nbytes <= m.gpu.free_bytes
                and used_after <= self.gpu_share * m.gpu.capacity_bytes)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
