"""The first use of a REGISTERED adapter (found by the --adapters-dir scan, its weights never
read), a mixin of store.AdapterStore; and the one read that validates an adapter, which
Register uses too (`read_validated`).

One read, one pass (first_pass.py): the config, then the header and shapes (a bad one is
refused before the body is read), then per chunk the two digests and the finite check, the
bytes landing where they are served from: a first use reads them into the store's host tier
(its shared-memory file when there is --shm-dir), so the Fetch that follows streams or names
what was checked, with no second read, copy or hash. The background validation
(background.py) keeps nothing: a host tier filled with adapters nobody asked for would evict
the ones in use.

Threads: first uses run on their own pool (work_pool.ValidationPool, sized to the machine,
--first-use-threads), never on the event loop; the tenant whose call started one (Resolve's
tenant; a Fetch's is the adapter's owner) holds at most --first-use-per-tenant of its threads
and waits its turn past that, so one tenant's burst leaves the others threads. Each first use
hashes the blob's SHA-256 on a helper thread beside its version digest (`_digest_helper`, as
many threads as the pool), so a lone first use takes two cores' time. Concurrent first
uses of one adapter share one read (`_validating`), each caller within its own deadline.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, replace as dc_replace
from typing import Callable

from opentelemetry import trace

from services.adapter_store import metrics
from services.adapter_store.first_pass import PassTimes, feed_bytes, read_checked
from services.adapter_store.peft_config import check_config
from services.adapter_store.registry import FAILED, READY, REGISTERED, AdapterRecord
from services.adapter_store.s3 import MissingFile
from services.adapter_store.landing import Destination
from services.adapter_store.sources import SourceReader, SourceRef, parse_source
from services.adapter_store.staging import bounded
from services.adapter_store.validate import AdapterCheck, AdapterSummary, BaseShapes
from services.common.errors import Refusal, unknown_adapter

log = logging.getLogger(__name__)
_tracer = trace.get_tracer(__name__)


@dataclass
class Checked:
    """A validated read: the summary, the local file's identity (None: S3, or it changed),
    the bytes when they were kept (in `landed`, or S3's object), and the pass's stage times."""
    summary: AdapterSummary
    identity: tuple | None
    blob: bytes | memoryview | None
    landed: Destination | None
    times: PassTimes


def read_validated(reader: SourceReader, ref: SourceRef, base: BaseShapes, max_rank: int,
                   timeout: float | None, landing: Callable[[int], Destination] | None = None,
                   keep_bytes: bool = False, helper: Executor | None = None) -> Checked:
    """Read and validate the adapter at ref in one pass (blocking: a thread). landing: where
    a local blob's bytes go (None: into memory when keep_bytes, else nowhere); helper: a
    thread for one of the digests (BlobPass). Missing files are refusals."""
    try:
        if ref.kind != "file":
            raw = reader.read(ref, timeout, check_config=lambda config: check_config(
                config, base.layers, max_rank))
            check = AdapterCheck(raw.config, base, max_rank, helper)
            feed_bytes(check.blob, raw.blob)
            summary = check.summary()
            _log_ignored(ref, summary)
            return Checked(summary, None, raw.blob, None, check.blob.times)
        deadline = None if timeout is None else time.monotonic() + timeout
        checks: list[AdapterCheck] = []
        with reader.open_weights(ref, lambda c: checks.append(
                AdapterCheck(c, base, max_rank, helper))) as (_, f, info):
            dest = (landing or Destination)(info.st_size) if landing or keep_bytes else None
            try:
                read_checked(f, info.st_size, checks[0].blob, dest, deadline)
                summary = checks[0].summary()
                _log_ignored(ref, summary)
                identity = reader.identity_after(f, info)
            except BaseException:
                if dest is not None:
                    dest.drop()
                raise
        return Checked(summary, identity, dest.view if dest is not None else None, dest,
                       checks[0].blob.times)
    except MissingFile as exc:
        raise Refusal("missing_file", exc.message) from None


def _log_ignored(ref: SourceRef, summary: AdapterSummary) -> None:
    if summary.ignored:
        log.info("%s: adapter_config.json fields unknown to this store, left unset, ignored: "
                 "%s", ref.uri, ", ".join(summary.ignored))
    if summary.ignored_tensors:
        log.info("%s: %d LoRA tensors of the vision tower or projector ignored (the served "
                 "base is a multimodal model served as its text model: they change image "
                 "inputs only)", ref.uri, summary.ignored_tensors)


def record_of(adapter_id: str, owner: str, ref: SourceRef, s: AdapterSummary,
              aliases: tuple[str, ...], identity: tuple | None) -> AdapterRecord:
    """The READY record of a validated adapter."""
    return AdapterRecord(
        id=adapter_id, owner=owner, source=ref.uri, state=READY, version=s.version,
        sha256=s.sha256, rank=s.rank, alpha=s.alpha, rslora=s.rslora, targets=s.targets,
        layers=s.layers, bytes=s.total_bytes, config_json=s.config_json, tensors=s.tensors,
        aliases=aliases, identity=tuple(identity or ()))


class FirstUseMixin:
    """Needs AdapterStore's _registry, _reader, _cache, _base, _max_rank, _bucket,
    _first_use_pool, _digest_helper, _fresh, _validating, _background_ids, _window, _trust, _drop_unkept and
    _publish_host_tier."""

    async def _validated(self, record: AdapterRecord, remaining: float | None,
                         background: ThreadPoolExecutor | None = None,
                         tenant: str | None = None) -> AdapterRecord:
        """record, or (REGISTERED) the adapter once read and validated whole, READY or FAILED.
        One validation per id however many callers wait for it, each within its own deadline,
        whoever started it: a first use (charged to `tenant`, else the adapter's owner), or
        the background validation (background.py) on its own threads."""
        if record.state != REGISTERED:
            return record
        task = self._validating.get(record.id)
        if task is None:
            payer = record.owner if tenant is None else tenant
            task = asyncio.ensure_future(self._first_use(record, background, payer))
            if background is not None:
                self._background_ids.add(record.id)
            self._validating[record.id] = task
            task.add_done_callback(lambda t, i=record.id: self._first_use_done(i, t))
        else:
            log.debug("adapter %r: sharing the validation of it under way", record.id)
        settled = await bounded(asyncio.shield(task), remaining)
        if settled is None:                     # deleted meanwhile
            raise unknown_adapter(record.id)
        return settled

    async def _first_use(self, record: AdapterRecord, background: ThreadPoolExecutor | None,
                         payer: str) -> AdapterRecord | None:
        """Validate a REGISTERED adapter as Register would and record the outcome (a refusal
        makes it FAILED with the reason; an error of the source, e.g. S3 unreachable, leaves it
        REGISTERED and reaches the caller); a first use keeps the bytes in the host tier."""
        ref = parse_source(record.source, self._bucket)
        when = "in the background" if background is not None else "on first use"
        landing = self._cache.landing() if background is None else None
        start = time.perf_counter()
        try:
            if background is not None:
                context = contextvars.copy_context()        # the caller's trace context
                checked = await asyncio.get_running_loop().run_in_executor(
                    background, context.run, self._read_checked, ref, landing, start, None)
            else:
                checked = await self._first_use_pool.run(payer, self._read_checked, ref, landing,
                                                         start, self._digest_helper, wait=True)
        except (Refusal, OSError) as exc:
            reason = getattr(exc, "message", None) or f"cannot be read: {exc}"
            metrics.REFUSALS.labels(getattr(exc, "reason", "source")).inc()
            log.warning("adapter %r FAILED %s: %s", record.id, when, reason)
            settled = self._registry.settle(record, dc_replace(record, state=FAILED,
                                                               reason=reason))
        else:
            seconds = time.perf_counter() - start
            settled = self._settle_checked(record, ref, checked, background is not None,
                                           seconds)
            if background is None:
                metrics.observe_source_load(self._window, ref.kind, "ok", seconds)
        metrics.set_adapter_counts(self._registry.counts())
        return settled

    def _settle_checked(self, record: AdapterRecord, ref: SourceRef, checked: Checked,
                        quiet: bool, seconds: float) -> AdapterRecord | None:
        """Record a validated read READY (unless the adapter changed meanwhile) and keep its
        landed bytes in the host tier (seconds: the read's, which its first Fetch reports)."""
        stored = record_of(record.id, record.owner, ref, checked.summary, record.aliases,
                           checked.identity)
        before = self._registry.versions_of(record.id)
        settled = self._registry.settle(record, stored)
        self._drop_unkept(before | {stored.version})    # not taken, or one pruned
        taken = settled is not None and settled.version == stored.version
        if taken:
            self._trust(settled, checked.identity)
        self._host_keep(settled if taken else None, checked.landed, seconds)
        log.log(logging.DEBUG if quiet else logging.INFO,
                "adapter %r validated %s: version %s, %d bytes", record.id,
                "in the background" if quiet else "on first use", stored.version, stored.bytes)
        return settled

    def _host_keep(self, record: AdapterRecord | None, landed: Destination | None,
                   seconds: float) -> None:
        """Keep a first use's bytes (landed in the host tier) as record's version's blob; drop
        them when there is no record or the version is there already. Its first Fetch is a
        SOURCE load of `seconds` (staging.py: _fresh)."""
        if landed is None:
            return
        if record is None or record.version in self._cache:
            landed.drop()
            return
        _, evicted = self._cache.put(record.version, record.owner,
                                     self._cache.keep(landed, record.version))
        if record.version in self._cache:
            self._fresh[record.version] = seconds
        metrics.CACHE_EVICTIONS.labels(metrics.TIER).inc(len(evicted))
        self._publish_host_tier()

    def _read_checked(self, ref: SourceRef, landing, queued: float,
                      helper: Executor | None) -> Checked:
        """read_validated in a thread, traced with its stages (queued: when it was asked)."""
        with _tracer.start_as_current_span("store.validate") as span:
            span.set_attributes({"lora.source": ref.uri,
                                 "lora.wait_s": time.perf_counter() - queued})
            checked = read_validated(self._reader, ref, self._base, self._max_rank, None,
                                     landing, helper=helper)
            t = checked.times
            span.set_attributes({"lora.bytes": checked.summary.total_bytes,
                                 "lora.read_s": t.read_s, "lora.digest_s": t.digest_s,
                                 "lora.finite_s": t.finite_s})
            return checked

    async def validate_in_background(self, adapter_id: str, threads: ThreadPoolExecutor
                                     ) -> AdapterRecord | None:
        """The adapter validated as its first use would be, on `threads` (or the validation
        of it already under way); None when it is not REGISTERED (any more) or is gone."""
        record = self._registry.get(adapter_id)     # no await before _validated looks
        if record is None or record.state != REGISTERED:
            return None
        return await self._validated(record, None, threads)

    def _first_use_done(self, adapter_id: str, task: asyncio.Task) -> None:
        self._validating.pop(adapter_id, None)
        self._background_ids.discard(adapter_id)
        if not task.cancelled():
            task.exception()        # retrieved: its waiters may all have left
