"""Which worker serves a request: adapter affinity, then rendezvous hashing with a load bound
(no torch, no I/O; the router and bench/capacity_sim.py run this very code).

For an adapter:

1. workers that hold it (resident) or are loading it, least loaded first (resident before loading
   at equal load), unless their load exceeds the bound;
2. otherwise rendezvous (highest-random-weight) hashing of the adapter id over the live,
   non-draining workers, skipping any whose load exceeds the bound: the adapter's first choice
   unless overloaded, then its second, and so on. Adding a worker moves only ~1/W of the adapters,
   so each worker's working set stays about 1/W of the active set as adapters grow;
3. an adapter that "needs two" (its queued + running rows on its holders exceed ``spill_rows``)
   and has a single holder may spill: its holder and its next rendezvous choice compete on load.

Base-model requests (no adapter) go to the least loaded worker. Load bound: a worker whose
``running + waiting`` exceeds ``max(load_floor, (1 + eps) * average + 1)`` is skipped (consistent
hashing with bounded loads, Mirrokni et al. 2018). The floor is for batching engines: rows up to a
batch's worth cost a step next to nothing, so at low load 3 rows against 0 is no reason to move
an adapter (and pay a cold load) — without it a handful of requests would scatter the working
sets. Hashes are stable across processes (blake2b, not hash()).
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Collection, Container, Iterable, Mapping


class NoWorker(Exception):
    """No live, non-draining, non-excluded worker (the router answers UNAVAILABLE)."""


@dataclass
class WorkerView:
    """What the router knows of one worker, from its WatchResidency stream.

    resident / loading: adapter ids on its GPU / being staged there (any container).
    running / waiting: rows in its batch / queued. kv_used: KV cache fraction in use (0..1).
    adapter_rows: running + waiting rows per adapter id, when the stream reports them.
    """

    resident: Container[str] = frozenset()
    loading: Container[str] = frozenset()
    running: int = 0
    waiting: int = 0
    kv_used: float = 0.0
    draining: bool = False
    adapter_rows: Mapping[str, int] = field(default_factory=dict)

    @property
    def load(self) -> int:
        """Rows running or waiting: what the load bound and least-loaded order compare."""
        return self.running + self.waiting

    def holds(self, adapter_id: str) -> bool:
        """Resident or loading."""
        return adapter_id in self.resident or adapter_id in self.loading


@functools.lru_cache(maxsize=1 << 17)
def rendezvous_score(key: str, worker_id: str) -> int:
    """Stable 64-bit highest-random-weight score of (key, worker)."""
    digest = hashlib.blake2b(f"{worker_id}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, worker_ids: Iterable[str]) -> list[str]:
    """Workers by descending score for key: the first is key's owner, the next its fallbacks."""
    return [w for _, w in sorted(((rendezvous_score(key, w), w) for w in worker_ids),
                                 reverse=True)]


def live_workers(workers: Mapping[str, WorkerView], exclude: Collection[str] = ()
                 ) -> dict[str, WorkerView]:
    """Workers that may take a request: not draining, not excluded."""
    return {w: v for w, v in workers.items() if not v.draining and w not in exclude}


def load_bound(workers: Mapping[str, WorkerView], eps: float, floor: float = 0.0) -> float:
    """The bound above which a worker is skipped: (1 + eps) * average load + 1, at least floor."""
    if not workers:
        return 0.0
    average = sum(v.load for v in workers.values()) / len(workers)
    return max(floor, (1.0 + eps) * average + 1.0)


def least_loaded(workers: Mapping[str, WorkerView]) -> str:
    """The least loaded worker (ties: less KV in use, then worker id). NoWorker if empty."""
    if not workers:
        raise NoWorker("no live worker")
    return min(workers, key=lambda w: (workers[w].load, workers[w].kv_used, w))


def adapter_rows(adapter_id: str, workers: Mapping[str, WorkerView]) -> int:
    """Running + waiting rows of adapter_id over the given workers."""
    return sum(v.adapter_rows.get(adapter_id, 0) for v in workers.values())


def needs_two(adapter_id: str, workers: Mapping[str, WorkerView], spill_rows: int) -> bool:
    """Whether adapter_id is hot enough to be served by a second worker: its rows exceed
    spill_rows (a batch's worth of rows is a sensible threshold)."""
    return adapter_rows(adapter_id, workers) > spill_rows


def choose_worker(adapter_id: str | None, workers: Mapping[str, WorkerView], *,
                  exclude: Collection[str] = (), eps: float = 0.25,
                  spill_rows: int | None = None, load_floor: float = 0.0) -> str:
    """Pick the worker for a request on adapter_id (None or "": the base model).

    exclude: workers already tried (retries). spill_rows: enables spilling a hot adapter to a
    second worker (see needs_two). load_floor: no worker under this many rows counts as
    overloaded (see load_bound). Raises NoWorker when no worker may take it.
    """
    live = live_workers(workers, exclude)
    if not live:
        raise NoWorker("no live worker" + (f" outside {sorted(exclude)}" if exclude else ""))
    if not adapter_id:
        return least_loaded(live)
    bound = load_bound(live, eps, load_floor)
    holders = [w for w, v in live.items() if v.holds(adapter_id)]
    fit = [w for w in holders if live[w].load <= bound]
    spill = (spill_rows is not None and len(holders) == 1
             and needs_two(adapter_id, {holders[0]: live[holders[0]]}, spill_rows))
    if not fit or spill:
        others = (w for w in live if w not in holders)
        fit += [w for w in rendezvous_order(adapter_id, others) if live[w].load <= bound][:1]
    if not fit:
        return least_loaded(live)
    return min(fit, key=lambda w: _holder_key(adapter_id, w, live[w])) if len(fit) > 1 else fit[0]


def _holder_key(adapter_id: str, worker_id: str, view: WorkerView) -> tuple:
    """Least loaded first; resident before loading; then less KV; then worker id."""
    return (view.load, adapter_id not in view.resident, view.kv_used, worker_id)
