"""Waiting for room in the device pool, first come first served (services.worker.adapters.manager).

A load the pool has no room for joins the queue. The oldest waiter (the head), when no free
range fits it, gets a window: the contiguous range of its size that holds the fewest bytes the
policy keeps from its tenant (caps: others' footholds), then the fewest pinned bytes, then the
fewest of other tenants'. While it waits nothing new may pin an adapter in the window (a hit on
one waits its turn) and no other load is placed in it or evicts more than the policy chose for
it; so the window's pins only drain, their rows finish, and the head gets its range within a
bound however many small adapters keep arriving. Before, each newcomer took the room a release
freed and fragmented the pool with its pins: a large adapter could wait till its deadline, and
the next request for it again ("waiting, loading" for minutes).

Nothing here runs while nobody waits: the queue is empty, `blocks` is never asked, and every
placement is first fit as before. The owner calls every method but `wait`/`notify` under its
pool lock.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

from services.common.errors import ResourceExhausted

ROOM_MARGIN_S = 0.5      # a wait for adapter room ends this long before the request's deadline


class RoomQueue:
    def __init__(self) -> None:
        self._tickets: dict[str, int] = {}              # key -> elements, oldest first
        self.window: tuple[int, int] | None = None      # the head's [start, end), in elements
        self._freed = asyncio.Condition()

    def __bool__(self) -> bool:
        return bool(self._tickets)

    def __contains__(self, key: str) -> bool:
        return key in self._tickets

    def is_head(self, key: str) -> bool:
        return next(iter(self._tickets), None) == key

    def join(self, key: str, elements: int) -> None:
        """key waits for room (again: it keeps its place)."""
        self._tickets.setdefault(key, elements)

    def leave(self, key: str) -> bool:
        """key no longer waits (placed, cancelled, timed out, failed); True if it did."""
        if self.is_head(key):
            self.window = None                  # the next head plans its own
        return self._tickets.pop(key, None) is not None

    def avoid(self, key: str) -> tuple[int, int] | None:
        """The range a placement for key must keep out of: the head's window, unless key is
        the head."""
        return None if self.is_head(key) else self.window

    def blocks(self, span: tuple[int, int] | None, key: str) -> bool:
        """Whether a new pin of key (placed at span = (start, elements)) must wait: it lies in
        the head's window and key is not the head."""
        w = self.window
        return (w is not None and span is not None and not self.is_head(key)
                and span[0] < w[1] and span[0] + span[1] > w[0])

    def plan(self, key: str, ranges: list[tuple[int, int, str]], capacity: int,
             pinned: Callable[[str], bool], kept: frozenset[str] = frozenset(),
             own: frozenset[str] = frozenset()) -> tuple[int, int]:
        """The head's window, chosen at its first try and kept until it leaves (so its pins only
        drain). ranges: (start, elements, key) of what the pool holds; capacity in elements."""
        if self.window is None and self.is_head(key):
            self.window = _best_window(self._tickets[key], ranges, capacity, pinned, kept, own)
        return self.window

    def occupants(self, ranges: list[tuple[int, int, str]]) -> list[str]:
        """Keys placed in the window."""
        s, e = self.window or (0, 0)
        return [k for start, n, k in ranges if start < e and start + n > s]

    async def notify(self) -> None:
        async with self._freed:
            self._freed.notify_all()

    async def wait(self, deadline: float | None, key: str, counter=None) -> None:
        """Wait (at most a second) for room to be freed. Gives up ROOM_MARGIN_S before the
        request's deadline, so that the caller hears RESOURCE_EXHAUSTED, not DEADLINE_EXCEEDED.
        counter: its `waiters` counts the wait (the residency's)."""
        remaining = None if deadline is None else deadline - time.monotonic() - ROOM_MARGIN_S
        if remaining is not None and remaining <= 0:
            raise ResourceExhausted(f"no adapter room on this worker for {key}", retry_after=1.0)
        if counter is not None:
            counter.waiters += 1
        try:
            async with self._freed:
                await asyncio.wait_for(self._freed.wait(), timeout=min(remaining or 1.0, 1.0))
        except asyncio.TimeoutError:
            pass
        finally:
            if counter is not None:
                counter.waiters -= 1


def window_busy(room: RoomQueue, pool, policy, key: str, tenant: str, nbytes: int) -> bool:
    """For the oldest waiter that does not fit in a free range now: its window planned (at its
    first try; away from what the policy keeps from its tenant, then from pins); True while a
    pinned adapter is still in it. False for any other load."""
    if not room.is_head(key) or pool.alloc.largest_hole * pool.elem >= nbytes:
        return False
    ranges = pool.ranges()
    own = frozenset(e.key for e in policy.entries() if e.tenant == tenant)
    room.plan(key, ranges, pool.alloc.capacity, policy.is_pinned,
              policy.protected(tenant, nbytes), own)
    return any(policy.is_pinned(k) for k in room.occupants(ranges))


def next_victim(room: RoomQueue, pool, policy, key: str) -> str | None:
    """The next unpinned adapter to evict when the policy has admitted key but the pool has no
    range (or slot) for it: the oldest waiter's window first; another load evicts no more than
    the policy chose (it waits: the room it would take beside the window is the waiter's)."""
    unpinned = (e.key for e in policy.entries() if e.pins == 0 and e.key != key
                and pool.slot_of(e.key) is not None)
    if room.window is None:
        return next(unpinned, None)
    if not room.is_head(key):
        return None         # what the policy chose gave no room outside the window: it waits
    inside = (k for k in room.occupants(pool.ranges()) if policy.contains(k)
              and not policy.is_pinned(k))
    return next(inside, None) or next(unpinned, None)


def _best_window(need: int, ranges: list[tuple[int, int, str]], capacity: int,
                 pinned: Callable[[str], bool], kept: frozenset[str], own: frozenset[str]
                 ) -> tuple[int, int]:
    """[start, start + need) with the fewest elements of kept adapters (the policy would not
    evict them for this tenant), then of pinned ones, then of other tenants' (own: the
    waiter's tenant's), then of any; starts tried: 0 and every range's start and end (ranges
    are aligned, so every window is)."""
    starts = sorted({0, *(s for s, _, _ in ranges), *(s + n for s, n, _ in ranges)})
    best, best_cost = (0, need), None
    for s in starts:
        e = s + need
        if e > capacity:
            break
        held = [(n, k) for start, n, k in ranges if start < e and start + n > s]
        cost = (sum(n for n, k in held if k in kept), sum(n for n, k in held if pinned(k)),
                sum(n for n, k in held if k not in own), sum(n for n, _ in held))
        if best_cost is None or cost < best_cost:
            best, best_cost = (s, e), cost
    return best
