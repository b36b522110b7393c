"""The threads that read and validate adapters (Register's, and first uses': one pool each),
apart from the event loop and from the default executor (which Fetch's source reads use).

A registration's work is bounded (regular files only, sizes capped, reads checked against the
caller's deadline, target_modules regexes of bounded cost), but a thread is never taken back
from a read that the disk is slow to finish. So at most `threads` run at once, and one owner
(tenant; "" for shared adapters) holds at most `per_owner` of them: past its share, a call
either is refused RESOURCE_EXHAUSTED with a retry delay (Register) or waits its turn among
that owner's calls, first come first served (`wait`: first uses, which a request waits for),
while the other owners' calls keep their threads. A slot is given back when its thread ends,
not when its caller stops waiting.

The work is hashing and numpy checks of large buffers, which let go of the GIL: threads run in
parallel, so the pool is sized to the machine (default_threads), not a small fixed number.
"""
from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
import os
from concurrent.futures import ThreadPoolExecutor

from services.common.errors import ResourceExhausted

RETRY_S = 1.0
MAX_THREADS = 64


def default_threads(cpus: int) -> int:
    """Two threads a CPU (a read waits on the disk now and then), 4 to MAX_THREADS."""
    return max(4, min(MAX_THREADS, 2 * cpus))


def machine_cpus() -> int:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class ValidationPool:
    def __init__(self, threads: int = 8, per_owner: int | None = None,
                 name: str = "store-validate"):
        """threads: at most this many run at once; per_owner: of them, one owner's (None:
        half of them)."""
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self.threads = threads
        self.per_owner = min(threads, per_owner or max(1, threads // 2))
        self._busy: collections.Counter = collections.Counter()
        self._waiting: dict[str, collections.deque] = {}

    def busy(self, owner: str) -> int:
        return self._busy[owner]

    def in_use(self) -> int:
        """Registrations being read and validated now, every owner's."""
        return sum(self._busy.values())

    async def run(self, owner: str, fn, *args, wait: bool = False):
        """fn(*args) on a pool thread, counted against owner's share; past the share, refused
        RESOURCE_EXHAUSTED, or (wait) after that owner's earlier calls."""
        if self._busy[owner] >= self.per_owner:
            if not wait:
                raise ResourceExhausted(
                    f"register: {self._busy[owner]} registrations of tenant {owner!r} are "
                    f"being read and validated already (at most {self.per_owner} at once); "
                    "retry when one ends", retry_after=RETRY_S)
            await self._turn(owner)             # the slot is handed over by _release
        else:
            self._busy[owner] += 1
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()     # the caller's trace context, as to_thread
        job = self._executor.submit(context.run, functools.partial(fn, *args))
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release, owner))
        return await asyncio.wrap_future(job)

    def waiting(self, owner: str) -> int:
        """Calls of owner waiting for its share."""
        return len(self._waiting.get(owner, ()))

    async def _turn(self, owner: str) -> None:
        turn = asyncio.get_running_loop().create_future()
        queue = self._waiting.setdefault(owner, collections.deque())
        queue.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release(owner)            # handed a slot just as it left: pass it on
            elif turn in queue:
                queue.remove(turn)
            raise
        finally:
            if not queue:
                self._waiting.pop(owner, None)

    def _release(self, owner: str) -> None:
        queue = self._waiting.get(owner)
        while queue:
            turn = queue.popleft()
            if not turn.done():
                turn.set_result(None)           # the slot goes to the owner's next call
                return
        self._busy[owner] -= 1
        if self._busy[owner] <= 0:
            del self._busy[owner]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
