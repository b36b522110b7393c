"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step.

Why: a decode step is ~14 short kernels a layer, and inside a CUDA graph each still pays a gap
between the end of one kernel and the start of the next (launch, ramp-up; ~1-3 us on the H200).
With PDL (Hopper and later) a kernel is launched while its predecessor in the stream is still
running; its programs start, then wait at `griddepcontrol.wait` until the predecessor has
finished and its writes are visible. The launch and ramp-up overlap the predecessor's tail.

The contract each kernel launched with `launch_pdl=True` keeps (see `wait_then_release`):
- it calls `gdc_wait` in every program before it writes anything, and before it reads
  anything that the kernel just before it may write. Every program calls it, even one with no
  work, so the kernel cannot finish before its predecessor has: "kernel N finished" then still
  implies "every kernel before N finished", as without PDL. So when kernel N starts, kernel
  N-2 and all before it have finished; what they wrote, and what was written before the step
  (the step's tables, positions, slot map; norm weights, rope tables, adapter weights), may be
  read before the wait. The SGMV, norm, rope and attention kernels read those early;
- right after the wait it lets its own dependents launch (`gdc_launch_dependents`). They can
  only be past their own wait once this kernel has finished, so at most two kernels of a stream
  are ever in flight.
Kernels that are not ours (cuBLAS, torch) launch normally and wait for full completion of
whatever precedes them.

`enabled(device)`: PDL on sm_90+ CUDA devices, with a Triton that has gdc_wait, unless turned
off (`set_enabled(False)`: the engine's build sets its PerfConfig.pdl, LORAFLEET_PDL=0 for a
worker). The flag is read at each launch; a captured CUDA graph keeps what it was captured
with.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

_ON = True


def set_enabled(on: bool) -> None:
    """Turn PDL on or off for later launches (the engine's build sets its PerfConfig.pdl; on
    by default)."""
    global _ON
    _ON = bool(on)


@contextlib.contextmanager
def disabled():
    """Launches inside the block go without PDL; the setting before it comes back after."""
    global _ON
    was, _ON = _ON, False
    try:
        yield
    finally:
        _ON = was


def _interpreting() -> bool:
    """Triton runs kernels in its interpreter (TRITON_INTERPRET=1, as Triton itself reads)."""
    from triton import knobs
    return bool(knobs.runtime.interpret)


@functools.lru_cache(maxsize=None)
def _capable(device_index: int) -> bool:
    if _interpreting():
        return False
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL now."""
    if not _ON or device.type != "cuda":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_args(device: torch.device, wanted: bool = True) -> dict:
    """Keyword arguments for a kernel launch: the USE_PDL constexpr and Triton's launch_pdl
    (on when `wanted` and enabled on this device)."""
    on = wanted and enabled(device)
    return {"USE_PDL": on, "launch_pdl": on}


# SGMV calls launch with PDL up to this many rows: it pays at decode sizes and costs on
# prefill-sized calls (bench/PERF_NOTES.md, "Why the defaults").
SGMV_MAX_ROWS = 256


@triton.jit
def wait_then_release(USE_PDL: tl.constexpr):
    """At the top of every program of a PDL kernel: wait for the predecessor kernel to finish
    (its writes are then visible), then let the next kernel launch. A no-op without PDL."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
