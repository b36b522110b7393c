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

import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from opentelemetry import trace

from services.adapter_store import metrics, paging
from services.common.errors import Refusal
from services.adapter_store.host_cache import HostCache, HostTierStats
from services.adapter_store.keep import VersionKeep
from services.adapter_store.first_use import FirstUseMixin, read_validated, record_of
from services.adapter_store.registry import FAILED, AdapterRecord, Registry
from services.adapter_store.registry_versions import KeptVersion
from services.adapter_store.sources import SourceReader, SourceRef, parse_source
from services.adapter_store.staging import (SOURCE, STORE_HOST, Staged, StagingMixin,
                                            bounded as _bounded, check_name)
from services.adapter_store.validate import AdapterSummary, BaseShapes
from services.adapter_store.work_pool import ValidationPool, default_threads, machine_cpus
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


class AdapterStore(FirstUseMixin, StagingMixin):
    """Registry + sources + validation + host tier + kept versions; called by the servicer on
    the event loop (staging for Fetch: staging.StagingMixin)."""

    def __init__(self, base: BaseShapes, registry: Registry, reader: SourceReader,
                 cache: HostCache, max_rank: int, default_bucket: str | None,
                 pool: ValidationPool | None = None, first_use: ValidationPool | None = None,
                 keep: VersionKeep | None = None):
        """pool: the threads Register validates on (work_pool.ValidationPool); first_use:
        those that validate REGISTERED adapters on first use (first_use.py; None: sized to
        the machine); keep: where the bytes of every kept version are kept (None: nowhere,
        the source is read again)."""
        self._base, self._registry, self._reader, self._keep = base, registry, reader, keep
        self._pool = pool or ValidationPool()
        self._first_use_pool = first_use or ValidationPool(
            default_threads(machine_cpus()), name="store-first-use")
        self._digest_helper = ThreadPoolExecutor(self._first_use_pool.threads,     # one each
                                                 thread_name_prefix="store-digest")
        self._validating: dict[str, asyncio.Task] = {}     # id -> its first-use validation
        self._background_ids: set[str] = set()      # of them, those background.py started
        self._cache, self._max_rank, self._bucket = cache, max_rank, default_bucket
        self._inflight: dict[str, asyncio.Task] = {}
        self._fresh: dict[str, float] = {}      # version -> a first use's read, not yet fetched
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
            stored, old = self._registry.put(record_of(adapter_id, owner, ref, summary,
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

    def _load_validated(self, ref: SourceRef, remaining: float | None
                        ) -> tuple[AdapterSummary, tuple | None]:
        """Read and validate a registration's adapter in one pass (blocking: runs in a
        thread), its bytes kept (keep.py) before it returns. Returns the summary and the blob
        file's identity (local sources); missing files are refusals."""
        with _tracer.start_as_current_span("store.validate") as span:
            span.set_attribute("lora.source", ref.uri)
            checked = read_validated(self._reader, ref, self._base, self._max_rank, remaining,
                                     keep_bytes=self._keep is not None)
            summary = checked.summary
            span.set_attribute("lora.bytes", summary.total_bytes)
            if self._keep is not None:
                self._keep_copy(summary.version, summary.config_json, checked.blob)
            return summary, checked.identity

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
        record = await self._validated(record, remaining, tenant=tenant)
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
            self._fresh.pop(version, None)
            self._publish_host_tier()

    def busy(self) -> int:
        """The work the background validation yields to: first-use validations besides its
        own, Fetch source reads, registrations being validated."""
        return (len(self._validating) - len(self._background_ids) + len(self._inflight)
                + self._pool.in_use())

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
        self._first_use_pool.close()
        self._digest_helper.shutdown(wait=False, cancel_futures=True)
        if self._keep is not None:
            self._keep.close()


def _check_aliases(aliases: list[str]) -> None:
    if len(aliases) > MAX_ALIASES or len(set(aliases)) != len(aliases):
        raise Refusal("name", f"aliases: at most {MAX_ALIASES}, without repeats")
    for alias in aliases:
        check_name("aliases", alias)
