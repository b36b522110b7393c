"""The worker's host tier: staged adapters (their safetensors bytes and layout plans) in one
arena of host memory, pinned on CUDA so a placement's copy to the device is one DMA at the
link's speed, governed by services.common.cache_policy (LRU, pins, per-tenant caps).

The arena is allocated once at start, exactly --host-pool-bytes (torch's pinned allocator would
round every adapter up to a power of two and keep freed blocks), and carved by a first-fit
range allocator; an adapter that finds no hole evicts more, least recently used first. A fetch
reserves its range before the first byte arrives and writes straight into it. Thread-safe: the
adapter manager's loader threads and its event loop both use it.
"""
from __future__ import annotations

import logging
import mmap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from services.common.cache_policy import CachePolicy, NoRoom
from services.worker.adapters.layout import PlanCache, StagedAdapter, stage
from services.worker.adapters.range_alloc import RangeAllocator
from services.worker.model.spec import ModelSpec

log = logging.getLogger(__name__)
PREFAULT_THREADS = 8            # threads writing the host tier's pages before it is pinned


@dataclass
class Reservation:
    """Room for one adapter's bytes: `view` (uint8 [nbytes]) to fill, then commit or abort.
    cached: False when the tier had no room (everything pinned): a buffer of its own that is
    dropped once placed."""
    key: str
    view: torch.Tensor
    start: int
    cached: bool


class HostTier:
    def __init__(self, capacity_bytes: int, tenant_share: float | None, pin: bool,
                 spec: ModelSpec):
        self.pin = pin
        self.plans = PlanCache(spec)
        self._arena, self._mapping = _arena(capacity_bytes, pin)
        self._alloc = RangeAllocator(capacity_bytes)
        self.policy = CachePolicy(max(capacity_bytes, 1), tenant_share,
                                  foothold=tenant_share is not None)
        self._entries: dict[str, tuple[StagedAdapter, int]] = {}     # key -> staged, start
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self._alloc.capacity

    @property
    def free_bytes(self) -> int:
        return self._alloc.free

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def lookup(self, key: str, pin: bool = False) -> StagedAdapter | None:
        """The staged adapter (a hit, now most recent; pinned if asked) or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not self.policy.touch(key):
                return None
            if pin:
                self.policy.pin(key)
            return entry[0]

    def reserve(self, key: str, tenant: str, nbytes: int) -> tuple[Reservation, list[str]]:
        """Room for key's bytes, pinned until commit/abort; returns it and the keys evicted."""
        with self._lock:
            try:
                victims = self.policy.admit(key, tenant, self._alloc.rounded(nbytes), pin=True)
            except NoRoom:
                return self._uncached(key, nbytes), []
            for victim in victims:
                self._free(victim)
            start = self._alloc.alloc(nbytes)
            while start is None:                    # fragmentation: evict more
                victim = next((e.key for e in self.policy.entries()
                               if e.pins == 0 and e.key != key), None)
                if victim is None:
                    self.policy.unpin(key)
                    self.policy.remove(key)
                    return self._uncached(key, nbytes), victims
                self.policy.remove(victim)
                self._free(victim)
                victims.append(victim)
                start = self._alloc.alloc(nbytes)
            return Reservation(key, self._arena[start:start + nbytes], start, True), victims

    def _uncached(self, key: str, nbytes: int) -> Reservation:
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        return Reservation(key, buf, -1, False)

    def commit(self, res: Reservation, config: dict) -> StagedAdapter:
        """The filled reservation as a staged adapter (planned here); it stays pinned for the
        caller's placement (unpin after). A bad header aborts the reservation and raises."""
        try:
            staged = stage(res.view, config, self.plans.spec, self.plans)
        except BaseException:
            self.abort(res)
            raise
        if res.cached:
            with self._lock:
                self._entries[res.key] = (staged, res.start)
        return staged

    def abort(self, res: Reservation) -> None:
        """Give a reservation back unfilled (the fetch failed)."""
        if not res.cached:
            return
        with self._lock:
            if res.key in self._entries:
                return
            self.policy.unpin(res.key)
            self.policy.remove(res.key)
            self._alloc.release(res.start, res.view.numel())

    def unpin(self, key: str) -> None:
        with self._lock:
            if key in self._entries:
                self.policy.unpin(key)

    def remove(self, key: str) -> bool:
        """Drop an unpinned entry (offload); False if absent or pinned."""
        with self._lock:
            if key not in self._entries or self.policy.is_pinned(key):
                return False
            self.policy.remove(key)
            self._free(key)
            return True

    def _free(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._alloc.release(entry[1], entry[0].nbytes)


def prefault(array: np.ndarray, threads: int = PREFAULT_THREADS) -> None:
    """Write every page of a new mapping from several threads (numpy's fill gives the GIL up),
    so that cudaHostRegister, which holds the CUDA context while it runs (the weights' copies
    wait behind it), finds them present instead of faulting each in on one thread."""
    step = -(-len(array) // threads)
    parts = [array[i:i + step] for i in range(0, len(array), step)]
    with ThreadPoolExecutor(len(parts) or 1) as pool:
        list(pool.map(lambda part: part.fill(0), parts))


def _arena(nbytes: int, pin: bool) -> tuple[torch.Tensor, mmap.mmap | None]:
    """nbytes of host memory as a uint8 tensor; on CUDA page-locked in place (cudaHostRegister
    on an anonymous mapping: exactly nbytes, where torch's pinned allocator rounds up to a
    power of two)."""
    if not pin:
        return torch.empty(nbytes, dtype=torch.uint8), None
    start = time.monotonic()
    mapping = mmap.mmap(-1, max(nbytes, 1))
    if hasattr(mmap, "MADV_HUGEPAGE"):        # fewer pages to fault in and to lock
        mapping.madvise(mmap.MADV_HUGEPAGE)
    array = np.frombuffer(mapping, dtype=np.uint8, count=nbytes)
    prefault(array)
    arena = torch.from_numpy(array)
    # portable (flag 1): pinned for every device's context, not only the calling thread's
    # current device (a worker on cuda:1 registers it from a thread whose device is 0)
    err = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), nbytes, 1)
    if int(getattr(err, "value", err)) != 0:
        raise RuntimeError(f"cudaHostRegister of the {nbytes}-byte host tier failed ({err})")
    log.info("host tier: %.1f GiB of pinned memory in %.1fs", nbytes / 2**30,
             time.monotonic() - start)
    return arena, mapping
