"""A shorter GIL switch interval while a cold load is in flight.

The worker's engine thread holds the GIL for most of each step's host work, and a thread that
wants it waits the switch interval (services.worker.__main__.GIL_SWITCH_S) before the engine
must drop it. A cold load meets that wait at every hop: a loader thread starting its job, each
device call of the placement (each gives the GIL up and takes it back; on a loader thread, or
on the event loop for a load from the host tier), and the event loop resuming once a loader's
job is done. While any load is in flight the interval is FAST_SWITCH_S;
the last one to finish puts the process's interval back.
"""
from __future__ import annotations

import contextlib
import sys
import threading

FAST_SWITCH_S = 5e-5

_lock = threading.Lock()
_depth = 0
_saved = 0.0


def enter() -> None:
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_saved, FAST_SWITCH_S))
        _depth += 1


def leave() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth == 0:
            sys.setswitchinterval(_saved)


@contextlib.contextmanager
def first():
    """The short interval for the duration (nested and concurrent uses count)."""
    enter()
    try:
        yield
    finally:
        leave()
