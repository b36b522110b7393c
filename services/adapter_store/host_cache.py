"""The store host tier: validated adapter blobs in memory, keyed by version, byte-budgeted.

Eviction is services.common.cache_policy.CachePolicy (LRU with per-tenant caps; shared adapters
count as tenant ""). Only blobs whose digest matched their registered version are put here, so a
hit is served without re-checking. A blob larger than what the tier can free is simply not kept.
A Fetch streaming a blob keeps it alive even if it is evicted meanwhile (bytes, or a read-only
mapping that outlives its file).

With a shared-memory directory (--shm-dir, on a tmpfs such as /dev/shm) the tier's blobs are
files there, mapped read-only: a worker on this host reads one with a single system call
instead of a gRPC stream (FetchRequest.shm). Files are written under a temporary name and
renamed, so a reader never sees half of one; an evicted blob's file is unlinked at once.
"""
from __future__ import annotations

import functools
import logging
import mmap
import os
import pathlib
import uuid
from dataclasses import dataclass
from typing import Callable

from services.adapter_store.landing import Destination, ShmLanding
from services.common.cache_policy import CachePolicy, NoRoom
from services.common.owned_dirs import alive as pid_alive

log = logging.getLogger(__name__)
PREFIX = "lorafleet-store-"


@dataclass(frozen=True)
class HostTierStats:
    hits: int
    misses: int
    resident: int
    bytes: int
    evictions: int


@dataclass(frozen=True)
class CachedBlob:
    data: bytes | memoryview
    shm_file: str = ""                # the file in the shared-memory directory, if any


class ShmDir:
    """This store's files in a shared-memory directory: PREFIX + a per-process tag + version."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self._tag = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}-"
        self._clear_stale()

    def _clear_stale(self) -> None:
        """Files of stores that are gone (their pid no longer runs)."""
        for f in self.path.glob(PREFIX + "*"):
            pid = f.name[len(PREFIX):].split("-", 1)[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                f.unlink(missing_ok=True)

    def name_of(self, version: str) -> str:
        return self._tag + version

    def write(self, version: str, blob: bytes) -> CachedBlob:
        name = self.name_of(version)
        tmp = self.path / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, self.path / name)
        return CachedBlob(self.map(name, len(blob)), name)

    def landing(self, version: str, size: int) -> ShmLanding:
        """A new file for `version` ("": not known yet, named when kept)."""
        return ShmLanding(self.path, self.name_of(version or f"new-{uuid.uuid4().hex[:12]}"),
                          size)

    def map(self, name: str, size: int) -> memoryview:
        with open(self.path / name, "rb") as f:
            return memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)) \
                if size else memoryview(b"")

    def unlink(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)


class HostCache:
    """version -> blob, with hit/miss counters for Stats and /metrics."""

    def __init__(self, capacity_bytes: int, tenant_share: float | None,
                 shm_dir: pathlib.Path | None = None):
        self._policy = CachePolicy(capacity_bytes, tenant_share=tenant_share,
                                   foothold=tenant_share is not None)
        self._blobs: dict[str, CachedBlob] = {}
        self._hits = self._misses = self._evictions = 0
        self._shm = ShmDir(shm_dir) if shm_dir is not None else None

    def get(self, version: str, fresh: bool = False) -> CachedBlob | None:
        """The blob (a hit, now most recent) or None (a miss, counted). fresh: the blob was
        just read from the source for this very call (a first use): a miss if found too."""
        blob = self._blobs.get(version)
        if blob is not None and self._policy.touch(version):
            self._hits += not fresh
            self._misses += fresh
            return blob
        self._misses += 1
        return None

    def prepare(self, version: str, blob: bytes) -> CachedBlob:
        """What `put` will keep for a verified blob: with a shared-memory directory its file
        there (blocking: call it off the event loop), else the bytes."""
        return self._shm.write(version, blob) if self._shm is not None else CachedBlob(blob)

    def landing(self, version: str = "") -> Callable[[int], Destination]:
        """Where a source read of `version` should land (SourceReader.read's landing): a file
        of the shared-memory directory when there is one, else process memory. "": a version
        not known until the bytes are read (a first use); keep() names it."""
        if self._shm is None:
            return Destination
        return functools.partial(self._shm.landing, version)

    def keep(self, landed: Destination, version: str = "") -> CachedBlob:
        """What `put` will keep for a verified blob read into `landed` (version: its name
        when it landed without one)."""
        if version and isinstance(landed, ShmLanding):
            landed.name = self._shm.name_of(version)
        return CachedBlob(*landed.keep())

    def put(self, version: str, tenant: str, cached: CachedBlob
            ) -> tuple[CachedBlob, list[str]]:
        """Keep a prepared blob unless it cannot fit; returns what to serve it from and the
        versions evicted to make room. A blob not kept loses its file (the bytes stay mapped
        for the Fetch that read it, which then streams them)."""
        try:
            victims = self._policy.admit(version, tenant, len(cached.data), count_miss=False)
        except NoRoom:
            if cached.shm_file:
                self._shm.unlink(cached.shm_file)
            return CachedBlob(cached.data), []
        for victim in victims:
            self._drop(victim)
        self._evictions += len(victims)
        self._blobs[version] = cached
        return cached, victims

    def remove(self, version: str) -> None:
        """Drop a version (its adapter was deleted or replaced)."""
        if version in self._blobs:
            self._drop(version)
            self._policy.remove(version)

    def _drop(self, version: str) -> None:
        cached = self._blobs.pop(version, None)
        if cached is not None and cached.shm_file:
            self._shm.unlink(cached.shm_file)

    def close(self) -> None:
        """Unlink this store's shared-memory files (shutdown)."""
        for version in list(self._blobs):
            self._drop(version)

    def __contains__(self, version: str) -> bool:
        return version in self._blobs

    def stats(self) -> HostTierStats:
        return HostTierStats(self._hits, self._misses, len(self._blobs),
                             self._policy.used_bytes, self._evictions)
