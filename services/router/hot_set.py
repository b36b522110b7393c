"""The fleet's hot set, and warming a worker that joins with it (issue 43).

The router sees every request of the fleet, so it knows which adapters are hot: each request on
an adapter adds to the adapter's score, and a score halves every `half_life_s` (an exponentially
decayed request count; kept as count x 2^(t / half_life) against a moving origin, so a request
costs one dict update and no pass over the set).

A worker that connects with an empty residency (a new replica, or one restarted) is warmed: the
hottest adapters that the fleet's placement would send it (it is their rendezvous first choice
among the live workers, or no other live worker holds them) go to its Prefetch in the worker's
warm form, hottest first, a few at a time. The worker stages them on a background queue of its
own (its host tier, then its GPU pool while that has room within its warm share, never evicting),
so SERVING is not delayed and live traffic keeps its place; requests then move to it through the
normal placement (affinity to where an adapter is, the load bound for the rest).
"""
from __future__ import annotations

import asyncio
import heapq
import logging
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import grpc

from services.common.gen.lorafleet.v1 import worker_pb2 as wpb
from services.common.telemetry import outgoing_metadata
from services.router.placement import WorkerView, rendezvous_order

log = logging.getLogger(__name__)
RENORMALIZE_AT = 2.0 ** 40   # scores are rebased before their growth factor reaches this


@dataclass
class HotEntry:
    score: float                # count x 2^((t - origin) / half_life) at the last request
    ref: wpb.AdapterRef         # the last request's reference (version, tenant, owner, pin)


class HotSet:
    """Decayed request counts per adapter id, with each adapter's latest reference."""

    def __init__(self, half_life_s: float = 300.0, max_entries: int = 100_000,
                 clock: Callable[[], float] = time.monotonic):
        if half_life_s <= 0:
            raise ValueError("half_life_s must be > 0")
        self.half_life_s, self.max_entries, self._clock = half_life_s, max_entries, clock
        self._origin = clock()
        self._entries: dict[str, HotEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _weight(self, now: float) -> float:
        return 2.0 ** ((now - self._origin) / self.half_life_s)

    def saw(self, ref: wpb.AdapterRef) -> None:
        """A request on ref.id (ref kept as the adapter's latest reference)."""
        now = self._clock()
        w = self._weight(now)
        if w > RENORMALIZE_AT:
            self._rebase(now)
            w = 1.0
        entry = self._entries.get(ref.id)
        if entry is None:
            if len(self._entries) >= self.max_entries:
                self._trim()
            self._entries[ref.id] = HotEntry(w, ref)
        else:
            entry.score += w
            entry.ref = ref

    def forget(self, adapter_id: str) -> None:
        """An adapter deleted: no longer warmed anywhere."""
        self._entries.pop(adapter_id, None)

    def rate(self, adapter_id: str) -> float:
        """The adapter's decayed request count now (requests, a half-life's decay each
        half_life_s)."""
        entry = self._entries.get(adapter_id)
        return 0.0 if entry is None else entry.score / self._weight(self._clock())

    def top(self, n: int, keep: Callable[[str], bool] = lambda _: True
            ) -> list[wpb.AdapterRef]:
        """The n hottest adapters for which keep(id) holds, hottest first."""
        ranked = heapq.nlargest(n, (e for a, e in self._entries.items() if keep(a)),
                                key=lambda e: e.score)
        return [e.ref for e in ranked]

    def _rebase(self, now: float) -> None:
        w = self._weight(now)
        for entry in self._entries.values():
            entry.score /= w
        self._origin = now

    def _trim(self) -> None:
        """Drop the coldest tenth (the set is bounded; a dropped adapter starts over)."""
        drop = max(1, len(self._entries) // 10)
        for a, _ in heapq.nsmallest(drop, self._entries.items(), key=lambda kv: kv[1].score):
            del self._entries[a]


def warm_choice(hot: HotSet, worker: str, views: Mapping[str, WorkerView], n: int
                ) -> list[wpb.AdapterRef]:
    """Up to n of the hottest adapters the placement would send `worker`: it is their
    rendezvous first choice among the live workers, or no other live worker holds them; none
    that `worker` already holds."""
    live = [w for w, v in views.items() if not v.draining]
    if worker not in live:
        return []
    others = {w: v for w, v in views.items() if w != worker and not v.draining}
    mine = views[worker]

    def keep(adapter_id: str) -> bool:
        if mine.holds(adapter_id):
            return False
        if not any(v.holds(adapter_id) for v in others.values()):
            return True
        return rendezvous_order(adapter_id, live)[0] == worker
    return hot.top(n, keep)


class Warmer:
    """Sends a joining worker its share of the hot set (warm_choice) through Prefetch(warm),
    `batch` adapters a call, the next call after the worker answered the last."""

    def __init__(self, hot: HotSet, views: Callable[[], Mapping[str, WorkerView]],
                 adapters: int = 64, batch: int = 8, timeout_s: float = 5.0):
        self.hot, self.views = hot, views
        self.adapters, self.batch, self.timeout_s = adapters, batch, timeout_s
        self._tasks: set[asyncio.Task] = set()
        self.sent: dict[str, int] = {}           # worker -> adapters sent in its last warm-up

    def joined(self, addr: str, stub, empty: bool) -> None:
        """A worker connected (its first snapshot); `empty`: it holds no adapter."""
        if not empty or self.adapters <= 0 or not len(self.hot):
            return
        task = asyncio.get_running_loop().create_task(self._warm(addr, stub))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _warm(self, addr: str, stub) -> None:
        refs = warm_choice(self.hot, addr, self.views(), self.adapters)
        if not refs:
            return
        log.info("warming worker %s with %d of the fleet's hot adapters", addr, len(refs))
        self.sent[addr] = 0
        for i in range(0, len(refs), self.batch):
            part = refs[i:i + self.batch]
            try:
                await stub.Prefetch(wpb.PrefetchRequest(adapters=part, warm=True),
                                    timeout=self.timeout_s, metadata=outgoing_metadata())
            except grpc.RpcError as err:
                log.info("warming worker %s stopped: %s", addr, err.code())
                return
            self.sent[addr] += len(part)

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
