"""WatchResidency: a full snapshot on connect, then deltas with a monotonic sequence number.

Changes are coalesced: marking an adapter dirty schedules one flush on the event loop, so a
burst of changes becomes one delta. A load-only delta goes out periodically so routers see the
queue depth and KV use move.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from services.common.gen.lorafleet.v1 import common_pb2, worker_pb2 as wpb
from services.worker.adapters.manager import AdapterManager


class ResidencyFeed:
    def __init__(self, manager: AdapterManager, load: Callable[[], wpb.WorkerLoad],
                 worker_id: str):
        self.manager, self._load, self.worker_id = manager, load, worker_id
        self.seq = 0
        self._watchers: set[asyncio.Queue] = set()
        self._dirty: set[str] = set()
        self._flush_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def mark(self, key: str) -> None:
        """An adapter's residency changed (call on the event loop)."""
        self._dirty.add(key)
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _entry(self, key: str) -> wpb.AdapterResidency:
        info = self.manager.info.get(key)
        if info is None:
            return wpb.AdapterResidency(id=key.split("@")[0], tier=common_pb2.TIER_UNSPECIFIED)
        tier = (common_pb2.GPU if info.gpu else common_pb2.WORKER_HOST if info.host
                else common_pb2.TIER_UNSPECIFIED)
        return wpb.AdapterResidency(id=info.id, version=info.version, tier=tier,
                                    bytes=info.nbytes, running=max(info.users, 0),
                                    waiting=info.waiters, loading=info.loading,
                                    tenant=info.tenant)

    def _cache(self) -> list[wpb.CacheCounters]:
        out = []
        for name, policy in (("gpu", self.manager.gpu), ("worker_host", self.manager.host.policy)):
            t = policy.totals()
            out.append(wpb.CacheCounters(tier=name, hits=t.hits, misses=t.misses))
        return out

    def snapshot(self) -> wpb.ResidencyUpdate:
        """Every adapter resident, loading or waited for (removed ones appear in deltas only)."""
        entries = [e for e in map(self._entry, self.manager.info)
                   if e.tier != common_pb2.TIER_UNSPECIFIED or e.loading or e.waiting
                   or e.running]
        return wpb.ResidencyUpdate(seq=self.seq, snapshot=True, worker_id=self.worker_id,
                                   adapters=entries, load=self._load(), cache=self._cache())

    def _flush(self) -> None:
        self._flush_scheduled = False
        keys, self._dirty = self._dirty, set()
        self._publish([self._entry(k) for k in keys])

    def _publish(self, entries: list[wpb.AdapterResidency]) -> None:
        if not self._watchers:
            return
        self.seq += 1
        update = wpb.ResidencyUpdate(seq=self.seq, worker_id=self.worker_id, adapters=entries,
                                     load=self._load(), cache=self._cache())
        for q in self._watchers:
            q.put_nowait(update)

    def publish_load(self) -> None:
        """A load-only delta now (e.g. draining, which routers must see at once)."""
        self._publish([])

    async def tick(self, period: float = 0.5) -> None:
        """Periodic load-only deltas."""
        while True:
            await asyncio.sleep(period)
            self._publish([])

    def close(self) -> None:
        """End every watch stream (the worker is draining)."""
        for q in self._watchers:
            q.put_nowait(None)

    async def watch(self) -> AsyncIterator[wpb.ResidencyUpdate]:
        q: asyncio.Queue = asyncio.Queue()
        self._watchers.add(q)
        try:
            yield self.snapshot()
            while (update := await q.get()) is not None:
                yield update
        finally:
            self._watchers.discard(q)
