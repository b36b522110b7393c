"""A test hook (--fault-inject-after-steps N): a runner whose forward passes raise after N.

It stands for a device that fails mid-serving (a CUDA error leaves the context unusable, and
every later kernel launch fails too), so the worker's fatal path - fail every request, go
NOT_SERVING, drain, exit 1 - can be exercised through the real services on a CPU. Every
forward pass counts (run or launch; warm-up steps included); once N have run, each further
one raises. Off (not built) unless the flag is given."""
from __future__ import annotations


class InjectedFault(RuntimeError):
    """The error an injected fault raises."""


class FaultyRunner:
    """Wraps a ModelRunner or GraphRunner: the same calls (a Runner of
    services.worker.engine.loop), failing after `after` passes. A launch that starts nothing
    (the step runs eagerly instead) is no pass."""

    def __init__(self, inner, after: int):
        self._inner, self._after, self.passes = inner, after, 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _check(self) -> None:
        if self.passes >= self._after:
            raise InjectedFault(f"injected fault: forward pass {self.passes + 1} after "
                                f"{self._after} (--fault-inject-after-steps)")

    def run(self, batch):
        self._check()
        self.passes += 1
        return self._inner.run(batch)

    def launch(self, batch, prev=None):
        self._check()
        pending = self._inner.launch(batch, prev=prev)
        self.passes += pending is not None
        return pending

    def collect(self, pending):
        return self._inner.collect(pending)
