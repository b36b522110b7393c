"""The adapter store's domain: register (read + validate once), resolve with tenant visibility,
list, delete, and stage for Fetch (host tier, else the source with a digest check).

Versions: `version` = first 16 hex of SHA-256(canonical config JSON + "\\n" + blob) and `sha256` =
SHA-256 of the blob (validate.content_version). A Fetch that misses the host tier reads the source
again and checks it against the registration: the blob's SHA-256 and the canonical config must
both match (which makes the version match too, at one pass over the bytes); a mismatch is
DATA_LOSS and nothing is cached.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import itertools
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace as dc_replace

from opentelemetry import trace

from services.adapter_store import metrics, paging
from services.common.errors import Refusal
from services.adapter_store.host_cache import CachedBlob, HostCache, HostTierStats
from services.adapter_store.peft_config import check_config
from services.adapter_store.registry import FAILED, READY, REGISTERED, AdapterRecord, Registry
from services.adapter_store.s3 import MissingFile
from services.adapter_store.sources import SourceReader, SourceRef, parse_source
from services.adapter_store.validate import AdapterSummary, BaseShapes, canonical_json, validate
from services.adapter_store.work_pool import ValidationPool
from services.common.errors import (AlreadyExists, DataLoss, DeadlineExceeded, FailedPrecondition,
                                    LorafleetError, NotFound, unknown_adapter)
from services.common.names import name_error, ref_error

log = logging.getLogger(__name__)
_tracer = trace.get_tracer(__name__)
MAX_ALIASES = 32
SOURCE, STORE_HOST = "SOURCE", "STORE_HOST"


def check_name(field: str, value: str, allow_empty: bool = False) -> None:
    """Ids, aliases and tenants: a plain name, never a path or a URL (INVALID_ARGUMENT)."""
    message = name_error(field, value, allow_empty)
    if message is not None:
        raise Refusal("name", message)


@dataclass(frozen=True)
class Staged:
    """An adapter ready to stream: its record, blob, the tier it came from, source seconds, and
    its file in the shared-memory directory (empty: none)."""

    record: AdapterRecord
    blob: bytes | memoryview
    tier: str
    load_s: float
    shm_file: str = ""


@dataclass(frozen=True)
class StoreStats:
    registered: int
    failed: int
    host: HostTierStats
    source_loads: int
    p50: float
    p95: float
    p99: float


class AdapterStore:
    """Registry + sources + validation + host tier; called by the servicer on the event loop."""

    def __init__(self, base: BaseShapes, registry: Registry, reader: SourceReader,
                 cache: HostCache, max_rank: int, default_bucket: str | None,
                 pool: ValidationPool | None = None, first_use_threads: int = 4):
        """pool: the threads Register validates on (work_pool.ValidationPool);
        first_use_threads: those that validate REGISTERED adapters on first use."""
        self._base, self._registry, self._reader = base, registry, reader
        self._pool = pool or ValidationPool()
        self._first_use_threads = ThreadPoolExecutor(first_use_threads,
                                                     thread_name_prefix="store-first-use")
        self._validating: dict[str, asyncio.Task] = {}     # id -> its first-use validation
        self._cache, self._max_rank, self._bucket = cache, max_rank, default_bucket
        self._inflight: dict[str, asyncio.Task] = {}
        self._identities: dict[tuple[str, str], tuple] = {}   # (source, version) -> see _trust
        self._window = metrics.LatencyWindow()
        metrics.set_adapter_counts(registry.counts())

    # ---- registry operations -------------------------------------------------------------------

    async def register(self, adapter_id: str, source: str, owner: str, aliases: list[str],
                       replace: bool, remaining: float | None) -> AdapterRecord:
        """Validate the adapter at `source` and record it READY; raises a domain error."""
        try:
            stored = await self._register(adapter_id, source, owner, aliases, replace, remaining)
        except LorafleetError as exc:
            if isinstance(exc, Refusal):
                metrics.REFUSALS.labels(exc.reason).inc()
            log.warning("register %r from %r refused (%s): %s", adapter_id[:200], source[:200],
                        exc.code.name, exc.message)
            raise
        metrics.set_adapter_counts(self._registry.counts())
        log.info("registered adapter %r version %s from %s: r=%d alpha=%g rslora=%s targets=%s "
                 "%d bytes owner=%r aliases=%s", stored.id, stored.version, stored.source,
                 stored.rank, stored.alpha, stored.rslora, ",".join(stored.targets),
                 stored.bytes, stored.owner, list(stored.aliases))
        return stored

    async def _register(self, adapter_id: str, source: str, owner: str, aliases: list[str],
                        replace: bool, remaining: float | None) -> AdapterRecord:
        check_name("id", adapter_id)
        check_name("owner", owner, allow_empty=True)
        _check_aliases(aliases)
        ref = parse_source(source, self._bucket)
        if not replace and self._registry.get(adapter_id) is not None:  # before any download
            raise AlreadyExists(f"id: adapter {adapter_id!r} already exists (set replace to "
                                "register a new version)")
        summary, identity = await _bounded(self._pool.run(owner, self._load_validated, ref,
                                                          remaining), remaining)
        stored, old = self._registry.put(_record(adapter_id, owner, ref, summary,
                                                 tuple(aliases), identity), replace)
        self._trust(stored, identity)
        if old is not None and old.version != stored.version:
            self._forget(old.version)
        return stored

    @property
    def max_rank(self) -> int:
        """The largest rank Register accepts (--max-rank)."""
        return self._max_rank

    def _trust(self, record: AdapterRecord, identity: tuple | None) -> None:
        """A local blob's file as its validated (hashed) read saw it: later source reads that
        see the same identity need not hash it again (SourceReader.read's trusted)."""
        if identity is not None:
            self._identities[(record.source, record.version)] = identity

    def _load_validated(self, ref: SourceRef, remaining: float | None
                        ) -> tuple[AdapterSummary, tuple | None]:
        """Read and validate (blocking: runs in a thread); missing files become refusals.
        Returns the summary and the blob file's identity (local sources)."""
        with _tracer.start_as_current_span("store.validate") as span:
            span.set_attribute("lora.source", ref.uri)
            try:
                raw = self._reader.read(ref, remaining, check_config=lambda config: check_config(
                    config, self._base.layers, self._max_rank))
            except MissingFile as exc:
                raise Refusal("missing_file", exc.message) from None
            span.set_attribute("lora.bytes", len(raw.blob))
            summary = validate(raw.config, raw.blob, self._base, self._max_rank)
            if summary.ignored:
                log.info("%s: adapter_config.json fields unknown to this store, left unset, "
                         "ignored: %s", ref.uri, ", ".join(summary.ignored))
            return summary, raw.identity

    async def resolve(self, name: str, tenant: str, remaining: float | None = None
                      ) -> AdapterRecord:
        """The adapter `name` (id or alias) as `tenant` sees it; NOT_FOUND if invisible,
        FAILED_PRECONDITION if FAILED (also when its first-use validation fails now)."""
        message = ref_error("name", name)             # ID@VERSION pins a kept version
        if message is not None:
            raise Refusal("name", message)
        check_name("tenant", tenant, allow_empty=True)
        record = self._registry.lookup(name, tenant)
        if record is None or not record.visible_to(tenant):
            raise unknown_adapter(name)
        record = await self._validated(record, remaining)
        if record.state == FAILED:
            raise FailedPrecondition(f"adapter {name!r} is FAILED: {record.reason}")
        return record

    def set_alias(self, alias: str, target: str) -> AdapterRecord:
        """Point alias at an adapter id (following its current version) or ID@VERSION (a kept
        version: a rollback); the record it now resolves to."""
        check_name("alias", alias)
        message = ref_error("target", target)
        if message is not None:
            raise Refusal("name", message)
        rec = self._registry.set_alias(alias, target)
        log.info("alias %r -> %s (version %s)", alias, target, rec.version)
        return rec

    def list_page(self, tenant: str, all_tenants: bool, owner: str = "", prefix: str = "",
                  size: int = 0, token: str = "") -> tuple[list[AdapterRecord], str]:
        """A page of the adapters visible to tenant (every adapter when all_tenants is set) in
        id order, filtered by owner and id prefix when given: (records, next page token, ""
        on the last page). See paging.py for sizes and tokens."""
        check_name("tenant", tenant, allow_empty=True)
        check_name("owner", owner, allow_empty=True)
        check_name("prefix", prefix, allow_empty=True)     # a name's prefix is a name
        key = paging.query_key(tenant, all_tenants, owner, prefix)
        after, limit = paging.decode(token, key), paging.page_size(size)
        rows = self._registry.list_page(None if all_tenants else tenant, owner, prefix, after,
                                        limit + 1)
        sizes = itertools.accumulate(paging.approx_bytes(r.id, r.owner, r.source, r.aliases,
                                                         r.targets, r.reason) for r in rows)
        fits = max(1, sum(1 for total in sizes if total <= paging.MAX_PAGE_BYTES))
        page = rows[:min(limit, fits)]
        more = len(rows) > len(page)
        return page, paging.encode(page[-1].id, key) if more else ""

    def delete(self, adapter_id: str) -> None:
        """Remove the adapter, its aliases and (if no other id shares it) its staged blob."""
        check_name("id", adapter_id)
        old = self._registry.delete(adapter_id)
        self._forget(old.version)
        metrics.set_adapter_counts(self._registry.counts())
        log.info("deleted adapter %r (version %s)", adapter_id, old.version or "-")

    def _forget(self, version: str) -> None:
        if version and not self._registry.version_in_use(version):
            self._cache.remove(version)
            self._publish_host_tier()

    # ---- first use of a scanned adapter ----------------------------------------------------

    async def _validated(self, record: AdapterRecord, remaining: float | None
                         ) -> AdapterRecord:
        """record, or (REGISTERED: found by the start-up scan, its weights never read) the
        adapter once read and validated whole, READY or FAILED. One validation per id however
        many callers wait for it, each within its own deadline."""
        if record.state != REGISTERED:
            return record
        task = self._validating.get(record.id)
        if task is None:
            task = asyncio.ensure_future(self._first_use(record))
            self._validating[record.id] = task
            task.add_done_callback(lambda t, i=record.id: self._first_use_done(i, t))
        settled = await _bounded(asyncio.shield(task), remaining)
        if settled is None:                     # deleted meanwhile
            raise unknown_adapter(record.id)
        return settled

    async def _first_use(self, record: AdapterRecord) -> AdapterRecord | None:
        """Validate a REGISTERED adapter as Register would and record the outcome (a refusal
        makes it FAILED with the reason; an error of the source, e.g. S3 unreachable, leaves it
        REGISTERED and reaches the caller)."""
        ref = parse_source(record.source, self._bucket)
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()        # the caller's trace context
        try:
            summary, identity = await loop.run_in_executor(
                self._first_use_threads, context.run, self._load_validated, ref, None)
        except (Refusal, OSError) as exc:
            reason = getattr(exc, "message", None) or f"cannot be read: {exc}"
            metrics.REFUSALS.labels(getattr(exc, "reason", "source")).inc()
            log.warning("adapter %r FAILED on first use: %s", record.id, reason)
            settled = self._registry.settle(record, dc_replace(record, state=FAILED,
                                                               reason=reason))
        else:
            stored = _record(record.id, record.owner, ref, summary, record.aliases, identity)
            settled = self._registry.settle(record, stored)
            if settled is not None and settled.version == stored.version:
                self._trust(settled, identity)
            log.info("adapter %r validated on first use: version %s, %d bytes", record.id,
                     stored.version, stored.bytes)
        metrics.set_adapter_counts(self._registry.counts())
        return settled

    def _first_use_done(self, adapter_id: str, task: asyncio.Task) -> None:
        self._validating.pop(adapter_id, None)
        if not task.cancelled():
            task.exception()        # retrieved: its waiters may all have left

    # ---- staging ---------------------------------------------------------------------------------

    async def stage(self, adapter_id: str, version: str, remaining: float | None,
                    pinned: bool = False) -> Staged:
        """The adapter's blob from the host tier, else from its source (digest-checked).
        version: the one expected (FAILED_PRECONDITION if the adapter moved on), unless pinned:
        then that version if the registry keeps it."""
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
        cached = self._cache.get(record.version)
        metrics.count_lookup(cached is not None)
        if cached is not None:
            return Staged(record, cached.data, STORE_HOST, 0.0, cached.shm_file)
        task = self._inflight.get(record.version)
        if task is None:  # one source read per version, however many Fetches wait for it
            task = asyncio.ensure_future(self._from_source(record, remaining))
            self._inflight[record.version] = task
            task.add_done_callback(lambda t, v=record.version: self._landed(v, t))
        cached, seconds = await _bounded(asyncio.shield(task), remaining)
        return Staged(record, cached.data, SOURCE, seconds, cached.shm_file)

    async def _from_source(self, record: AdapterRecord, remaining: float | None
                           ) -> tuple[CachedBlob, float]:
        ref = parse_source(record.source, self._bucket)
        start = time.perf_counter()
        try:
            # s3:// reads show as s3.get spans (sources.py); a local read gets one of its own
            read_span = (_tracer.start_as_current_span("store.source_read") if ref.kind == "file"
                         else contextlib.nullcontext())
            landing = self._cache.landing(record.version) if ref.kind == "file" else None
            trusted = self._identities.get((record.source, record.version))
            with read_span:             # a local blob is hashed as it is read, into its place
                raw = await asyncio.to_thread(self._reader.read, ref, remaining, None, landing,
                                              trusted)
            with _tracer.start_as_current_span("store.verify") as span:
                span.set_attribute("lora.bytes", len(raw.blob))
                cached = await asyncio.to_thread(self._verified, record, ref, raw)
        except LorafleetError as exc:
            reason = "data_loss" if isinstance(exc, DataLoss) else "error"
            metrics.observe_source_load(self._window, ref.kind, reason, 0.0)
            log.warning("staging %r from %s failed: %s", record.id, ref.uri, exc.message)
            raise
        cached, evicted = self._cache.put(record.version, record.owner, cached)
        metrics.CACHE_EVICTIONS.labels(metrics.TIER).inc(len(evicted))
        self._publish_host_tier()
        seconds = time.perf_counter() - start
        metrics.observe_source_load(self._window, ref.kind, "ok", seconds)
        return cached, seconds

    def _verified(self, record: AdapterRecord, ref: SourceRef, raw) -> CachedBlob:
        """The source's bytes as the host tier keeps them, once they match the registration
        (blocking: a thread); DATA_LOSS, nothing kept, when they do not."""
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
            log.error("adapter %r: source %s changed since registration (registered version "
                      "%s); not served", record.id, ref.uri, record.version)
            raise DataLoss(f"adapter {record.id!r}: the source no longer matches the registered "
                           f"version {record.version}; re-register it")
        if raw.identity is not None and not raw.trusted:
            self._identities[(record.source, record.version)] = raw.identity
        if raw.landed is not None:
            return self._cache.keep(raw.landed)
        return self._cache.prepare(record.version, raw.blob)

    def _landed(self, version: str, task: asyncio.Task) -> None:
        self._inflight.pop(version, None)
        if not task.cancelled():
            task.exception()  # retrieved here, so an unawaited failure is not logged twice

    def _publish_host_tier(self) -> None:
        st = self._cache.stats()
        metrics.set_host_tier(st.resident, st.bytes)

    def stats(self) -> StoreStats:
        counts = self._registry.counts()
        w = self._window
        return StoreStats(registered=sum(counts.values()), failed=counts.get(FAILED, 0),
                          host=self._cache.stats(), source_loads=w.count, p50=w.quantile(0.5),
                          p95=w.quantile(0.95), p99=w.quantile(0.99))

    def close(self) -> None:
        """Give up the host tier's shared-memory files and the validation threads
        (shutdown)."""
        self._cache.close()
        self._pool.close()
        self._first_use_threads.shutdown(wait=False, cancel_futures=True)


def _check_aliases(aliases: list[str]) -> None:
    if len(aliases) > MAX_ALIASES or len(set(aliases)) != len(aliases):
        raise Refusal("name", f"aliases: at most {MAX_ALIASES}, without repeats")
    for alias in aliases:
        check_name("aliases", alias)


def _record(adapter_id: str, owner: str, ref: SourceRef, s: AdapterSummary,
            aliases: tuple[str, ...], identity: tuple | None) -> AdapterRecord:
    return AdapterRecord(
        id=adapter_id, owner=owner, source=ref.uri, state=READY, version=s.version,
        sha256=s.sha256, rank=s.rank, alpha=s.alpha, rslora=s.rslora, targets=s.targets,
        layers=s.layers, bytes=s.total_bytes, config_json=s.config_json, tensors=s.tensors,
        aliases=aliases, identity=tuple(identity or ()))


async def _bounded(awaitable, remaining: float | None):
    """Await within the caller's remaining deadline (DEADLINE_EXCEEDED past it)."""
    try:
        return await asyncio.wait_for(awaitable, remaining)
    except asyncio.TimeoutError:
        raise DeadlineExceeded("deadline exceeded while reading the adapter source") from None
