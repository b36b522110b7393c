"""Adapter name -> concrete adapter version, through the store, with a short-lived cache.

The cache is keyed by (tenant, name) and lives `ttl` seconds, so an alias that moves to a new
version through another router (or straight at the store) is seen within ttl. This router drops
entries at once when it registers or deletes an adapter itself (an alias may have moved), and
when a worker reports that the version it was sent is no longer the store's (`invalidate`): the
request path then resolves again and retries. An epoch counter keeps a resolution that was in
flight during an invalidation from putting the stale answer back. While the store is
unreachable, the last answer for a name stands: adapters resident on workers keep serving.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services.common.errors import from_rpc_error
from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb, adapter_store_pb2_grpc
from services.common.gen.lorafleet.v1 import router_pb2
from services.common.telemetry import outgoing_metadata

MAX_ENTRIES = 100_000
# the store is unreachable: a cached answer, however old, beats refusing a resident adapter
STORE_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
log = logging.getLogger(__name__)


class Resolver:
    def __init__(self, channel: grpc.aio.Channel, ttl: float = 1.0):
        self.stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
        self.ttl = ttl
        self._cache: dict[tuple[str, str], tuple[float, router_pb2.AdapterInfo]] = {}
        self._epoch = 0
        self._pending: dict[tuple[str, str], asyncio.Future] = {}
        self.lookups = 0            # store round trips (for tests and stats)

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
            stale = self._cache.get(key)
            if stale is not None and err.code() in STORE_DOWN:
                # the store is unreachable: the last answer stands (the adapter may be
                # resident on a worker, which needs no store), until the store answers again
                log.warning("store unreachable (%s): %r for %s resolved from a %.0f s old "
                            "answer", err.code().name, name, tenant, now - stale[0])
                return stale[1]
            raise from_rpc_error(err) from None
        if epoch == self._epoch:
            if len(self._cache) >= MAX_ENTRIES:
                self._cache.clear()
            self._cache[key] = (now, resp.adapter)
        return resp.adapter

    def invalidate(self, name: str | None = None) -> None:
        """Forget every entry (name None), or those for `name` or resolving to adapter `name`."""
        self._epoch += 1
        if name is None:
            self._cache.clear()
            self._pending.clear()       # lookups in flight may answer from before the change
            return
        for key in [k for k, (_, a) in self._cache.items() if name in (k[1], a.id)]:
            del self._cache[key]
        for key in [k for k in self._pending if k[1] == name]:
            del self._pending[key]
