"""The threads Register's read and validation run on, apart from the event loop and from the
default executor (which Fetch's source reads use).

A registration's work is bounded (regular files only, sizes capped, reads checked against the
caller's deadline, target_modules regexes of bounded cost), but a thread is never taken back
from a read that the disk is slow to finish. So at most `threads` run at once, and one owner
(tenant; "" for shared adapters) holds at most `per_owner` of them: a tenant whose adapters
are slow to read is refused RESOURCE_EXHAUSTED (with a retry delay) past its share, and the
other tenants' registrations keep their threads. A slot is given back when its thread ends,
not when its caller stops waiting.
"""
from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
from concurrent.futures import ThreadPoolExecutor

from services.common.errors import ResourceExhausted

RETRY_S = 1.0


class ValidationPool:
    def __init__(self, threads: int = 8, per_owner: int | None = None):
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="store-validate")
        self.threads = threads
        self.per_owner = per_owner or max(1, threads // 2)
        self._busy: collections.Counter = collections.Counter()

    def busy(self, owner: str) -> int:
        return self._busy[owner]

    def in_use(self) -> int:
        """Registrations being read and validated now, every owner's."""
        return sum(self._busy.values())

    async def run(self, owner: str, fn, *args):
        """fn(*args) on a pool thread, counted against owner's share."""
        if self._busy[owner] >= self.per_owner:
            raise ResourceExhausted(
                f"register: {self._busy[owner]} registrations of tenant {owner!r} are being "
                f"read and validated already (at most {self.per_owner} at once); retry when "
                "one ends", retry_after=RETRY_S)
        loop = asyncio.get_running_loop()
        self._busy[owner] += 1
        context = contextvars.copy_context()     # the caller's trace context, as to_thread
        job = self._executor.submit(context.run, functools.partial(fn, *args))
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release, owner))
        return await asyncio.wrap_future(job)

    def _release(self, owner: str) -> None:
        self._busy[owner] -= 1
        if self._busy[owner] <= 0:
            del self._busy[owner]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
