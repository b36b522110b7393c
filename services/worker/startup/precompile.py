"""Fill a cold kernel cache in parallel while the worker loads its weights (GPU only).

On a kernel cache that has not seen this build, the graph captures and the warm-up
(services.worker.startup.warmup) compile their Triton specializations one after another in the
worker, each a second or so of single-threaded compiling. `--precompile-procs N` starts N child
processes at the worker's start, each with a one-layer model of the served shapes (the
checkpoint's first layer, 1/L of the KV cache, so the same number of blocks), and each runs a
share of the graphs' warm-up forwards (without capturing) and of the warm-up's adapter sets.
What they compile lands in the shared kernel cache; the worker waits for them before its own
captures and warm-up, which then load each kernel from the cache.

A child that fails or runs past its time costs only time: the worker compiles what is missing
itself. A finished warm-up leaves a fingerprint file in the cache (this build's kernel and
warm-up sources, the versions, the model's config and the shapes the flags set); a start that
finds its own fingerprint there starts no children.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import multiprocessing
import pathlib
import time

log = logging.getLogger(__name__)
ROOT = pathlib.Path(__file__).resolve().parents[3]
MARKER = "lorafleet-warm.json"
SOURCES = ("kernels", "services/worker")        # what compiles, and what picks the shapes


@dataclasses.dataclass(frozen=True)
class WarmShape:
    """What the warm-up prepares for (the worker's flags)."""
    max_batch_tokens: int
    max_rank: int
    max_running: int
    prefill_with_decode: int


def fingerprint(model_dir: str, opts, warm: WarmShape) -> str:
    """A digest of what decides the kernels a warm start needs."""
    import torch
    import triton
    h = hashlib.sha256()
    for d in SOURCES:
        for f in sorted((ROOT / d).rglob("*.py")):
            h.update(f.relative_to(ROOT).as_posix().encode())
            h.update(f.read_bytes())
    h.update((pathlib.Path(model_dir) / "config.json").read_bytes())
    h.update(json.dumps([torch.__version__, triton.__version__, repr(opts),
                         dataclasses.asdict(warm)], default=str).encode())
    return h.hexdigest()


def cache_dir() -> pathlib.Path:
    from triton import knobs
    return pathlib.Path(knobs.cache.dir)


def is_warm(digest: str) -> bool:
    try:
        return json.loads((cache_dir() / MARKER).read_text()).get("fingerprint") == digest
    except (OSError, ValueError):
        return False


def mark_warm(digest: str) -> None:
    """After a warm-up that completed: the next start with this fingerprint needs no children."""
    path = cache_dir() / MARKER
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"fingerprint": digest, "at": time.time()}))
        tmp.replace(path)
    except OSError as e:
        log.warning("precompile: cannot write %s (%s): the next start compiles as if cold",
                    path, e)


class Children:
    """The child processes of one start."""

    def __init__(self, model_dir: str, opts, warm: WarmShape, procs: int):
        from kernels import kernel_cache
        ctx = multiprocessing.get_context("spawn")       # CUDA does not survive a fork
        self.started = time.monotonic()
        self.cached_before = kernel_cache.count(cache_dir())
        self.compiled = 0                                # kernels the children added
        self.procs = [ctx.Process(target=child, name=f"precompile-{i}", daemon=True,
                                  args=(model_dir, opts, warm, i, procs, str(cache_dir())))
                      for i in range(procs)]
        for p in self.procs:
            p.start()
        log.info("precompile: %d child processes compiling into %s", procs, cache_dir())

    def wait(self, timeout_s: float) -> int:
        """Until every child has ended (those past timeout_s are stopped), with their outcome
        in the log; how many finished their share."""
        deadline, ok = self.started + timeout_s, 0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(5)
                log.warning("precompile: %s stopped after %.0fs; the worker compiles what it "
                            "left", p.name, timeout_s)
            elif p.exitcode:
                log.warning("precompile: %s failed (exit %s); the worker compiles what it left",
                            p.name, p.exitcode)
            else:
                ok += 1
        from kernels import kernel_cache
        after = kernel_cache.count(cache_dir())
        self.compiled = after - self.cached_before
        log.info("precompile: %d of %d children done in %.1fs; they compiled %d kernels (the "
                 "cache held %d before)", ok, len(self.procs), time.monotonic() - self.started,
                 self.compiled, self.cached_before)
        return ok


def child_options(opts, layers: int):
    """The engine options of a one-layer child: the same KV blocks (1/L of the bytes), no
    graphs (it runs their forwards, not captures), an adapter pool for the warm-up's."""
    return dataclasses.replace(opts, kv_cache_bytes=max(1, opts.kv_cache_bytes // layers),
                               pool_bytes=min(opts.pool_bytes, 512 << 20), cuda_graphs=False,
                               fault_inject_after_steps=0)


def child(model_dir: str, opts, warm: WarmShape, part: int, parts: int, cache: str) -> None:
    """One child: its share of the graphs' forwards and of the warm-up's adapter sets."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s precompile {part + 1}/{parts} %(message)s")
    from kernels import kernel_cache
    from services.worker.model.spec import load_spec
    from services.worker.startup.factory import build_engine
    from services.worker.startup.warmup import Warmup
    kernel_cache.use(cache)
    start = time.monotonic()
    layers = load_spec(model_dir).num_layers
    built = build_engine(model_dir, child_options(opts, layers), layers=1)
    if built.device.type == "cuda":
        from services.worker.executor.graph_runner import GraphRunner
        graphs = GraphRunner(built.engine.runner, mixed_tokens=opts.graph_mixed_tokens)
        n = graphs.warm_forwards(opts.graph_max_rank, part, parts)
        log.info("%d graph shapes' forwards in %.1fs", n, time.monotonic() - start)
    report = Warmup(built.engine, built.pool, built.spec, warm.max_batch_tokens,
                    max_rank=warm.max_rank, max_running=warm.max_running,
                    prefill_with_decode=warm.prefill_with_decode, part=part, parts=parts).run()
    log.info("warm-up share: %d steps; done in %.1fs", report.steps, time.monotonic() - start)
    from services.common.runtime import exit_process
    exit_process(0)         # past the module teardown where nanobind reports Triton's objects
