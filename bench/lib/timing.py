"""GPU timing shared by the kernel and engine benches: calls captured in one CUDA graph, their
median replay time (triton's do_bench, L2 flushed; wall clock on a CPU), and the device's copy
bandwidth, the floor's yardstick."""
from __future__ import annotations

import statistics
import time

import torch


def capture_graph(fns):
    """The calls captured back to back in one CUDA graph (after a run on a side stream, as
    torch asks before a capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    return graph


def time_us(fn, device, warmup_ms, rep_ms):
    """Median µs per call: CUDA-graph replays under do_bench (L2 flushed) on GPU, wall clock on
    CPU.

    fn may be a list of calls: they are captured back to back in one graph and the replay time is
    divided by their number ("chain": how kernels run inside the engine's decode graph, where one
    graph launch serves hundreds of kernels). One call alone per graph includes the fixed cost of
    a graph launch (header graph_floor_us)."""
    fns = fn if isinstance(fn, list) else [fn]
    for f in fns:
        f()
    if device.type != "cuda":
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for f in fns:
                f()
            times.append((time.perf_counter() - t0) * 1e6 / len(fns))
        return statistics.median(times)
    import triton
    graph = capture_graph(fns)
    ms = triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    del graph
    return ms * 1e3 / len(fns)


def copy_tbps(device, gib, warmup_ms, rep_ms):
    """Device-to-device copy bandwidth, bytes read + written per second, in TB/s. Timed eagerly:
    inside a CUDA graph a plain copy becomes a copy-engine node, far slower than the SMs' copy."""
    n = int(gib * 2 ** 30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        import triton
        us = triton.testing.do_bench(lambda: dst.copy_(src), warmup=warmup_ms, rep=rep_ms,
                                     return_mode="median") * 1e3
    else:
        us = time_us(lambda: dst.copy_(src), device, warmup_ms, rep_ms)
    del src, dst
    return 2 * n / (us * 1e-6) / 1e12


def timed(fn) -> float:
    """µs per call of fn: one CUDA graph of 10 calls, median replay under do_bench / 10."""
    import triton
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    return triton.testing.do_bench(graph.replay, return_mode="median") * 1e3 / 10
