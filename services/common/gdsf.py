"""Greedy-Dual-Size-Frequency priorities, the cost-aware eviction order of CachePolicy (no torch).

GDSF (L. Cherkasova, "Improving WWW Proxies Performance with Greedy-Dual-Size-Frequency Caching
Policy", HP Labs HPL-98-69R1, 1998; after Cao and Irani's GreedyDual-Size, USITS 1997) gives
each entry the priority

    H = L + frequency * cost / size

and evicts the lowest H first. cost: what a miss on the entry costs (for an adapter tier, its
expected reload time); size: its bytes; frequency: its accesses since it was admitted. L, the
cache's clock, rises to the priority of what was evicted, so an entry that is not used again
ages below newer ones: without it frequency alone would keep yesterday's hot entries forever.
An entry's H is recomputed with the current L whenever it is used (admitted, hit, unpinned).
Ties go to the least recently used.

Only the order lives here; CachePolicy keeps the pins, caps and footholds and asks for an order
of the keys each eviction phase may take.
"""
from __future__ import annotations

import heapq
from typing import Iterable, Iterator


class GDSF:
    """Per-key frequency, cost and priority. Not thread-safe: CachePolicy holds its lock."""

    __slots__ = ("clock", "_freq", "_cost", "_size", "_prio", "_seq", "_tick")

    def __init__(self) -> None:
        self.clock = 0.0
        self._freq: dict[str, int] = {}
        self._cost: dict[str, float] = {}
        self._size: dict[str, int] = {}
        self._prio: dict[str, float] = {}
        self._seq: dict[str, int] = {}
        self._tick = 0

    def admit(self, key: str, nbytes: int, cost: float) -> None:
        """A new entry: frequency 1."""
        self._freq[key], self._cost[key], self._size[key] = 1, float(cost), max(1, nbytes)
        self._update(key)

    def access(self, key: str) -> None:
        """A hit (or a refresh): one more use."""
        self._freq[key] += 1
        self._update(key)

    def used(self, key: str) -> None:
        """Used again without a new access (an unpin): priority from the current clock."""
        self._update(key)

    def set_cost(self, key: str, cost: float) -> None:
        """The entry's reload cost changed (e.g. the copy below it went)."""
        self._cost[key] = float(cost)
        self._update(key)

    def priority(self, key: str) -> float:
        return self._prio[key]

    def forget(self, key: str) -> None:
        for table in (self._freq, self._cost, self._size, self._prio, self._seq):
            table.pop(key, None)

    def evicted(self, keys: Iterable[str]) -> None:
        """keys were evicted by one admission: the clock rises to the lowest of their priorities
        (an entry that went for a cap, not for its priority, does not inflate the clock)."""
        prios = [self._prio[k] for k in keys if k in self._prio]
        if prios:
            self.clock = max(self.clock, min(prios))
        for key in keys:
            self.forget(key)

    def order(self, keys: Iterable[str]) -> Iterator[str]:
        """keys, lowest priority first (ties: least recently used first); lazy: a heap."""
        heap = [(self._prio[k], self._seq[k], k) for k in keys]
        heapq.heapify(heap)
        while heap:
            yield heapq.heappop(heap)[2]

    def _update(self, key: str) -> None:
        self._tick += 1
        self._seq[key] = self._tick
        self._prio[key] = self.clock + self._freq[key] * self._cost[key] / self._size[key]
