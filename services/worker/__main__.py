"""python -m services.worker: serve one base model and its adapters on one device."""
from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import uuid

import torch

from kernels import compile_watch, kernel_cache
from services.common.gen.lorafleet.v1 import worker_pb2 as wpb, worker_pb2_grpc
from services.common.runtime import run_service
from services.common.server import create_server, serve, server_credentials, sync_channel
from services.worker import metrics
from services.worker.adapter_manager import AdapterManager
from services.worker.config import WorkerConfig, parse_args
from services.worker.engine_link import EngineLink
from services.worker.factory import EngineOptions, build_engine
from services.worker.host_tier import HostTier
from services.worker.link import BlockingEnd
from services.worker.model_spec import load_spec
from services.worker.residency import ResidencyFeed
from services.worker.servicer import WorkerServicer
from services.worker.warmup import Warmup
from services.worker.store_client import StoreClient

log = logging.getLogger("lorafleet.worker")
ROOT = pathlib.Path(__file__).resolve().parents[2]
# How long the engine thread may hold the GIL while another thread waits for it (CPython's
# default is 5 ms). A cold load's placement is ~10 device calls on a loader thread, each a GIL
# wait behind the engine thread: at 5 ms each, a 0.6 ms copy took 5 ms p50 under decode load.
GIL_SWITCH_S = 0.0005


def engine_options(cfg: WorkerConfig) -> EngineOptions:
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return EngineOptions(device=device, dtype=cfg.dtype, kv_cache_bytes=cfg.kv_cache_bytes,
                         block_size=cfg.block_size, max_batch_tokens=cfg.max_batch_tokens,
                         max_running=cfg.max_running, pool_bytes=cfg.gpu_pool_bytes,
                         pool_slots=cfg.pool_slots, max_model_len=cfg.max_model_len,
                         perf=cfg.perf)


def load_fn(engine):
    def load() -> wpb.WorkerLoad:
        running, waiting, kv = engine.load
        metrics.RUNNING.set(running)
        metrics.WAITING.set(waiting)
        metrics.KV_USED.set(kv)
        return wpb.WorkerLoad(running=running, waiting=waiting, kv_used_fraction=kv)
    return load


async def main_async(cfg: WorkerConfig) -> int:
    worker_id = cfg.worker_id or f"worker-{uuid.uuid4().hex[:8]}"
    sys.setswitchinterval(GIL_SWITCH_S)
    if cfg.kernel_cache:
        cached = kernel_cache.use(cfg.kernel_cache)
        log.info("kernel cache %s: %d kernels cached", cfg.kernel_cache, cached)
    compile_watch.install(lambda kernel: metrics.count_compile(kernel, log))
    if engine_options(cfg).device == "cpu" and cfg.cpu_threads > 0:
        torch.set_num_threads(cfg.cpu_threads)
    opts = engine_options(cfg)
    # the host tier is page-locked (seconds for GiBs) while the model loads
    built, host = await asyncio.gather(
        asyncio.to_thread(build_engine, cfg.model, opts),
        asyncio.to_thread(HostTier, cfg.host_pool_bytes, cfg.tenant_share or None,
                          opts.device.startswith("cuda"), load_spec(cfg.model)))
    store = StoreClient(sync_channel(cfg.store, cfg.tls_ca, cfg.tls_cert, cfg.tls_key),
                        shm_dir=cfg.store_shm_dir or None)
    await asyncio.to_thread(built.pool.warm_up)
    if cfg.warmup == "on" or (cfg.warmup == "auto" and built.device.type == "cuda"):
        warm = Warmup(built.engine, built.pool, built.spec, cfg.max_batch_tokens,
                      max_rank=cfg.warmup_max_rank, max_running=cfg.max_running)
        report = await asyncio.to_thread(warm.run)
        log.info("warm-up: %d steps, %d sequences in %.1fs; %d kernel specializations so far",
                 report.steps, report.sequences, report.seconds,
                 metrics.compiles("start"))
    manager = AdapterManager(built.pool, built.spec, host, store,
                             tenant_share=cfg.tenant_share or None,
                             loader_threads=cfg.loader_threads)
    base_load = load_fn(built.engine)
    def load():
        out = base_load()
        out.gpu_pool_free_bytes = built.pool.free_bytes
        out.gpu_pool_total_bytes = built.pool.capacity_bytes
        out.host_free_bytes = manager.host.free_bytes
        out.draining = servicer.draining
        return out
    feed = ResidencyFeed(manager, load, worker_id)
    manager.on_change = feed.mark
    feed.bind(asyncio.get_running_loop())
    servicer = WorkerServicer(cfg, built, manager, feed, worker_id)
    stop = threading.Event()
    thread = threading.Thread(target=built.engine.run, args=(stop,), name="engine", daemon=True)
    thread.start()
    loop = asyncio.get_running_loop()
    front = Front(cfg, servicer, loop) if cfg.frontend == "process" else None
    server, port, health = create_server(
        front.core_address if front else cfg.listen,
        lambda s: (worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s),
                   ["lorafleet.v1.Worker"])[1],
        None if front else server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_ca))
    ticker = loop.create_task(feed.tick())
    stopped = asyncio.Event()

    async def started():
        nonlocal port
        if front is not None:
            port = await front.start(stopped)
        metrics.Phase.name = "serving"
        log.info("worker %s serving %s on port %d (device %s)", worker_id, built.spec.name,
                 port, built.device)

    def drain():
        servicer.draining = True
        feed.publish_load()         # routers see draining at once
        feed.close()
        if front is not None:
            front.link.drain()
    try:
        await serve(server, health, cfg.grace, on_drain=drain, name="worker", started=started,
                    stop=stopped)
    except FrontendFailed as exc:
        log.error("%s", exc)
        await server.stop(0)
        return 1
    finally:
        ticker.cancel()
        if front is not None:
            await front.close(cfg.grace + 5)
        manager.close()
        stop.set()
        built.engine.wake()
        thread.join(5)
    return 1 if front is not None and front.failed else 0


class FrontendFailed(RuntimeError):
    """The front end process could not start (its own error is in the log above)."""


class Front:
    """The worker's front end process (services.worker.frontend) and the link to it: it binds
    the public port; this process serves it on a private socket and runs the engine."""

    def __init__(self, cfg: WorkerConfig, servicer: WorkerServicer,
                 loop: asyncio.AbstractEventLoop):
        self.cfg, self.servicer, self.loop = cfg, servicer, loop
        self._dir = tempfile.mkdtemp(prefix="lorafleet-worker-")
        self.core_address = f"unix:{self._dir}/core.sock"
        self.proc: subprocess.Popen | None = None
        self.link: EngineLink | None = None
        self.failed = False

    async def start(self, stopped: asyncio.Event) -> int:
        """Start the front end; returns the public port once it is bound. When it exits
        before the worker drains, `stopped` is set (the worker stops too, exit 1)."""
        ours, theirs = socket.socketpair()
        cfg = self.cfg
        argv = [sys.executable, "-m", "services.worker.frontend", "--listen", cfg.listen,
                "--core", self.core_address, "--link-fd", str(theirs.fileno()),
                "--grace", str(cfg.grace), "--log-level", cfg.log_level]
        for flag, value in (("--tls-cert", cfg.tls_cert), ("--tls-key", cfg.tls_key),
                            ("--tls-ca", cfg.tls_ca)):
            if value:
                argv += [flag, value]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self.link = EngineLink(BlockingEnd(ours), self.servicer, self.loop)
        self.link.start()
        port = await self.link.front_port
        if port is None:
            raise FrontendFailed(f"the front end could not serve {cfg.listen} (exit "
                                 f"{self.proc.wait()})")

        async def watch():
            await self.link.closed.wait()
            if not self.servicer.draining:
                log.error("the front end exited (%s): stopping", self.proc.poll())
                self.failed = True
                stopped.set()
        self._watch = self.loop.create_task(watch())
        return port

    async def close(self, timeout: float) -> None:
        """After the drain: wait for the front end's bye (its calls done), then end it."""
        if self.link is not None:
            try:
                await asyncio.wait_for(self.link.closed.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("the front end did not finish its drain in %.0fs", timeout)
            self.link.close()
        if self.proc is not None:
            try:
                await asyncio.to_thread(self.proc.wait, 5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    return run_service("worker", lambda: parse_args(argv), main_async)


if __name__ == "__main__":
    sys.exit(main())
