"""Adapter name -> concrete adapter version, through the store, with a short-lived cache.

The cache is keyed by (tenant, name) and lives `ttl` seconds, so an alias that moves to a new
version through another router (or straight at the store) is seen within ttl. This router drops
entries at once when it registers or deletes an adapter itself (an alias may have moved), and
when a worker reports that the version it was sent is no longer the store's (`invalidate`): the
request path then resolves again and retries. An epoch counter keeps a resolution that was in
flight during an invalidation from putting the stale answer back. While the store is
unreachable, the last answer for a name stands: adapters resident on workers keep serving.
An admin write (Register, SetAlias, DeleteAdapter) drops only the names it touched, in every
owner scope (`invalidate(*names)`), so the other names keep that fallback. The outage is logged
once when it starts and once when the store answers again, not on every request.
A tenant that never resolved the name may then take another tenant's last answer for it, but
only one it could see itself (a shared adapter, or its own; `_known`): a private adapter never
reaches another tenant, and an id answers before an alias as in the store's lookup. (A tenant
alias that the store would prefer over a shared alias of the same name is not known here; the
shared answer stands until the store is back.) A name nobody resolved gets UNAVAILABLE naming
the store's address.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services.common.errors import Unavailable, from_rpc_error
from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb, adapter_store_pb2_grpc
from services.common.gen.lorafleet.v1 import router_pb2
from services.common.telemetry import outgoing_metadata

MAX_ENTRIES = 100_000
# the store is unreachable: a cached answer, however old, beats refusing a resident adapter
STORE_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
log = logging.getLogger(__name__)


class Resolver:
    def __init__(self, channel: grpc.aio.Channel, ttl: float = 1.0, store_addr: str = ""):
        self.stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
        self.ttl = ttl
        self.store_addr = store_addr
        self._cache: dict[tuple[str, str], tuple[float, router_pb2.AdapterInfo]] = {}
        # name -> {owner ('' = shared): (time, answer)}: the last answer for a name from any
        # tenant, for tenants that never resolved it while the store is down
        self._known: dict[str, dict[str, tuple[float, router_pb2.AdapterInfo]]] = {}
        self._epoch = 0
        self._pending: dict[tuple[str, str], asyncio.Future] = {}
        self.lookups = 0            # store round trips (for tests and stats)
        self.store_down = False     # the last round trip found the store unreachable

    async def resolve(self, name: str, tenant: str,
                      timeout: float | None = None) -> router_pb2.AdapterInfo:
        """The adapter `name` (id or alias) as `tenant` sees it; NOT_FOUND if invisible.

        Concurrent misses for one (tenant, name) share one store round trip (a burst of a
        thousand requests is one Resolve, not a thousand)."""
        key = (tenant, name)
        hit = self._cache.get(key)
        if hit and time.monotonic() - hit[0] < self.ttl:
            return hit[1]
        pending = self._pending.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._lookup(key, timeout))
            self._pending[key] = pending
            pending.add_done_callback(lambda f: self._landed(key, f))
        return await asyncio.shield(pending)

    def _landed(self, key: tuple[str, str], future: asyncio.Future) -> None:
        if self._pending.get(key) is future:
            del self._pending[key]
        if not future.cancelled():
            future.exception()      # retrieved: waiters that were cancelled left it unread

    async def _lookup(self, key: tuple[str, str], timeout: float | None
                      ) -> router_pb2.AdapterInfo:
        tenant, name = key
        epoch, now = self._epoch, time.monotonic()
        self.lookups += 1
        try:
            resp = await self.stub.Resolve(spb.ResolveRequest(name=name, tenant=tenant),
                                           timeout=timeout or 10.0, metadata=outgoing_metadata())
        except grpc.RpcError as err:
            if err.code() not in STORE_DOWN:
                self._store_back()
                raise from_rpc_error(err) from None
            return self._fallback(key, err, now)
        self._store_back()
        if epoch == self._epoch:
            if len(self._cache) >= MAX_ENTRIES:
                self._cache.clear()
                self._known.clear()
            self._cache[key] = (now, resp.adapter)
            owner = "" if resp.adapter.shared else resp.adapter.owner
            self._known.setdefault(name, {})[owner] = (now, resp.adapter)
        return resp.adapter

    def _fallback(self, key: tuple[str, str], err: grpc.RpcError, now: float
                  ) -> router_pb2.AdapterInfo:
        """The store is unreachable: the last answer stands (the adapter may be resident on a
        worker, which needs no store) until the store answers again; UNAVAILABLE without one."""
        tenant, name = key
        if not self.store_down:
            self.store_down = True
            log.warning("adapter store unreachable at %s (%s: %s): adapters resolve from their "
                        "last answers until it is back", self.store_addr or "?",
                        err.code().name, err.details())
        stale = self._cache.get(key) or self._known_for(name, tenant)
        if stale is None:
            raise Unavailable(f"adapter store unreachable at {self.store_addr or '?'}: "
                              f"{err.code().name}: {err.details()}") from None
        log.debug("%r for %s resolved from a %.0f s old answer", name, tenant, now - stale[0])
        return stale[1]

    def _store_back(self) -> None:
        if self.store_down:
            self.store_down = False
            log.warning("adapter store at %s answers again", self.store_addr or "?")

    def _known_for(self, name: str, tenant: str
                   ) -> tuple[float, router_pb2.AdapterInfo] | None:
        """Another tenant's last answer for `name` that `tenant` may take: a shared adapter or
        the tenant's own (never a private one of someone else); the adapter whose id is the
        name first, then the tenant's own, then a shared one (the store's order)."""
        seen = self._known.get(name, {})
        fits = [seen[o] for o in (tenant, "") if o in seen
                and (seen[o][1].shared or seen[o][1].owner == tenant)]
        base = name.partition("@")[0]
        fits.sort(key=lambda hit: hit[1].id != base)        # stable: own before shared
        return fits[0] if fits else None

    def invalidate(self, *names: str) -> None:
        """Forget every entry (no names), or, in every tenant's scope, those for each name
        (an id, an alias or NAME@VERSION) or resolving to an adapter of that id; the answers
        for other names stay (the store-outage fallback among them)."""
        self._epoch += 1
        if not names:
            self._cache.clear()
            self._known.clear()
            self._pending.clear()       # lookups in flight may answer from before the change
            return
        touched = set(names) | {n.partition("@")[0] for n in names}
        for key in [k for k, (_, a) in self._cache.items() if {k[1], a.id} & touched]:
            del self._cache[key]
        for known in [k for k, seen in self._known.items()
                      if k in touched or any(a.id in touched for _, a in seen.values())]:
            del self._known[known]
        for key in [k for k in self._pending if k[1] in touched]:
            del self._pending[key]
