"""Adapter name -> concrete adapter version, through the store, with a short-lived cache.

The cache is keyed by (tenant, name) and lives `ttl` seconds, so an alias that moves to a new
version is seen within ttl; a worker that reports a version the store no longer has makes the
router drop the entry at once (invalidate).
"""
from __future__ import annotations

import time

import grpc

from services.common.errors import from_rpc_error
from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb, adapter_store_pb2_grpc
from services.common.gen.lorafleet.v1 import router_pb2
from services.common.telemetry import outgoing_metadata


class Resolver:
    def __init__(self, channel: grpc.aio.Channel, ttl: float = 1.0):
        self.stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
        self.ttl = ttl
        self._cache: dict[tuple[str, str], tuple[float, router_pb2.AdapterInfo]] = {}

    async def resolve(self, name: str, tenant: str,
                      timeout: float | None = None) -> router_pb2.AdapterInfo:
        key = (tenant, name)
        hit = self._cache.get(key)
        now = time.monotonic()
        if hit and now - hit[0] < self.ttl:
            return hit[1]
        try:
            resp = await self.stub.Resolve(spb.ResolveRequest(name=name, tenant=tenant),
                                           timeout=timeout or 10.0, metadata=outgoing_metadata())
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        self._cache[key] = (now, resp.adapter)
        if len(self._cache) > 100_000:
            self._cache.clear()
        return resp.adapter

    def invalidate(self, name: str | None = None) -> None:
        if name is None:
            self._cache.clear()
        else:
            for key in [k for k in self._cache if k[1] == name]:
                del self._cache[key]
