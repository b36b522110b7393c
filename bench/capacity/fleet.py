"""The capacity simulator's fleet, on simulated time: the router's very quotas
(services.router.quotas), fair gate (services.router.fair_queue.FairGate) and placement
(services.router.placement.choose_worker, with the router's spill_rows / load_floor), and per
worker the very CachePolicy of the GPU pool (bytes; slots as the device pool enforces them) and
of the host tier, over the store's host tier; cold loads timed from the measured per-tier
distributions (bench.capacity.model.LoadTimes) on the worker's loader threads; continuous
batching with chunked prefill under the step-time model (bench.capacity.model.StepModel).

What the worker does and the simulator copies: a GPU hit pins the adapter; a miss starts one
load (the host tier, else the store: its host tier, else the source; the fetched bytes enter the
host tier), later requests for it join the load without counting a lookup; the GPU admission
pins it for the load and evicts in policy order, and when everything is pinned the load waits
for an unpin. A request enters the engine once its adapter is placed. Not modelled: the
router's prefetch hint (sent only when the gate queues), KV-cache limits (the measured runs
never ran out), the store's own fetch queue.
"""
from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter, deque
from dataclasses import dataclass

from bench.capacity.model import LoadTimes, StepModel
from services.common.cache_policy import CachePolicy, NoRoom
from services.router.fair_queue import FairGate
from services.router.placement import WorkerView, choose_worker
from services.router.quotas import QuotaConfig, Quotas


@dataclass(frozen=True)
class FleetConfig:
    """The services' flags that the simulator honours (the serving benchmark's GPU defaults)."""
    workers: int = 1
    gpu_pool_bytes: int = 4 << 30
    pool_slots: int = 512
    host_pool_bytes: int = 8 << 30
    store_host_bytes: int = 16 << 30
    max_running: int = 256
    max_batch_tokens: int = 4096
    max_in_flight_per_worker: int = 256
    foothold_per_worker: int = 1
    spill_rows: int = 32
    tenant_share: float = 0.5           # 0: caps off
    eviction: str = "lru"               # the GPU pool's: lru or cost
    loader_threads: int = 8
    placement: str = "affinity"         # the router's; least_loaded: adapter-blind, to compare
    seed: int = 0


@dataclass
class SimRequest:
    """One request: what arrives (at: seconds from its phase's start) and what happened."""
    index: int
    at: float
    adapter: str                        # "" = the base model
    tenant: str
    prompt: int
    output: int
    nbytes: int = 0
    phase: str = "measure"
    sent: float = 0.0                   # absolute simulated time
    tier: str | None = None             # gpu, worker_host, store_host, source
    ttft: float | None = None
    end: float | None = None
    worker: int = -1
    left: int = 0                       # prefill tokens still to compute


class _Clock:
    """Simulated time and the event heap."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def run(self) -> None:
        while self._heap:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = max(self.now, t)
            fn(*args)


def _policy(nbytes: int, share: float, eviction: str = "lru") -> CachePolicy:
    return CachePolicy(max(1, nbytes), share or None, foothold=bool(share), eviction=eviction)


class SimWorker:
    """One worker: its adapter tiers, loader threads and engine."""

    def __init__(self, wid: int, fleet: Fleet) -> None:
        cfg = fleet.cfg
        self.wid, self.fleet, self.clock = wid, fleet, fleet.clock
        self.gpu = _policy(cfg.gpu_pool_bytes, cfg.tenant_share, cfg.eviction)
        self.host = _policy(cfg.host_pool_bytes, cfg.tenant_share)
        self.loading: dict[str, list[SimRequest]] = {}
        self.room_wait: deque = deque()             # loads waiting for an unpin
        self.prefetched: set[str] = set()           # loads started by a prefetch hint
        self.loads: Counter = Counter()             # cold loads started, per source tier
        self.threads = [0.0] * cfg.loader_threads   # when each loader thread is free
        self.ready: deque[SimRequest] = deque()
        self.prefill: list[SimRequest] = []
        self.decode: list = []                      # heap of (last step, seq, request)
        self.adapters: Counter = Counter()          # running rows per adapter
        self.lora_rows = 0                          # running rows with an adapter
        self.rows: Counter = Counter()              # running + waiting rows per adapter
        self.view = WorkerView(resident=self.gpu, loading=self.loading, adapter_rows=self.rows)
        self.stepping, self.step_no = False, 0
        self.steps: list[tuple[float, int]] = []     # (duration s, decode rows)
        self._seq = itertools.count()

    # ---- adapters ---------------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        req.worker, key = self.wid, req.adapter
        self.view.waiting += 1
        self.rows[key] += 1
        if not key:
            self._ready([req])
        elif key in self.loading:
            req.tier = "joined"                    # waits for a load already under way
            self.loading[key].append(req)
        elif self.gpu.touch(key):
            self.gpu.pin(key)
            req.tier = "gpu"
            self._ready([req])
        else:
            req.tier = self._start_load(req.adapter, req.tenant, req.nbytes)
            self.loading[req.adapter].append(req)

    def prefetch(self, key: str, tenant: str, nbytes: int) -> None:
        """The router's hint (it sends one when the gate queues a request): a load whose pin is
        released when it is placed (the worker's Prefetch: acquire, then release)."""
        if key not in self.loading and not self.gpu.contains(key):
            self._start_load(key, tenant, nbytes)
            self.prefetched.add(key)

    def _start_load(self, key: str, tenant: str, nbytes: int) -> str:
        """Start one cold load of key; returns the tier it comes from."""
        f = self.fleet
        if self.host.touch(key):
            tier = "worker_host"
        else:
            tier = "store_host" if f.store.touch(key) else "source"
            if tier == "source":
                _admit_or_skip(f.store, key, tenant, nbytes)
            _admit_or_skip(self.host, key, tenant, nbytes)
        self.loading[key] = []
        self.loads[tier] += 1
        # the reload cost the worker gives cost-aware eviction: this load's own time
        load = (key, tenant, nbytes, tier, f.loads.expected(tier, nbytes))
        if not self._place(*load):
            self.room_wait.append(load)
        return tier

    def _place(self, key, tenant, nbytes, tier, cost) -> bool:
        """GPU admission (pinned for the load), then the load on the first free thread; False
        (nothing changed) while everything in the pool is pinned."""
        try:
            self.gpu.admit(key, tenant, nbytes, pin=True, cost=cost)
        except NoRoom:
            return False
        while len(self.gpu.entries()) > self.fleet.cfg.pool_slots:   # out of slots
            victim = next((e.key for e in self.gpu.entries() if not e.pins), None)
            if victim is None:
                break
            self.gpu.remove(victim)
        i = min(range(len(self.threads)), key=self.threads.__getitem__)
        start = max(self.clock.now, self.threads[i])
        self.threads[i] = done = start + self.fleet.loads.sample(self.fleet.rng, tier, nbytes)
        self.clock.at(done, self._loaded, key)
        return True

    def _loaded(self, key: str) -> None:
        waiters = self.loading.pop(key)
        prefetch = key in self.prefetched
        for _ in waiters[0 if prefetch else 1:]:   # joiners pin without a lookup counted
            self.gpu.pin(key)
        if prefetch:                               # the load's own pin goes
            self.prefetched.discard(key)
            self._unpin(key)
        self._ready(waiters)

    def _unpin(self, key: str) -> None:
        self.gpu.unpin(key)
        while self.room_wait:                     # loads waiting for room, in order
            if not self._place(*self.room_wait[0]):
                break
            self.room_wait.popleft()

    # ---- engine -----------------------------------------------------------------------------
    def _ready(self, reqs: list[SimRequest]) -> None:
        self.ready.extend(reqs)
        self._kick()

    def _kick(self) -> None:
        if self.stepping or not (self.ready or self.prefill or self.decode):
            return
        cfg, m = self.fleet.cfg, self.fleet.model
        while self.ready and len(self.prefill) + len(self.decode) < cfg.max_running:
            req = self.ready.popleft()
            req.left = req.prompt
            self.prefill.append(req)
            self.adapters[req.adapter] += 1
            self.lora_rows += bool(req.adapter)
            self.view.waiting -= 1
            self.view.running += 1
        budget, tokens, done = cfg.max_batch_tokens - len(self.decode), 0, []
        for req in self.prefill:
            take = min(req.left, max(0, budget - tokens))
            req.left -= take
            tokens += take
            if req.left == 0:
                done.append(req)
        distinct = len(self.adapters) - ("" in self.adapters)
        rows = len(self.decode) + len(self.prefill)
        dt = m.ms(rows, tokens, distinct, self.lora_rows) / 1e3
        self.steps.append((dt, len(self.decode)))
        self.stepping = True
        self.clock.at(self.clock.now + dt, self._step_end, done)

    def _step_end(self, prefilled: list[SimRequest]) -> None:
        now, finished = self.clock.now, []
        for req in prefilled:                       # their first token comes with this step
            self.prefill.remove(req)
            req.ttft = now - req.sent
            if req.output <= 1:
                finished.append(req)
            else:
                heapq.heappush(self.decode, (self.step_no + req.output - 1, next(self._seq),
                                             req))
        while self.decode and self.decode[0][0] <= self.step_no:
            finished.append(heapq.heappop(self.decode)[2])
        self.step_no += 1
        for req in finished:
            req.end = now
            self.adapters[req.adapter] -= 1
            self.rows[req.adapter] -= 1
            self.lora_rows -= bool(req.adapter)
            for table in (self.adapters, self.rows):
                if table[req.adapter] <= 0:
                    del table[req.adapter]
            self.view.running -= 1
            if req.adapter:
                self._unpin(req.adapter)
            self.fleet.finished(req)
        self.stepping = False
        self._kick()


def _admit_or_skip(policy: CachePolicy, key: str, tenant: str, nbytes: int) -> None:
    """Into a host tier if it has room (the worker streams through a buffer of its own
    otherwise)."""
    try:
        policy.admit(key, tenant, nbytes)
    except NoRoom:
        pass


class Fleet:
    """The router and W workers; run() replays one phase's requests from the current time."""

    def __init__(self, cfg: FleetConfig, model: StepModel, loads: LoadTimes,
                 quotas: QuotaConfig | None = None) -> None:
        self.cfg, self.model, self.loads = cfg, model, loads
        self.rng = random.Random(cfg.seed)
        self.clock = _Clock()
        self.store = _policy(cfg.store_host_bytes, cfg.tenant_share)
        self.quotas = Quotas(quotas, clock=lambda: self.clock.now)
        self.gate = FairGate(cfg.max_in_flight_per_worker * cfg.workers,
                             foothold=cfg.foothold_per_worker * cfg.workers)
        self.workers = [SimWorker(i, self) for i in range(cfg.workers)]
        self.views = {f"w{i}": w.view for i, w in enumerate(self.workers)}
        self.tickets: dict[int, object] = {}
        self.throttled = self.prefetches = 0

    def run(self, requests: list[SimRequest], gap_s: float = 0.05) -> list[SimRequest]:
        """Every request once, arrivals offset from now + gap_s; returns when all are done."""
        start = self.clock.now + gap_s
        for req in requests:
            req.sent = start + req.at
            self.clock.at(req.sent, self._arrive, req)
        self.clock.run()
        return requests

    def _arrive(self, req: SimRequest) -> None:
        est = req.prompt + req.output
        if self.quotas.check(req.tenant, est) is not None:
            self.throttled += 1                    # the client gets RESOURCE_EXHAUSTED
            return
        if req.adapter and self.gate.would_wait(req.tenant):
            w = self.workers[int(self._place(req)[1:])]
            if not w.view.holds(req.adapter):
                w.prefetch(req.adapter, req.tenant, req.nbytes)
                self.prefetches += 1
        self.tickets[id(req)] = self.gate.enqueue(req.tenant, req.prompt,
                                                  lambda _t, r=req: self._dispatch(r))

    def _place(self, req: SimRequest) -> str:
        """The router's call (services/router/generate.py _place)."""
        adapter = req.adapter if self.cfg.placement == "affinity" else None
        return choose_worker(adapter or None, self.views, spill_rows=self.cfg.spill_rows,
                             load_floor=self.cfg.spill_rows)

    def _dispatch(self, req: SimRequest) -> None:
        self.workers[int(self._place(req)[1:])].submit(req)

    def finished(self, req: SimRequest) -> None:
        self.gate.release(self.tickets.pop(id(req)), req.prompt, req.output)
        self.quotas.release(req.tenant, req.prompt + req.output, req.prompt + req.output)

    def counters(self) -> dict[str, tuple[int, int]]:
        """(hits, misses) per tier, summed over workers (the store's is one tier)."""
        out = {}
        for tier in ("gpu", "host"):
            totals = [getattr(w, tier).totals() for w in self.workers]
            out[tier] = (sum(t.hits for t in totals), sum(t.misses for t in totals))
        st = self.store.totals()
        out["store"] = (st.hits, st.misses)
        out["loads"] = sum((w.loads for w in self.workers), Counter())
        out["prefetches"] = self.prefetches
        return out
