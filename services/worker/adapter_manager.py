"""The worker's adapter tiers: the device pool (GPU) and the pinned host tier, both governed by
services.common.cache_policy (LRU, pins, per-tenant caps, footholds), filled from the store.

A request `acquire`s its adapter: a GPU hit pins it at once; otherwise it is staged (host tier,
else the store) while the engine keeps running other rows, then placed and pinned. The pin is
held until the engine has finished the request, so an adapter in use is never evicted.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from safetensors.torch import load as load_safetensors

from services.common.cache_policy import CachePolicy, NoRoom
from services.common.errors import ResourceExhausted
from services.common.gen.lorafleet.v1 import common_pb2
from services.common.telemetry import tracer
from services.worker.adapter_layout import AdapterLayout, build_layout
from services.worker import metrics
from services.worker.device_pool import DevicePool, PoolFull
from services.worker.model_spec import ModelSpec
from services.worker.store_client import StoreClient

log = logging.getLogger(__name__)
_tracer = tracer("lorafleet.worker")


@dataclass
class Acquired:
    key: str
    slot: int
    tier: int                   # common_pb2.Tier it came from (GPU on a hit)
    seconds: float              # cold-load time (0 on a hit)


@dataclass
class Residency:
    id: str
    version: str
    tenant: str
    nbytes: int
    users: int = 0              # requests holding it (waiting or running)
    loading: bool = False
    host: bool = False
    gpu: bool = False
    waiters: int = 0
    extra: dict = field(default_factory=dict)


ROOM_MARGIN_S = 0.5      # a wait for adapter room ends this long before the request's deadline


class AdapterManager:
    def __init__(self, pool: DevicePool, spec: ModelSpec, host_bytes: int, store: StoreClient,
                 tenant_share: float | None = 0.5,
                 on_change: Callable[[str], None] = lambda key: None):
        self.pool, self.spec, self.store = pool, spec, store
        self.gpu = CachePolicy(pool.capacity_bytes, tenant_share, foothold=tenant_share is not None)
        self.host = CachePolicy(max(host_bytes, 1), tenant_share,
                                foothold=tenant_share is not None)
        self.host_blobs: dict[str, AdapterLayout] = {}
        self.info: dict[str, Residency] = {}
        self._loading: dict[str, asyncio.Future] = {}
        self._freed = asyncio.Condition()
        self._on_change = on_change
        self.cold_loads: dict[int, list[float]] = {}   # tier -> recent seconds
        self.cold_load_count: dict[int, int] = {}
        self.pin = pool.device.type == "cuda"

    @staticmethod
    def key(adapter_id: str, version: str) -> str:
        return f"{adapter_id}@{version}"

    async def acquire(self, adapter_id: str, version: str, tenant: str,
                      deadline: float | None) -> Acquired:
        """Pin the adapter on the device, staging it first if needed."""
        key = self.key(adapter_id, version)
        slot = self.pool.slot_of(key)
        if slot is not None and self.gpu.touch(key):
            self.gpu.pin(key)
            self._use(key, +1)
            metrics.count_lookup("gpu", True)
            return Acquired(key, slot, common_pb2.GPU, 0.0)
        metrics.count_lookup("gpu", False)
        start = time.monotonic()
        with _tracer.start_as_current_span("lora.cold_load") as span:
            span.set_attributes({"lora.adapter_id": adapter_id, "lora.version": version,
                                 "lora.tenant": tenant})
            tier = await self._stage(key, adapter_id, version, tenant, deadline)
            seconds = time.monotonic() - start
            span.set_attributes({"lora.tier": common_pb2.Tier.Name(tier),
                                 "lora.bytes": self.info[key].nbytes})
        self._record_cold(tier, seconds)
        return Acquired(key, self.pool.slot_of(key), tier, seconds)

    def release(self, key: str) -> None:
        """The engine is done with one request using this adapter."""
        self.gpu.unpin(key)
        self._use(key, -1)
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._freed:
            self._freed.notify_all()

    def _use(self, key: str, delta: int) -> None:
        self.info[key].users += delta
        self._on_change(key)

    async def _stage(self, key, adapter_id, version, tenant, deadline) -> int:
        """Bring key into the device pool pinned for this caller; return the source tier."""
        while True:
            pending = self._loading.get(key)
            if pending is not None:
                await asyncio.shield(pending)
                if self.pool.slot_of(key) is not None and self.gpu.contains(key):
                    self.gpu.pin(key)
                    self._use(key, +1)
                    return common_pb2.GPU
                continue
            fut = asyncio.get_running_loop().create_future()
            self._loading[key] = fut
            try:
                return await self._load(key, adapter_id, version, tenant, deadline)
            finally:
                del self._loading[key]
                fut.set_result(None)

    async def _load(self, key, adapter_id, version, tenant, deadline) -> int:
        layout, tier = await self._host_layout(key, adapter_id, version, tenant, deadline)
        self.info[key].loading = True
        self._on_change(key)
        try:
            await self._place(key, tenant, layout, deadline)
        finally:
            self.info[key].loading = False
        self.info[key].gpu = True
        self._use(key, +1)
        return tier

    async def _host_layout(self, key, adapter_id, version, tenant, deadline):
        if key in self.host_blobs and self.host.touch(key):
            metrics.count_lookup("worker_host", True)
            return self.host_blobs[key], common_pb2.WORKER_HOST
        metrics.count_lookup("worker_host", False)
        timeout = None if deadline is None else max(0.01, deadline - time.monotonic())
        with _tracer.start_as_current_span("lora.store_fetch") as span:
            fetched = await self.store.fetch(adapter_id, version, timeout)
            span.set_attributes({"lora.bytes": len(fetched.blob), "lora.source_tier":
                                 common_pb2.Tier.Name(fetched.tier)})
        layout = await asyncio.to_thread(self._layout, fetched.blob, fetched.config)
        info = self.info.setdefault(key, Residency(adapter_id, fetched.version, tenant, 0))
        info.nbytes = layout.nbytes
        for victim in self.host.admit(key, tenant, layout.nbytes):
            self._drop_host(victim)
        self.host_blobs[key] = layout
        info.host = True
        self._on_change(key)
        return layout, fetched.tier

    def _layout(self, blob: bytes, config: dict) -> AdapterLayout:
        """Check the fetched safetensors bytes (validated by the store at registration,
        digest-checked in transit) against this worker's model: every tensor a LoRA A/B of a
        supported projection, pairs complete, shapes matching; and lay them out as a pool blob.
        Traced as the cold load's `lora.validate` span."""
        with _tracer.start_as_current_span("lora.validate") as span:
            span.set_attribute("lora.bytes", len(blob))
            return build_layout(load_safetensors(blob), config, self.spec, self.pool.dtype,
                                pin=self.pin)

    async def _place(self, key, tenant, layout: AdapterLayout, deadline) -> None:
        nbytes = self.pool.alloc.rounded(layout.blob.numel()) * self.pool.elem
        if nbytes > self.pool.capacity_bytes:          # would wait for room that never comes
            raise ResourceExhausted(
                f"adapter {key} needs {nbytes} bytes of adapter pool; this worker's pool holds "
                f"{self.pool.capacity_bytes} (--gpu-pool-bytes)", retry_after=1.0)
        while True:
            try:
                for victim in self.gpu.admit(key, tenant, nbytes, pin=True):
                    self._drop_gpu(victim)
                break
            except NoRoom:
                await self._wait_for_room(deadline, key)
        try:
            while not self.pool.fits(layout):           # fragmentation or out of slots
                if not self._evict_one_unpinned(key):
                    await self._wait_for_room(deadline, key)
            with _tracer.start_as_current_span("lora.host_to_device") as span:
                span.set_attribute("lora.bytes", layout.nbytes)
                await asyncio.to_thread(self.pool.place, key, layout)
        except BaseException:
            self.gpu.unpin(key)
            self.gpu.remove(key)
            raise

    async def _wait_for_room(self, deadline, key) -> None:
        """Wait (at most a second) for an adapter to be freed. Gives up ROOM_MARGIN_S before the
        request's deadline, so that the caller hears RESOURCE_EXHAUSTED, not DEADLINE_EXCEEDED."""
        remaining = None if deadline is None else deadline - time.monotonic() - ROOM_MARGIN_S
        if remaining is not None and remaining <= 0:
            raise ResourceExhausted(f"no adapter room on this worker for {key}", retry_after=1.0)
        self.info[key].waiters += 1
        try:
            async with self._freed:
                await asyncio.wait_for(self._freed.wait(), timeout=min(remaining or 1.0, 1.0))
        except asyncio.TimeoutError:
            pass
        finally:
            self.info[key].waiters -= 1

    def _evict_one_unpinned(self, keep: str) -> bool:
        for entry in self.gpu.entries():
            if entry.pins == 0 and entry.key != keep and self.pool.slot_of(entry.key) is not None:
                self.gpu.remove(entry.key)
                self._drop_gpu(entry.key)
                return True
        return False

    def _drop_gpu(self, key: str) -> None:
        if self.pool.slot_of(key) is not None:
            self.pool.remove(key)
        if key in self.info:
            self.info[key].gpu = False
            self._on_change(key)

    def _drop_host(self, key: str) -> None:
        self.host_blobs.pop(key, None)
        if key in self.info:
            self.info[key].host = False
            self._on_change(key)

    def offload(self, adapter_id: str, to_host: bool) -> int:
        """Drop every unpinned version of an adapter from the device (and host) tier."""
        dropped = 0
        for key, info in list(self.info.items()):
            if info.id != adapter_id:
                continue
            if info.gpu and not self.gpu.is_pinned(key):
                self.gpu.remove(key)
                self._drop_gpu(key)
                dropped += 1
            if not to_host and info.host and not self.host.is_pinned(key):
                self.host.remove(key)
                self._drop_host(key)
        return dropped

    def _record_cold(self, tier: int, seconds: float) -> None:
        metrics.COLD_LOAD.labels(common_pb2.Tier.Name(tier).lower()).observe(seconds)
        self._gauges()
        samples = self.cold_loads.setdefault(tier, [])
        samples.append(seconds)
        del samples[:-512]
        self.cold_load_count[tier] = self.cold_load_count.get(tier, 0) + 1

    def _gauges(self) -> None:
        """Adapter counts per tier and evictions per tenant, for /metrics."""
        metrics.ADAPTERS.labels("gpu").set(sum(1 for i in self.info.values() if i.gpu))
        metrics.ADAPTERS.labels("worker_host").set(len(self.host_blobs))
        for tier, policy in (("gpu", self.gpu), ("worker_host", self.host)):
            for tenant, st in policy.stats().items():
                metrics.EVICTIONS.labels(tier, tenant).set(st.evictions)
