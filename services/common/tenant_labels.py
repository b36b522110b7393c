"""A bounded `tenant` label: the top-N tenants by traffic keep their own name, the rest share
"other", so 10k tenants make at most N + 1 series a metric (times its other labels).

Every metric with a tenant label takes its label through one TenantLabels (the router's and
the worker's `--metrics-tenants N`), with tenant its first label. The set of named tenants is
kept stable: a tenant is named while there is room; once N are named, a tenant whose traffic
passes 1.25x the least-trafficked named tenant's takes its place. The one demoted loses its
series on every family that named it (they end, as a departed pod's do) and its further
traffic goes to "other". No series ever counts down: counters stay monotonic, so rate() and
increase() hold across the swap (the promoted tenant's series start at 0; its earlier traffic
stays in "other").

Traffic is counted per request (`note`); label lookups (`labels`) add none. Thread-safe (a
lock): called from event loops and loader threads, never from the engine's step."""
from __future__ import annotations

import threading

OTHER = "other"
HYSTERESIS = 1.25


class TenantLabels:
    def __init__(self, limit: int = 50, track: int | None = None):
        if limit < 0:
            raise ValueError(f"tenant label limit must be >= 0, got {limit}")
        self.limit = limit
        self.track = track if track is not None else max(1000, 10 * limit)
        self._traffic: dict[str, float] = {}     # tenants seen recently -> requests
        self._named: dict[str, list] = {}        # named tenant -> [(family, rest labels)]
        self._lock = threading.Lock()

    def note(self, tenant: str, weight: float = 1.0) -> str:
        """One request of tenant's: count it, maybe name the tenant; returns its label."""
        with self._lock:
            seen = self._traffic.get(tenant, 0.0) + weight
            self._traffic[tenant] = seen
            if tenant not in self._named and tenant != OTHER:
                self._consider(tenant, seen)
            if len(self._traffic) > self.track:
                self._forget()
            return tenant if tenant in self._named else OTHER

    def label(self, tenant: str) -> str:
        return tenant if tenant in self._named else OTHER

    def labels(self, family, tenant: str, *rest: str):
        """family.labels(label(tenant), *rest), remembered so a demotion can remove it."""
        with self._lock:
            children = self._named.get(tenant)
            if children is None:
                return family.labels(OTHER, *rest)
            key = (family, rest)
            if key not in children:
                children.append(key)
            return family.labels(tenant, *rest)

    def named(self) -> list[str]:
        with self._lock:
            return list(self._named)

    # --- under the lock -------------------------------------------------------------------
    def _consider(self, tenant: str, seen: float) -> None:
        if len(self._named) < self.limit:
            self._named[tenant] = []
            return
        if not self._named:
            return
        floor = min(self._named, key=lambda t: self._traffic.get(t, 0.0))
        if seen > HYSTERESIS * self._traffic.get(floor, 0.0):
            for family, rest in self._named.pop(floor):
                try:
                    family.remove(floor, *rest)
                except KeyError:
                    pass
            self._named[tenant] = []

    def _forget(self) -> None:
        """Drop the least-trafficked half of the unnamed tenants seen (bounds the memory)."""
        unnamed = sorted((t for t in self._traffic if t not in self._named),
                         key=self._traffic.__getitem__)
        for t in unnamed[:len(unnamed) // 2 + 1]:
            del self._traffic[t]
