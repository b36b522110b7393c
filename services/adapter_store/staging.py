"""Staging for Fetch (a mixin of store.AdapterStore): the host tier, else the source, else the
store's kept copy of the version (keep.py); whatever is read is checked against the
registration (config and SHA-256), DATA_LOSS and nothing cached when neither matches. A first
use (first_use.py) leaves the checked bytes in the host tier: the first Fetch after it is
served from there with no second read, and counted as what it is, a SOURCE load (a host-tier
miss, the first use's seconds), as when the Fetch itself waited for the first use.

The kept copy is read only when the source no longer holds the version (overwritten in place,
deleted, unreachable): a rolled-back or pinned version keeps serving, while the ordinary cold
load reads the source as before (its trace shows s3.get). A verified source read of a version
the store holds no copy of (registered before the store kept bytes, or a lost --version-dir)
keeps one (not for an --adapters-dir adapter: keep.wants_copy).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from dataclasses import dataclass

from opentelemetry import trace

from services.adapter_store import metrics
from services.adapter_store.host_cache import CachedBlob
from services.adapter_store.keep import wants_copy
from services.adapter_store.registry import READY, AdapterRecord
from services.adapter_store.sources import SourceRef, parse_source
from services.adapter_store.validate import canonical_json
from services.common.errors import (DataLoss, DeadlineExceeded, FailedPrecondition,
                                    LorafleetError, NotFound, Refusal, unknown_adapter)
from services.common.names import name_error

log = logging.getLogger(__name__)
_tracer = trace.get_tracer(__name__)
SOURCE, STORE_HOST = "SOURCE", "STORE_HOST"


def check_name(field: str, value: str, allow_empty: bool = False) -> None:
    """Ids, aliases and tenants: a plain name, never a path or a URL (INVALID_ARGUMENT)."""
    message = name_error(field, value, allow_empty)
    if message is not None:
        raise Refusal("name", message)


async def bounded(awaitable, remaining: float | None):
    """Await within the caller's remaining deadline (DEADLINE_EXCEEDED past it)."""
    try:
        return await asyncio.wait_for(awaitable, remaining)
    except asyncio.TimeoutError:
        raise DeadlineExceeded("deadline exceeded while reading the adapter source") from None


@dataclass(frozen=True)
class Staged:
    """An adapter ready to stream: its record, blob, the tier it came from, source seconds, and
    its file in the shared-memory directory (empty: none)."""

    record: AdapterRecord
    blob: bytes | memoryview
    tier: str
    load_s: float
    shm_file: str = ""


class StagingMixin:
    """Needs AdapterStore's _registry, _reader, _keep, _cache, _bucket, _inflight, _fresh,
    _identities, _window, _validated and _publish_host_tier."""

    async def stage(self, adapter_id: str, version: str, remaining: float | None,
                    pinned: bool = False) -> Staged:
        """The adapter's blob from the host tier, else from its kept copy or source (digest-
        checked). version: the one expected (FAILED_PRECONDITION if the adapter moved on),
        unless pinned: then that version if the registry keeps it."""
        check_name("id", adapter_id)
        record = self._registry.get(adapter_id)
        if record is None:
            raise unknown_adapter(adapter_id)
        if pinned and version and version != record.version:
            record = self._registry.get_version(adapter_id, version)
            if record is None:
                raise NotFound(f"adapter {adapter_id!r} keeps no version {version[:64]!r}")
        record = await self._validated(record, remaining)
        if record.state != READY:
            raise FailedPrecondition(f"adapter {adapter_id!r} is {record.state}: {record.reason}")
        if version and version != record.version:
            raise FailedPrecondition(f"adapter {adapter_id!r} is at version {record.version}, "
                                     f"not {version[:64]!r}")
        first_s = self._fresh.pop(record.version, None)     # its first use's source read
        cached = self._cache.get(record.version, fresh=first_s is not None)
        metrics.count_lookup(cached is not None and first_s is None)
        if cached is not None and first_s is not None:
            return Staged(record, cached.data, SOURCE, first_s, cached.shm_file)
        if cached is not None:
            return Staged(record, cached.data, STORE_HOST, 0.0, cached.shm_file)
        task = self._inflight.get(record.version)
        if task is None:  # one source read per version, however many Fetches wait for it
            task = asyncio.ensure_future(self._from_source(record, remaining))
            self._inflight[record.version] = task
            task.add_done_callback(lambda t, v=record.version: self._landed(v, t))
        cached, seconds = await bounded(asyncio.shield(task), remaining)
        return Staged(record, cached.data, SOURCE, seconds, cached.shm_file)

    def _places(self, record: AdapterRecord) -> list[tuple[object, SourceRef, bool]]:
        """(reader, ref, is the store's copy) of where the version's bytes are, in the order
        they are read: the source (what a cold load's trace shows: s3.get, or a local read),
        then the store's copy when it has one."""
        source = (self._reader, parse_source(record.source, self._bucket), False)
        ref = self._keep.ref(record.version) if self._keep is not None else None
        return [source, (self._keep.reader, ref, True)] if ref is not None else [source]

    async def _from_source(self, record: AdapterRecord, remaining: float | None
                           ) -> tuple[CachedBlob, float]:
        """The version's bytes, verified, into the host tier: from the source, or, when the
        source no longer holds them (overwritten in place, deleted, unreachable), from the
        store's copy. A copy that no longer matches either (a damaged disk) is removed."""
        start = time.perf_counter()
        places = self._places(record)
        for i, (reader, ref, kept) in enumerate(places):
            try:
                cached = await self._read_verified(record, reader, ref, kept, remaining)
                break
            except LorafleetError as exc:
                reason = "data_loss" if isinstance(exc, DataLoss) else "error"
                metrics.observe_source_load(self._window, "keep" if kept else ref.kind, reason,
                                            0.0)
                log.warning("staging %r from %s failed: %s%s", record.id, ref.uri, exc.message,
                            "" if i + 1 == len(places) else "; reading the store's copy")
                if kept and isinstance(exc, DataLoss):
                    self._keep.remove(record.version)
                if i + 1 == len(places):
                    raise
        cached, evicted = self._cache.put(record.version, record.owner, cached)
        metrics.CACHE_EVICTIONS.labels(metrics.TIER).inc(len(evicted))
        self._publish_host_tier()
        seconds = time.perf_counter() - start
        metrics.observe_source_load(self._window, "keep" if kept else ref.kind, "ok", seconds)
        return cached, seconds

    async def _read_verified(self, record: AdapterRecord, reader, ref: SourceRef, kept: bool,
                             remaining: float | None) -> CachedBlob:
        # s3:// reads show as s3.get spans (sources.py); a local read gets one of its own
        read_span = (_tracer.start_as_current_span("store.source_read") if ref.kind == "file"
                     else contextlib.nullcontext())
        landing = self._cache.landing(record.version) if ref.kind == "file" else None
        trusted = self._identities.get((ref.uri, record.version))
        with read_span:             # a local blob is hashed as it is read, into its place
            raw = await asyncio.to_thread(reader.read, ref, remaining, None, landing, trusted)
        with _tracer.start_as_current_span("store.verify") as span:
            span.set_attribute("lora.bytes", len(raw.blob))
            return await asyncio.to_thread(self._verified, record, ref, raw, kept)

    def _verified(self, record: AdapterRecord, ref: SourceRef, raw, kept: bool) -> CachedBlob:
        """The bytes as the host tier keeps them, once they match the registration (blocking:
        a thread); DATA_LOSS, nothing kept, when they do not. Verified bytes of a source
        that the store held no copy of are kept (keep.py)."""
        try:
            config_json = canonical_json(json.loads(raw.config))
        except (UnicodeDecodeError, ValueError, RecursionError):
            config_json = ""
        if raw.trusted:         # the file is as the read that hashed it saw it
            digest = record.sha256
        else:
            digest = raw.sha256 or hashlib.sha256(raw.blob).hexdigest()
        if config_json != record.config_json or digest != record.sha256:
            if raw.landed is not None:
                raw.landed.drop()
            where = "the store's copy" if kept else "the source"
            log.error("adapter %r: %s (%s) changed since registration (registered version %s); "
                      "not served", record.id, where, ref.uri, record.version)
            raise DataLoss(f"adapter {record.id!r}: {where} no longer matches the registered "
                           f"version {record.version}; re-register it")
        if raw.identity is not None and not raw.trusted:
            self._identities[(ref.uri, record.version)] = raw.identity
        if not kept and self._keep is not None and wants_copy(record):
            self._keep.put(record.version, record.config_json, raw.blob)
        if raw.landed is not None:
            return self._cache.keep(raw.landed)
        return self._cache.prepare(record.version, raw.blob)

    def _landed(self, version: str, task: asyncio.Task) -> None:
        self._inflight.pop(version, None)
        if not task.cancelled():
            task.exception()  # retrieved here, so an unawaited failure is not logged twice
