"""Background validation: once the store is SERVING, the REGISTERED adapters (recorded by the
--adapters-dir scan from their config and a stat, their weights never read) are read,
validated and hashed as their first use would (AdapterStore.validate_in_background: the same
code path and outcome, READY with its version or FAILED with the reason), so that a first
use finds them READY instead of paying for it on the request path.

Low priority, never in the way:
- it starts START_DELAY_S after the store reports SERVING (the `started` hook comes just
  before SERVING: the delay keeps it after) and never delays SERVING;
- `threads` validations at most at once (--background-validate-threads; 0 = off), on threads
  of their own, niced (os.setpriority: the CPU and, by default, the disk's I/O priority follow
  it), so the first-use and Register threads stay free for requests;
- before each adapter it waits while the store has work of a request under way (first-use
  validations, Fetch source reads, registrations: AdapterStore.busy), up to YIELD_MAX_S, so a
  steady stream of cold loads slows it down without stopping it for good;
- --background-validate-bytes-per-s caps the bytes it reads a second (page cache and disk
  bandwidth stay the cold loads');
- a first use of an adapter it is validating now shares that validation (the store's
  `_validating` map), and an adapter that a first use settled is skipped.

Order: by id (the registry records no use times; a READY adapter kept in --db from before a
restart is not REGISTERED, so only what changed or was never used is read again).
Progress goes to the log every PROGRESS_EVERY adapters or PROGRESS_S seconds, and to
/metrics (metrics.BACKGROUND, metrics.BACKGROUND_LEFT). stop() (the drain) ends it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from services.adapter_store import metrics
from services.adapter_store.registry import FAILED, READY, REGISTERED, Registry
from services.common.errors import LorafleetError

log = logging.getLogger(__name__)
START_DELAY_S = 0.5          # after the `started` hook: SERVING first
YIELD_POLL_S = 0.02          # how often a waiting validation looks at the store's work again
YIELD_MAX_S = 2.0            # ... and the longest it waits for it
PROGRESS_EVERY = 1000        # adapters between progress lines
PROGRESS_S = 10.0            # ... or seconds
NICE = 10                    # added to the background threads' nice value


@dataclass
class Progress:
    """What the background validation did: outcome -> count, and how many it has to try."""

    total: int = 0
    done: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("ready", "failed", "error", "skipped"), 0))
    started: float = field(default_factory=time.monotonic)

    def count(self, outcome: str) -> None:
        self.done[outcome] += 1
        metrics.BACKGROUND.labels(outcome).inc()
        metrics.BACKGROUND_LEFT.set(self.left)

    @property
    def left(self) -> int:
        return self.total - sum(self.done.values())

    def line(self) -> str:
        d = self.done
        seconds = time.monotonic() - self.started
        return (f"{self.total - self.left} of {self.total} in {seconds:.1f} s: {d['ready']} READY, {d['failed']} FAILED, {d['error']} left REGISTERED "
                f"(source error), {d['skipped']} settled by a first use or changed")


class BackgroundValidator:
    """Validates the store's REGISTERED adapters after start (see the module's text)."""

    def __init__(self, store, registry: Registry, threads: int, bytes_per_s: int = 0):
        """store: the AdapterStore (validate_in_background, busy); threads: at most this many
        validations at once (0: off); bytes_per_s: cap on the bytes read a second (0: none)."""
        self._store, self._registry = store, registry
        self._threads, self._rate = threads, bytes_per_s
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None
        self._next_at = 0.0          # the rate cap: when the next read may start
        self.progress = Progress()

    def start(self) -> None:
        """Begin (on the running loop) START_DELAY_S from now; nothing when off."""
        if self._threads <= 0:
            log.info("background validation off (--background-validate-threads 0): adapters "
                     "are validated on first use")
            return
        self._executor = ThreadPoolExecutor(self._threads, initializer=_lower_priority,
                                            thread_name_prefix="store-background")
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """End it (the drain): no new validation starts; one under way finishes in its thread
        (a first use waiting for it still gets it)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            log.info("background validation stopped: %s", self.progress.line())
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self) -> None:
        await asyncio.sleep(START_DELAY_S)
        ids = self._registry.ids_in_state(REGISTERED)
        self.progress = Progress(total=len(ids))
        metrics.BACKGROUND_LEFT.set(len(ids))
        if not ids:
            log.info("background validation: no REGISTERED adapter to validate")
            return
        log.info("background validation: %d REGISTERED adapters, %d at a time%s", len(ids),
                 self._threads, f", at most {self._rate} bytes/s" if self._rate else "")
        todo = iter(ids)
        ticker = asyncio.ensure_future(self._report())
        try:
            await asyncio.gather(*(self._worker(todo) for _ in range(self._threads)))
        finally:
            ticker.cancel()
        log.info("background validation finished: %s", self.progress.line())

    async def _worker(self, todo) -> None:
        for adapter_id in todo:         # one iterator shared: each id goes to one worker
            await self._yield()
            await self._pace(adapter_id)
            self.progress.count(await self._one(adapter_id))

    async def _one(self, adapter_id: str) -> str:
        """Validate one adapter; its outcome."""
        try:
            settled = await self._store.validate_in_background(adapter_id, self._executor)
        except LorafleetError as exc:       # e.g. the source unreachable: still REGISTERED
            log.warning("background validation of %r: %s (left REGISTERED; validated on first "
                        "use)", adapter_id, exc.message)
            return "error"
        except Exception:                   # a bug: logged, and the walk goes on
            log.exception("background validation of %r failed (left REGISTERED)", adapter_id)
            return "error"
        if settled is None or settled.state not in (READY, FAILED):
            return "skipped"
        return "ready" if settled.state == READY else "failed"

    async def _yield(self) -> None:
        """Wait while a request's work is under way in the store, YIELD_MAX_S at most."""
        end = time.monotonic() + YIELD_MAX_S
        while self._store.busy() > 0 and time.monotonic() < end:
            await asyncio.sleep(YIELD_POLL_S)

    async def _pace(self, adapter_id: str) -> None:
        """Keep the reads under the bytes-a-second cap (the record's size, from the scan)."""
        if not self._rate:
            return
        record = self._registry.get(adapter_id)
        size = record.bytes if record is not None and record.state == REGISTERED else 0
        now = time.monotonic()
        start = max(now, self._next_at)
        self._next_at = start + size / self._rate
        if start > now:
            await asyncio.sleep(start - now)

    async def _report(self) -> None:
        """A progress line every PROGRESS_EVERY adapters or PROGRESS_S seconds."""
        shown = 0
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.5)
            done = self.progress.total - self.progress.left
            if done - shown >= PROGRESS_EVERY or time.monotonic() - last >= PROGRESS_S:
                shown, last = done, time.monotonic()
                log.info("background validation: %s", self.progress.line())


def _lower_priority() -> None:
    """Run this (background) thread at a lower CPU priority: Linux nices threads one by one
    (and a thread's default I/O priority follows its nice value)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + NICE))
    except (AttributeError, OSError):
        pass
