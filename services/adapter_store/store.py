"""The adapter store's domain: register (read + validate once, keep the bytes), resolve with
tenant visibility, list, list versions, delete, and stage for Fetch (staging.py: host tier, else
the store's copy or the source, digest-checked).

Versions: `version` = first 16 hex of SHA-256(canonical config JSON + "\\n" + blob) and `sha256` =
SHA-256 of the blob (validate.content_version). A validated version's bytes are kept in the
store's --version-dir (keep.py) for as long as the registry keeps the version, so overwriting a
source in place never takes a kept version away; a read that does not match the registration
(config and SHA-256) is DATA_LOSS and nothing is cached.
"""
from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace as dc_replace

from opentelemetry import trace

from services.adapter_store import metrics, paging
from services.common.errors import Refusal
from services.adapter_store.host_cache import HostCache, HostTierStats
from services.adapter_store.keep import VersionKeep
from services.adapter_store.peft_config import check_config
from services.adapter_store.registry import FAILED, READY, REGISTERED, AdapterRecord, Registry
from services.adapter_store.registry_versions import KeptVersion
from services.adapter_store.s3 import MissingFile
from services.adapter_store.sources import SourceReader, SourceRef, parse_source
from services.adapter_store.staging import (SOURCE, STORE_HOST, Staged, StagingMixin,
                                            bounded as _bounded, check_name)
from services.adapter_store.validate import AdapterSummary, BaseShapes, validate
from services.adapter_store.work_pool import ValidationPool
from services.common.errors import (AlreadyExists, FailedPrecondition, LorafleetError,
                                    unknown_adapter)
from services.common.names import ref_error

log = logging.getLogger(__name__)
_tracer = trace.get_tracer(__name__)
MAX_ALIASES = 32
__all__ = ["AdapterStore", "Staged", "SOURCE", "STORE_HOST", "check_name"]


@dataclass(frozen=True)
class StoreStats:
    registered: int
    failed: int
    host: HostTierStats
    source_loads: int
    p50: float
    p95: float
    p99: float


class AdapterStore(StagingMixin):
    """Registry + sources + validation + host tier + kept versions; called by the servicer on
    the event loop (staging for Fetch: staging.StagingMixin)."""

    def __init__(self, base: BaseShapes, registry: Registry, reader: SourceReader,
                 cache: HostCache, max_rank: int, default_bucket: str | None,
                 pool: ValidationPool | None = None, first_use_threads: int = 4,
                 keep: VersionKeep | None = None):
        """pool: the threads Register validates on (work_pool.ValidationPool);
        first_use_threads: those that validate REGISTERED adapters on first use; keep: where
        the bytes of every kept version are kept (None: nowhere, the source is read again)."""
        self._base, self._registry, self._reader, self._keep = base, registry, reader, keep
        self._pool = pool or ValidationPool()
        self._first_use_threads = ThreadPoolExecutor(first_use_threads,
                                                     thread_name_prefix="store-first-use")
        self._validating: dict[str, asyncio.Task] = {}     # id -> its first-use validation
        self._background_ids: set[str] = set()      # of them, those background.py started
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
        self._check_claim(ref, owner)
        summary, identity = await _bounded(self._pool.run(owner, self._load_validated, ref,
                                                          remaining), remaining)
        before = self._registry.versions_of(adapter_id)
        try:
            stored, old = self._registry.put(_record(adapter_id, owner, ref, summary,
                                                     tuple(aliases), identity), replace)
        finally:        # a refused put keeps nothing new; a replace may prune old versions
            self._drop_unkept(before | {summary.version})
        self._trust(stored, identity)
        if old is not None and old.version != stored.version:
            self._forget(old.version)
        return stored

    def _check_claim(self, ref: SourceRef, owner: str) -> None:
        """Log when a private adapter is registered from a directory the --adapters-dir scan
        publishes: its bytes are every tenant's already, under the directory's name (scan.py
        keeps publishing a directory it published before any private registration)."""
        folder = self._reader.real_dir(ref)
        root = self._reader.root
        if not owner or folder is None or root is None or folder.parent != root:
            return
        shared = self._registry.get(folder.name)
        if shared is not None and shared.shared and shared.source == f"file://{folder.name}":
            log.warning("adapter source %s is also the shared adapter %r of the --adapters-dir "
                        "scan: every tenant can use these bytes; keep a private adapter's files "
                        "where the scan does not publish them (a subdirectory, or an "
                        "--allow-source-root), or delete %r first", ref.uri, folder.name,
                        folder.name)

    def _drop_unkept(self, versions: set[str]) -> None:
        """Remove the kept bytes of those of `versions` that no adapter keeps now."""
        if self._keep is None:
            return
        for version in versions:
            if version and not self._registry.version_kept(version):
                self._keep.remove(version)

    @property
    def max_rank(self) -> int:
        """The largest rank Register accepts (--max-rank)."""
        return self._max_rank

    def _trust(self, record: AdapterRecord, identity: tuple | None) -> None:
        """A local blob's file as its validated (hashed) read saw it: later source reads that
        see the same identity need not hash it again (SourceReader.read's trusted)."""
        if identity is not None:
            self._identities[(record.source, record.version)] = identity

    def _load_validated(self, ref: SourceRef, remaining: float | None, keep: bool = True
                        ) -> tuple[AdapterSummary, tuple | None]:
        """Read and validate (blocking: runs in a thread); missing files become refusals.
        Returns the summary and the blob file's identity (local sources). keep: the validated
        bytes are kept (keep.py) before it returns: a registered version. Not for the first
        use of an --adapters-dir adapter: that directory is the adapter (a changed one is
        recorded anew at the next start), and a copy of every scanned adapter would double
        the disk a large directory takes."""
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
            if self._keep is not None and keep:
                self._keep_copy(summary.version, summary.config_json, raw.blob)
            return summary, raw.identity

    def _keep_copy(self, version: str, config_json: str, blob) -> None:
        """The store's own copy of a validated version: what later reads read."""
        self._keep.put(version, config_json, blob)
        ref, identity = self._keep.trusted(version)
        if identity is not None:            # written here, once: no read need hash it again
            self._identities[(ref, version)] = identity

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

    def versions(self, name: str, tenant: str, all_tenants: bool
                 ) -> tuple[AdapterRecord, list[tuple[KeptVersion, bool]]]:
        """The adapter `name` (id or alias) as tenant sees it (any adapter by id when
        all_tenants) and its kept versions, newest first, each with whether the store holds
        its bytes; NOT_FOUND as resolve."""
        check_name("id", name)
        check_name("tenant", tenant, allow_empty=True)
        record = self._registry.get(name) if all_tenants else None
        record = record or self._registry.lookup(name, tenant)
        if record is None or not (all_tenants or record.visible_to(tenant)):
            raise unknown_adapter(name)
        return record, [(v, self._keep is not None and self._keep.has(v.version))
                        for v in self._registry.list_versions(record.id)]

    def delete(self, adapter_id: str) -> None:
        """Remove the adapter, its aliases and kept versions, and (if no other id shares them)
        its staged blob and kept bytes."""
        check_name("id", adapter_id)
        before = self._registry.versions_of(adapter_id)
        old = self._registry.delete(adapter_id)
        self._drop_unkept(before)
        self._forget(old.version)
        metrics.set_adapter_counts(self._registry.counts())
        log.info("deleted adapter %r (version %s)", adapter_id, old.version or "-")

    def _forget(self, version: str) -> None:
        if version and not self._registry.version_in_use(version):
            self._cache.remove(version)
            self._publish_host_tier()

    # ---- first use of a scanned adapter ----------------------------------------------------

    async def _validated(self, record: AdapterRecord, remaining: float | None,
                         background: ThreadPoolExecutor | None = None) -> AdapterRecord:
        """record, or (REGISTERED: found by the start-up scan, its weights never read) the
        adapter once read and validated whole, READY or FAILED. One validation per id however
        many callers wait for it, each within its own deadline, whoever started it: a first
        use, or the background validation (background.py) on its own threads."""
        if record.state != REGISTERED:
            return record
        task = self._validating.get(record.id)
        if task is None:
            task = asyncio.ensure_future(self._first_use(record, background))
            if background is not None:
                self._background_ids.add(record.id)
            self._validating[record.id] = task
            task.add_done_callback(lambda t, i=record.id: self._first_use_done(i, t))
        else:
            log.debug("adapter %r: sharing the validation of it under way", record.id)
        settled = await _bounded(asyncio.shield(task), remaining)
        if settled is None:                     # deleted meanwhile
            raise unknown_adapter(record.id)
        return settled

    async def _first_use(self, record: AdapterRecord,
                         background: ThreadPoolExecutor | None = None) -> AdapterRecord | None:
        """Validate a REGISTERED adapter as Register would and record the outcome (a refusal
        makes it FAILED with the reason; an error of the source, e.g. S3 unreachable, leaves it
        REGISTERED and reaches the caller). background: the background validation's threads
        (then it runs there, and its success is logged at DEBUG)."""
        ref = parse_source(record.source, self._bucket)
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()        # the caller's trace context
        when = "in the background" if background is not None else "on first use"
        try:
            summary, identity = await loop.run_in_executor(
                background or self._first_use_threads, context.run, self._load_validated, ref,
                None, False)
        except (Refusal, OSError) as exc:
            reason = getattr(exc, "message", None) or f"cannot be read: {exc}"
            metrics.REFUSALS.labels(getattr(exc, "reason", "source")).inc()
            log.warning("adapter %r FAILED %s: %s", record.id, when, reason)
            settled = self._registry.settle(record, dc_replace(record, state=FAILED,
                                                               reason=reason))
        else:
            stored = _record(record.id, record.owner, ref, summary, record.aliases, identity)
            before = self._registry.versions_of(record.id)
            settled = self._registry.settle(record, stored)
            self._drop_unkept(before | {stored.version})    # not taken, or one pruned
            if settled is not None and settled.version == stored.version:
                self._trust(settled, identity)
            log.log(logging.DEBUG if background else logging.INFO,
                    "adapter %r validated %s: version %s, %d bytes", record.id, when,
                    stored.version, stored.bytes)
        metrics.set_adapter_counts(self._registry.counts())
        return settled

    async def validate_in_background(self, adapter_id: str, threads: ThreadPoolExecutor
                                     ) -> AdapterRecord | None:
        """The adapter validated as its first use would be, on `threads` (or the validation
        of it already under way); None when it is not REGISTERED (any more) or is gone."""
        record = self._registry.get(adapter_id)     # no await before _validated looks
        if record is None or record.state != REGISTERED:
            return None
        return await self._validated(record, None, threads)

    def busy(self) -> int:
        """The work the background validation yields to: first-use validations besides its
        own, Fetch source reads, registrations being validated."""
        return (len(self._validating) - len(self._background_ids) + len(self._inflight)
                + self._pool.in_use())

    def _first_use_done(self, adapter_id: str, task: asyncio.Task) -> None:
        self._validating.pop(adapter_id, None)
        self._background_ids.discard(adapter_id)
        if not task.cancelled():
            task.exception()        # retrieved: its waiters may all have left

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
        if self._keep is not None:
            self._keep.close()


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

