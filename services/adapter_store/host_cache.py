"""The store host tier: validated adapter blobs in memory, keyed by version, byte-budgeted.

Eviction is services.common.cache_policy.CachePolicy (LRU with per-tenant caps; shared adapters
count as tenant ""). Only blobs whose digest matched their registered version are put here, so a
hit is served without re-checking. A blob larger than what the tier can free is simply not kept.
Blobs are immutable `bytes`: a Fetch streaming one keeps it alive even if it is evicted meanwhile.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.common.cache_policy import CachePolicy, NoRoom


@dataclass(frozen=True)
class HostTierStats:
    hits: int
    misses: int
    resident: int
    bytes: int
    evictions: int


class HostCache:
    """version -> blob, with hit/miss counters for Stats and /metrics."""

    def __init__(self, capacity_bytes: int, tenant_share: float | None):
        self._policy = CachePolicy(capacity_bytes, tenant_share=tenant_share,
                                   foothold=tenant_share is not None)
        self._blobs: dict[str, bytes] = {}
        self._hits = self._misses = self._evictions = 0

    def get(self, version: str) -> bytes | None:
        """The blob (a hit, now most recent) or None (a miss, counted)."""
        blob = self._blobs.get(version)
        if blob is not None and self._policy.touch(version):
            self._hits += 1
            return blob
        self._misses += 1
        return None

    def put(self, version: str, tenant: str, blob: bytes) -> list[str]:
        """Keep blob unless it cannot fit; returns the versions evicted to make room."""
        try:
            victims = self._policy.admit(version, tenant, len(blob), count_miss=False)
        except NoRoom:
            return []
        for victim in victims:
            self._blobs.pop(victim, None)
        self._evictions += len(victims)
        self._blobs[version] = blob
        return victims

    def remove(self, version: str) -> None:
        """Drop a version (its adapter was deleted or replaced)."""
        if self._blobs.pop(version, None) is not None:
            self._policy.remove(version)

    def __contains__(self, version: str) -> bool:
        return version in self._blobs

    def stats(self) -> HostTierStats:
        return HostTierStats(self._hits, self._misses, len(self._blobs),
                             self._policy.used_bytes, self._evictions)
