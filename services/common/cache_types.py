"""The values services.common.cache_policy hands out: its refusal (NoRoom), its per-tenant
counters (TenantStats) and an entry's snapshot (EntryInfo). No torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class NoRoom(Exception):
    """admit() cannot fit the entry: the rest is pinned; nothing was changed. ``needed``: bytes
    to free; ``reclaimable``: unpinned bytes. The owner waits for an unpin or answers
    RESOURCE_EXHAUSTED."""

    def __init__(self, needed: int, reclaimable: int) -> None:
        super().__init__(f"no room: {needed} bytes needed, {reclaimable} reclaimable (rest pinned)")
        self.needed, self.reclaimable = needed, reclaimable


@dataclass
class TenantStats:
    """Per-tenant counters (hits, misses, evictions) and holdings (bytes, entries) of one tier."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0
    entries: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); 0.0 before any access."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class EntryInfo(NamedTuple):
    """A snapshot of one cached entry."""

    key: str
    tenant: str
    nbytes: int
    pins: int
