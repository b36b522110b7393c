"""The router's live view of its workers, from their WatchResidency streams.

Each worker endpoint has a watcher task: it connects, takes the full snapshot, applies deltas in
sequence order, and on a broken stream marks the worker gone and reconnects with backoff (a new
snapshot replaces everything). A `--worker` given as a DNS name (a headless Service) is
re-resolved periodically, so pods that come and go are found.

The residency stream lags the requests this router has just sent (a delta follows the worker
taking the request), so each worker also counts this router's own requests in flight, per
adapter: placement sees max(reported, own), and an adapter with a request on its way counts as
held there, so a burst for one adapter is grouped onto one worker instead of scattered.

Whether any worker is live is the router's readiness: `wait_live` lets a request that found none
wait for one (woken by the residency stream that brings it, not by a timer), and `on_ready` is
told each time that answer flips (the router's grpc.health.v1 status follows it).
"""
from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import socket
from dataclasses import dataclass, field
from typing import Callable

import grpc

from services.common.gen.lorafleet.v1 import common_pb2, worker_pb2 as wpb, worker_pb2_grpc
from services.common.server import KEEPALIVE_S, channel
from services.router.placement import WorkerView

log = logging.getLogger(__name__)
STALL_S = 10.0      # a residency stream silent this long: the worker is taken as gone


@dataclass
class WorkerState:
    addr: str
    stub: worker_pb2_grpc.WorkerStub
    chan: grpc.aio.Channel
    connected: bool = False
    worker_id: str = ""
    seq: int = 0
    adapters: dict[str, wpb.AdapterResidency] = field(default_factory=dict)
    load: wpb.WorkerLoad = field(default_factory=wpb.WorkerLoad)
    cache: dict[str, wpb.CacheCounters] = field(default_factory=dict)
    task: asyncio.Task | None = None
    in_flight: int = 0          # this router's requests on this worker now
    in_flight_by_adapter: collections.Counter = field(default_factory=collections.Counter)

    def view(self) -> WorkerView:
        resident = {a.id for a in self.adapters.values() if a.tier == common_pb2.GPU}
        loading = {a.id for a in self.adapters.values() if a.loading}
        loading |= {a for a, n in self.in_flight_by_adapter.items() if n > 0} - resident
        rows = {a.id: a.running + a.waiting for a in self.adapters.values()}
        for a, n in self.in_flight_by_adapter.items():
            rows[a] = max(rows.get(a, 0), n)
        running = self.load.running
        waiting = max(self.load.waiting, self.in_flight - running)
        return WorkerView(resident=resident, loading=loading, running=running, waiting=waiting,
                          kv_used=self.load.kv_used_fraction, draining=self.load.draining,
                          adapter_rows=rows)

    def begin(self, adapter_id: str | None) -> None:
        """This router sent a request here (placement counts it until `end`)."""
        self.in_flight += 1
        if adapter_id:
            self.in_flight_by_adapter[adapter_id] += 1

    def end(self, adapter_id: str | None) -> None:
        self.in_flight -= 1
        if adapter_id:
            self.in_flight_by_adapter[adapter_id] -= 1
            if self.in_flight_by_adapter[adapter_id] <= 0:
                del self.in_flight_by_adapter[adapter_id]

    def apply(self, update: wpb.ResidencyUpdate) -> None:
        if update.snapshot:
            self.adapters = {}
            self.worker_id = update.worker_id
        elif update.seq <= self.seq:
            return                                   # stale or duplicate delta
        self.seq = update.seq
        for a in update.adapters:
            if a.tier == common_pb2.TIER_UNSPECIFIED and not a.loading:
                self.adapters.pop(a.id, None)
            else:
                self.adapters[a.id] = a
        self.load = update.load
        self.cache = {c.tier: c for c in update.cache}


class WorkerSet:
    def __init__(self, targets: list[str], tls: tuple = (None, None, None),
                 resolve_period: float = 10.0, keepalive_s: float = KEEPALIVE_S,
                 service_token: str = "", on_ready: Callable[[bool], None] | None = None,
                 on_join: Callable[[WorkerState], None] | None = None):
        self.targets = targets
        self.tls, self.keepalive_s, self.service_token = tls, keepalive_s, service_token
        self.resolve_period = resolve_period
        self.workers: dict[str, WorkerState] = {}
        self._tasks: list[asyncio.Task] = []
        self._on_ready = on_ready
        self._on_join = on_join             # a worker's stream brought its snapshot
        self._ready = asyncio.Event()       # set while some worker is live

    async def start(self) -> None:
        for target in self.targets:
            if _is_literal(target):
                self._add(target)
            else:
                self._tasks.append(asyncio.get_running_loop().create_task(self._dns(target)))

    def live(self) -> dict[str, WorkerState]:
        return {a: w for a, w in self.workers.items() if w.connected}

    def views(self) -> dict[str, WorkerView]:
        return {a: w.view() for a, w in self.live().items()}

    async def wait_live(self, timeout: float | None) -> bool:
        """Until some worker is live (True), or timeout seconds pass (False; None: no bound)."""
        if self._ready.is_set():
            return True
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def _live_changed(self) -> None:
        """A worker connected or dropped: keep the ready event (and on_ready) in step."""
        ready = any(w.connected for w in self.workers.values())
        if ready == self._ready.is_set():
            return
        if ready:
            self._ready.set()
        else:
            self._ready.clear()
        if self._on_ready is not None:
            self._on_ready(ready)

    def _add(self, addr: str) -> None:
        if addr in self.workers:
            return
        chan = channel(addr, *self.tls, keepalive_s=self.keepalive_s,
                       service_token=self.service_token)
        state = WorkerState(addr, worker_pb2_grpc.WorkerStub(chan), chan)
        state.task = asyncio.get_running_loop().create_task(self._watch(state))
        self.workers[addr] = state

    async def _remove(self, addr: str) -> None:
        state = self.workers.pop(addr, None)
        if state is not None:
            state.task.cancel()
            self._live_changed()
            await state.chan.close()

    async def _watch(self, state: WorkerState) -> None:
        """Follow a worker's residency stream. A worker sends at least a load update every
        half second: one silent for STALL_S (hung, or its host gone without a reset) is taken
        as gone until a new stream brings a snapshot."""
        backoff = 0.1
        while True:
            # wait_for_ready: the stream opens as soon as the worker's port does, instead of
            # failing at once while the channel backs off between connection attempts
            call = state.stub.WatchResidency(wpb.WatchResidencyRequest(watcher="router"),
                                             wait_for_ready=True)
            try:
                updates = call.__aiter__()
                while True:
                    update = await asyncio.wait_for(updates.__anext__(), STALL_S)
                    state.apply(update)
                    if update.snapshot:
                        state.connected, backoff = True, 0.1
                        log.info("worker %s (%s) connected", state.addr, state.worker_id)
                        self._live_changed()
                        if self._on_join is not None:
                            self._on_join(state)
            except StopAsyncIteration:
                pass
            except asyncio.TimeoutError:      # before a snapshot: still connecting
                (log.warning if state.connected else log.debug)(
                    "worker %s sent nothing for %.0f s", state.addr, STALL_S)
                call.cancel()
            except grpc.RpcError as err:
                log.debug("residency stream of %s: %s", state.addr, err.code())
            if state.connected:
                log.warning("worker %s dropped", state.addr)
            state.connected = False
            self._live_changed()
            state.seq = 0
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _dns(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        while True:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, int(port), type=socket.SOCK_STREAM)
                addrs = {_join(i[4][0], port) for i in infos}
            except OSError as err:
                log.warning("resolving %s: %s", target, err)
                addrs = None
            if addrs is not None:
                for a in addrs - set(self.workers):
                    self._add(a)
                for a in set(self.workers) - addrs:
                    await self._remove(a)
            await asyncio.sleep(self.resolve_period)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for addr in list(self.workers):
            await self._remove(addr)


def _is_literal(target: str) -> bool:
    host = target.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _join(host: str, port: str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
