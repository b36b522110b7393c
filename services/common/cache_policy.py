"""Byte-budgeted LRU with pins, per-tenant caps and footholds, for the worker GPU pool, the worker
host tier, the store host tier and bench/capacity_sim.py (no torch). It only does bookkeeping:
it decides *which* keys go; the owner frees the bytes.

``eviction="cost"`` replaces "least recently used" in every step below by "lowest
Greedy-Dual-Size-Frequency priority" (``clock + frequency * reload cost / bytes``, see
services/common/gdsf.py): an adapter that is used often and slow to reload stays before a big,
cheap, rarely used one. Caps, footholds and pins are the same in both modes.

Eviction, when an admission needs room, takes victims in this order until the entry fits:

1. caps on: entries of inactive tenants (nobody waits for them), longest idle tenant first;
2. caps on, the requester is over its cap and another tenant is active: the requester's own LRU
   entries (a heavy tenant recycles its own slice instead of everyone else's);
3. caps on: entries of other tenants over their cap, the largest excess first, LRU within one;
4. LRU among all unpinned entries, skipping footholds; 5. footholds too, but only for a
   requester within its cap: a tenant over its cap never takes another active tenant's
   foothold; it gets NoRoom and waits for its own pins to go (caps on).

Cap: ``max(tenant_share, 1 / active tenants) * capacity``: the active tenants' fair share, but
never below ``tenant_share`` of the tier (an entry larger than that: its own size, so a tenant
holding nothing else may bring it in). Caps order evictions and refuse an admission only
to protect a foothold, so a tenant alone may fill the tier. Foothold: the most recent unpinned entry of each active tenant
with nothing pinned (not the requester's: its new entry becomes its foothold). Pinned entries
(ref-counted: in use by a running row) are never evicted. ``tenant_share=None, foothold=False``
(``plain_lru``) is plain LRU, for the measured comparison "with caps vs without".

Active tenants: those the owner names (``set_active_tenants``: a worker knows whose rows wait or
run); until it does, those that admitted or hit an entry in the last ``active_window`` accesses.
Cost: touch/pin/unpin/remove O(1); admit O(T log T + victims), T = tenants (cost mode: plus
O(n) to order the n candidate entries of a phase). Thread-safe.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterable, Iterator

from services.common.cache_types import EntryInfo, NoRoom, TenantStats
from services.common.gdsf import GDSF

__all__ = ["EVICTIONS", "CachePolicy", "EntryInfo", "NoRoom", "TenantStats"]

EVICTIONS = ("lru", "cost")


class _Entry:
    __slots__ = ("tenant", "nbytes", "pins")

    def __init__(self, tenant: str, nbytes: int) -> None:
        self.tenant, self.nbytes, self.pins = tenant, nbytes, 0


class _Tenant:
    """A tenant's holdings: unpinned keys in LRU order (oldest first), bytes, pinned count."""

    __slots__ = ("lru", "bytes", "pinned", "stats", "last_access")

    def __init__(self) -> None:
        self.lru: OrderedDict[str, None] = OrderedDict()
        self.bytes = self.pinned = 0
        self.stats, self.last_access = TenantStats(), -(1 << 62)


class CachePolicy:
    """Byte-budgeted LRU over keys owned by tenants; see the module docstring for the rules.

    capacity_bytes: the tier's budget. tenant_share: per-tenant cap as a fraction of capacity
    (None: no caps). foothold: keep every active tenant's most recent entry until nothing else can
    go. active_window: accesses after which a silent tenant stops being active (automatic mode).
    eviction: "lru", or "cost" (GDSF order; admit's ``cost`` is the entry's reload cost).
    """

    def __init__(self, capacity_bytes: int, tenant_share: float | None = 0.5,
                 foothold: bool = True, active_window: int = 1024,
                 eviction: str = "lru") -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if tenant_share is not None and not 0.0 < tenant_share <= 1.0:
            raise ValueError(f"tenant_share must be in (0, 1] or None, got {tenant_share}")
        if active_window < 1:
            raise ValueError(f"active_window must be >= 1, got {active_window}")
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
        self._gdsf = GDSF() if eviction == "cost" else None
        self._capacity, self._share = int(capacity_bytes), tenant_share
        self._foothold, self._window = foothold, active_window
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # unpinned keys, oldest first
        self._tenants: dict[str, _Tenant] = {}
        self._used = self._pinned_bytes = self._tick = 0
        self._explicit_active: frozenset[str] | None = None

    @classmethod
    def plain_lru(cls, capacity_bytes: int, eviction: str = "lru") -> CachePolicy:
        """Plain byte-budgeted LRU (or GDSF, eviction="cost") with pins: no caps, no footholds."""
        return cls(capacity_bytes, tenant_share=None, foothold=False, eviction=eviction)

    @property
    def eviction(self) -> str:
        """"lru" or "cost"."""
        return "lru" if self._gdsf is None else "cost"

    @property
    def capacity_bytes(self) -> int:
        """The tier's byte budget."""
        return self._capacity

    @property
    def used_bytes(self) -> int:
        """Bytes held by admitted entries (pinned or not)."""
        return self._used

    @property
    def free_bytes(self) -> int:
        """capacity_bytes - used_bytes."""
        return self._capacity - self._used

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def contains(self, key: str) -> bool:
        """Whether key is admitted (no recency change, no counters)."""
        return key in self._entries

    def is_pinned(self, key: str) -> bool:
        """Whether key is admitted and pinned."""
        entry = self._entries.get(key)
        return entry is not None and entry.pins > 0

    def entries(self) -> list[EntryInfo]:
        """Snapshot: unpinned entries least recent first, then the pinned ones."""
        with self._lock:
            keys = list(self._lru) + [k for k, e in self._entries.items() if e.pins]
            return [EntryInfo(k, e.tenant, e.nbytes, e.pins)
                    for k, e in ((k, self._entries[k]) for k in keys)]

    def tenant_bytes(self, tenant: str) -> int:
        """Bytes the tenant holds in this tier."""
        state = self._tenants.get(tenant)
        return state.bytes if state else 0

    def stats(self) -> dict[str, TenantStats]:
        """Per-tenant counters (copies): hits, misses, evictions, bytes, entries."""
        with self._lock:
            return {t: TenantStats(s.stats.hits, s.stats.misses, s.stats.evictions, s.bytes,
                                   len(s.lru) + s.pinned) for t, s in self._tenants.items()}

    def totals(self) -> TenantStats:
        """The per-tenant counters summed over tenants (the tier's hits, misses, ...)."""
        per_tenant = self.stats().values()
        return TenantStats(*(sum(getattr(s, f) for s in per_tenant)
                             for f in ("hits", "misses", "evictions", "bytes", "entries")))

    def set_active_tenants(self, tenants: Iterable[str] | None) -> None:
        """Tell the policy which tenants are active (waiting or running); None: automatic mode."""
        with self._lock:
            self._explicit_active = None if tenants is None else frozenset(tenants)

    def active_tenants(self) -> frozenset[str]:
        """The tenants the caps and footholds currently consider active."""
        with self._lock:
            return self._active()

    def _active(self) -> frozenset[str]:
        if self._explicit_active is not None:
            return self._explicit_active
        horizon = self._tick - self._window
        return frozenset(t for t, s in self._tenants.items() if s.last_access > horizon)

    def _note_access(self, tenant: str) -> _Tenant:
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant()
        self._tick += 1
        state.last_access = self._tick
        return state

    def touch(self, key: str) -> bool:
        """A hit: move key to most-recently-used and count it. False (nothing counted) if absent."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            self._refresh(key, pin=False).stats.hits += 1
            return True

    def admit(self, key: str, tenant: str, nbytes: int, *, pin: bool = False,
              count_miss: bool = True, cost: float | None = None) -> list[str]:
        """Reserve nbytes for a new entry; return the keys the caller must now evict.

        The returned keys are already removed from the policy. Raises NoRoom (nothing changed)
        when the rest is pinned. An already admitted key is refreshed and [] returned.
        pin: admit pinned (e.g. while it loads). count_miss=False for prefetches and demotions.
        cost: what reloading it would cost (seconds, say; eviction="cost" only; None: nbytes,
        i.e. every byte costs the same and the order is frequency with aging).
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            if key in self._entries:
                self._refresh(key, pin)
                return []
            victims = self._choose_victims(tenant, nbytes)
            if self._gdsf is not None:
                self._gdsf.evicted(victims)
            for victim in victims:
                self._drop(victim, evicted=True)
            state = self._note_access(tenant)
            if count_miss:
                state.stats.misses += 1
            self._entries[key] = _Entry(tenant, nbytes)
            state.bytes += nbytes
            self._used += nbytes
            self._lru[key] = state.lru[key] = None
            if self._gdsf is not None:
                self._gdsf.admit(key, nbytes, nbytes if cost is None else cost)
            if pin:
                self._pin(key)
            return victims

    def set_cost(self, key: str, cost: float) -> None:
        """The entry's reload cost changed (eviction="cost"; a no-op for LRU or a missing key)."""
        with self._lock:
            if self._gdsf is not None and key in self._entries:
                self._gdsf.set_cost(key, cost)

    def _refresh(self, key: str, pin: bool) -> _Tenant:
        """Make key most recently used (and pin it); returns its tenant's state."""
        entry = self._entries[key]
        state = self._note_access(entry.tenant)
        if not entry.pins:
            self._lru.move_to_end(key)
            state.lru.move_to_end(key)
        if self._gdsf is not None:
            self._gdsf.access(key)
        if pin:
            self._pin(key)
        return state

    def pin(self, key: str) -> None:
        """Mark key in use (ref-counted); a pinned entry is never evicted. KeyError if absent."""
        with self._lock:
            self._pin(key)

    def _pin(self, key: str) -> None:
        entry = self._entries[key]
        entry.pins += 1
        if entry.pins == 1:
            self._pinned_bytes += entry.nbytes
            state = self._tenants[entry.tenant]
            del self._lru[key]
            del state.lru[key]
            state.pinned += 1

    def unpin(self, key: str) -> None:
        """Release one pin; the last one makes the entry most-recently-used again."""
        with self._lock:
            entry = self._entries[key]
            if entry.pins <= 0:
                raise ValueError(f"{key!r} is not pinned")
            entry.pins -= 1
            if entry.pins == 0:
                self._pinned_bytes -= entry.nbytes
                state = self._tenants[entry.tenant]
                state.pinned -= 1
                self._lru[key] = state.lru[key] = None
                if self._gdsf is not None:
                    self._gdsf.used(key)

    def remove(self, key: str) -> bool:
        """Forget key (the owner dropped it). False if absent; ValueError if it is pinned."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            if entry.pins:
                raise ValueError(f"{key!r} is pinned ({entry.pins}); unpin it first")
            self._drop(key, evicted=False)
            return True

    def _drop(self, key: str, *, evicted: bool) -> None:
        entry = self._entries.pop(key)
        state = self._tenants[entry.tenant]
        del self._lru[key]
        del state.lru[key]
        state.bytes -= entry.nbytes
        self._used -= entry.nbytes
        if self._gdsf is not None:
            self._gdsf.forget(key)
        if evicted:
            state.stats.evictions += 1

    def protected(self, tenant: str, nbytes: int) -> frozenset[str]:
        """Keys an admission of nbytes by tenant may not evict: the other active tenants'
        footholds while it would be over its cap (caps on); else none."""
        with self._lock:
            active = self._active() | {tenant}
            if not self._foothold or self._share is None or len(active) < 2 or not self._over(
                    tenant, nbytes, self._cap(len(active))):
                return frozenset()
            return self._footholds(active, tenant)

    def _choose_victims(self, tenant: str, nbytes: int) -> list[str]:
        """Keys to evict so nbytes fit, in policy order; raises NoRoom if they cannot."""
        need = nbytes - (self._capacity - self._used)
        if need <= 0:
            return []
        reclaimable = self._used - self._pinned_bytes
        if need > reclaimable:
            raise NoRoom(need, reclaimable)
        chosen: dict[str, None] = {}  # an ordered set
        freed = 0
        for key in self._candidates(tenant, nbytes):
            if key in chosen:
                continue
            chosen[key] = None
            freed += self._entries[key].nbytes
            if freed >= need:
                return list(chosen)
        raise NoRoom(need, freed)

    def _candidates(self, tenant: str, nbytes: int) -> Iterator[str]:
        """Unpinned keys in eviction order (may repeat; the last phase yields every one)."""
        active = self._active() | {tenant}
        footholds = self._footholds(active, tenant) if self._foothold else frozenset()
        if self._share is not None:
            cap = self._cap(len(active))
            yield from self._idle_entries(active)
            if len(active) > 1:
                yield from self._own_over_cap(tenant, nbytes, cap)
            yield from self._others_over_cap(tenant, cap, footholds)
        if footholds:
            yield from (k for k in self._order(self._lru) if k not in footholds)
            if self._share is not None and len(active) > 1 and self._over(tenant, nbytes, cap):
                return      # a tenant over its cap never takes another's foothold: it waits
        yield from self._order(self._lru)

    def _order(self, keys: OrderedDict[str, None]) -> Iterator[str]:
        """Unpinned keys in eviction order: least recent first, or lowest GDSF priority."""
        return iter(keys) if self._gdsf is None else self._gdsf.order(keys)

    def _over(self, tenant: str, nbytes: int, cap: float) -> bool:
        """Whether the tenant would be over its cap with the new entry. An entry larger than the
        cap is within it while the tenant holds nothing else: else it could never come in while
        the other active tenants keep footholds (a rank-64 adapter in a pool of 1.5 of them)."""
        state = self._tenants.get(tenant)
        return (state.bytes if state else 0) + nbytes > max(cap, nbytes)

    def _cap(self, n_active: int) -> float:
        return max(self._share or 1.0, 1.0 / max(1, n_active)) * self._capacity

    def _idle_entries(self, active: frozenset[str]) -> Iterator[str]:
        """Entries of inactive tenants, the longest idle tenant first."""
        idle = sorted((s.last_access, name) for name, s in self._tenants.items()
                      if name not in active and s.lru)
        for _, name in idle:
            yield from self._order(self._tenants[name].lru)

    def _footholds(self, active: frozenset[str], requester: str) -> frozenset[str]:
        keys = []
        for name in active:
            state = self._tenants.get(name)
            if name != requester and state and state.lru and not state.pinned:
                keys.append(next(reversed(state.lru)))
        return frozenset(keys)

    def _own_over_cap(self, tenant: str, nbytes: int, cap: float) -> Iterator[str]:
        state = self._tenants.get(tenant)
        held = state.bytes + nbytes if state else 0
        for key in self._order(state.lru) if state else ():
            if held <= cap:
                return
            held -= self._entries[key].nbytes
            yield key

    def _others_over_cap(self, tenant: str, cap: float, footholds: frozenset[str]
                         ) -> Iterator[str]:
        """Entries of other over-cap tenants, the largest excess first, LRU within a tenant."""
        excess, queues = {}, {}
        for name, state in self._tenants.items():
            if name != tenant and state.bytes > cap and state.lru:
                excess[name] = state.bytes - cap
                queues[name] = (k for k in self._order(state.lru) if k not in footholds)
        while excess:
            name = max(excess, key=excess.__getitem__)
            key = next(queues[name], None)
            if key is None:
                del excess[name]
                continue
            excess[name] -= self._entries[key].nbytes
            if excess[name] <= 0:
                del excess[name]
            yield key
