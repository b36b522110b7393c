"""The worker assembled (`python -m services.worker` runs `main`): the engine and its warm-up
(services.worker.startup), the adapter tiers (services.worker.adapters), the servicer, the
residency feed and the front end (services.worker.api), the engine thread, and the serving until a
drain."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib
import sys
import threading
import uuid
from dataclasses import dataclass

import torch

from prometheus_client import REGISTRY

from kernels import compile_watch, kernel_cache
from services.common.config import ServiceFlags
from services.common.gen.lorafleet.v1 import worker_pb2 as wpb, worker_pb2_grpc
from services.common.runtime import freeze_startup_objects, run_service
from services.common.server import create_server, serve, server_credentials, sync_channel
from services.common.service_auth import describe, read_token
from services.common.tenant_labels import TenantLabels
from services.worker import metrics
from services.worker.adapters.host_tier import HostTier
from services.worker.adapters.manager import AdapterManager
from services.worker.adapters.store_client import StoreClient
from services.worker.api.chat_template import ChatTemplate
from services.worker.api.frontend_process import Front, FrontendFailed
from services.worker.api.grammar import compiler_for
from services.worker.api.residency_feed import ResidencyFeed
from services.worker.api.servicer import WorkerServicer
from services.worker.config import EngineOptions, WorkerConfig, parse_args
from services.worker.engine.gauges import EngineGauges
from services.worker.engine.step_profile import StepProfile
from services.worker.model.spec import load_spec
from services.worker.startup import precompile
from services.worker.startup.factory import Built, build_engine, resolve_device
from services.worker.startup.precompile import WarmShape
from services.worker.startup.warmup import Warmup

log = logging.getLogger("lorafleet.worker")
ROOT = pathlib.Path(__file__).resolve().parents[2]
# How long the engine thread may hold the GIL while another thread waits for it (CPython's
# default is 5 ms; at 5 ms a cold load's 0.6 ms copy took 5 ms p50 under decode load). While a
# cold load is in flight the interval is shorter still (services.worker.adapters.gil).
GIL_SWITCH_S = 0.0005
PRECOMPILE_TIMEOUT_S = 900.0        # precompile's children are stopped after this


def engine_options(cfg: WorkerConfig) -> EngineOptions:
    """The config's engine options on this machine's device (--device auto resolved), as the
    engine, the precompile children and their fingerprint get them."""
    return dataclasses.replace(cfg.engine, device=resolve_device(cfg.engine.device))


def load_fn(engine):
    def load() -> wpb.WorkerLoad:
        running, waiting, kv = engine.load
        metrics.RUNNING.set(running)
        metrics.WAITING.set(waiting)
        metrics.KV_USED.set(kv)
        return wpb.WorkerLoad(running=running, waiting=waiting, kv_used_fraction=kv)
    return load


def setup_process(cfg: WorkerConfig) -> None:
    """Process-wide settings, before anything is built: the GIL switch interval, the kernel
    cache, the compile watch, torch's CPU threads."""
    sys.setswitchinterval(GIL_SWITCH_S)
    if cfg.kernel_cache:
        cached = kernel_cache.use(cfg.kernel_cache)
        log.info("kernel cache %s: %d kernels cached", cfg.kernel_cache, cached)
    compile_watch.install(lambda kernel: metrics.count_compile(kernel, log))
    if engine_options(cfg).device == "cpu" and cfg.cpu_threads > 0:
        torch.set_num_threads(cfg.cpu_threads)


@dataclass
class Core:
    """What the core process serves from: the engine, the adapter tiers, the residency feed and
    the servicer over them."""
    built: Built
    manager: AdapterManager
    feed: ResidencyFeed
    servicer: WorkerServicer


async def build_core(cfg: WorkerConfig, worker_id: str) -> Core:
    """Load the model (the host tier is page-locked meanwhile), warm the pool and the kernels,
    and wire the adapter manager, the residency feed and the servicer."""
    opts = engine_options(cfg)
    warm_up = cfg.warmup == "on" or (cfg.warmup == "auto" and opts.device.startswith("cuda"))
    shape = WarmShape(opts.max_batch_tokens, cfg.warmup_max_rank, opts.max_running,
                      opts.max_prefill_with_decode)
    cuda = opts.device.startswith("cuda")
    digest = precompile.fingerprint(cfg.model, opts, shape) if warm_up and cuda else ""
    wait = None
    if digest and cfg.precompile_procs:
        if precompile.is_warm(digest):
            log.info("precompile: the kernel cache has this build's warm-up: no children")
        else:
            children = precompile.Children(cfg.model, opts, shape, cfg.precompile_procs)
            wait = lambda: children.wait(PRECOMPILE_TIMEOUT_S)   # noqa: E731
    built, host = await asyncio.gather(
        asyncio.to_thread(build_engine, cfg.model, opts, None, wait),
        asyncio.to_thread(HostTier, cfg.host_pool_bytes, cfg.tenant_share or None,
                          opts.device.startswith("cuda"), load_spec(cfg.model)))
    common = cfg.common
    store = StoreClient(sync_channel(cfg.store, common.tls_ca, common.tls_cert, common.tls_key,
                                     keepalive_s=common.keepalive_s,
                                     service_token=read_token(common.service_token_file)),
                        shm_dir=cfg.store_shm_dir or None)
    await asyncio.to_thread(built.pool.warm_up)
    if warm_up:
        warm = Warmup(built.engine, built.pool, built.spec, shape.max_batch_tokens,
                      max_rank=shape.max_rank, max_running=shape.max_running,
                      prefill_with_decode=shape.prefill_with_decode)
        report = await asyncio.to_thread(warm.run)
        log.info("warm-up: %d steps, %d sequences in %.1fs; %d kernel specializations so far",
                 report.steps, report.sequences, report.seconds, metrics.compiles("start"))
        if digest:
            precompile.mark_warm(digest)
    manager = AdapterManager(built.pool, built.spec, host, store,
                             tenant_share=cfg.tenant_share or None,
                             loader_threads=cfg.loader_threads, eviction=cfg.eviction,
                             host_placement=cfg.host_placement,
                             evictions=metrics.Evictions(TenantLabels(cfg.metrics_tenants)))
    gauges, steps = EngineGauges(built.spec.name, cfg.engine.pool_slots), StepProfile()
    REGISTRY.register(gauges)
    REGISTRY.register(steps)
    built.engine.on_step = on_step(gauges, steps)
    base_load = load_fn(built.engine)

    def load() -> wpb.WorkerLoad:
        out = base_load()
        out.gpu_pool_free_bytes = built.pool.free_bytes
        out.gpu_pool_total_bytes = built.pool.capacity_bytes
        out.host_free_bytes = manager.host.free_bytes
        out.draining = servicer.draining
        return out
    feed = ResidencyFeed(manager, load, worker_id)
    manager.on_change = feed.mark
    feed.bind(asyncio.get_running_loop())
    servicer = await make_servicer(cfg, built, manager, feed, worker_id, steps)
    return Core(built, manager, feed, servicer)


def on_step(gauges: EngineGauges, steps: StepProfile):
    """The engine's per-step hook (Engine.on_step): the gauges, then the step profile."""
    def hook(engine) -> None:
        gauges.step(engine)
        steps.step(engine)
    return hook


async def make_servicer(cfg: WorkerConfig, built: Built, manager: AdapterManager,
                        feed: ResidencyFeed, worker_id: str,
                        steps: StepProfile | None = None) -> WorkerServicer:
    """The servicer with what renders and constrains requests beside it: the checkpoint's chat
    template and structured output's grammar compiler for its tokenizer (None: off); steps: the
    engine's step profile, for Info."""
    chat = ChatTemplate.from_model_dir(cfg.model)
    log.info("chat template: %s", "the checkpoint's" if chat else
             "none (chats are rendered as 'role: content' lines)")
    grammars = await asyncio.to_thread(
        compiler_for, (pathlib.Path(cfg.model) / "tokenizer.json").read_text(),
        built.spec.vocab_size, tuple(built.spec.eos_token_ids), cfg.grammar)
    return WorkerServicer(cfg, built, manager, feed, worker_id, chat, grammars, steps)


async def main_async(cfg: WorkerConfig, env: dict[str, str]) -> int:
    """Serve until drained; env: the front end process's environment."""
    worker_id = cfg.worker_id or f"worker-{uuid.uuid4().hex[:8]}"
    setup_process(cfg)
    core = await build_core(cfg, worker_id)
    freeze_startup_objects(log)
    built, servicer, feed = core.built, core.servicer, core.feed
    stop, stopped = threading.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    # a forward pass failed (engine/loop.py): the requests have ended INTERNAL; drain and exit 1
    built.engine.on_fatal = lambda exc: loop.call_soon_threadsafe(stopped.set)
    thread = threading.Thread(target=built.engine.run, args=(stop,), name="engine", daemon=True)
    thread.start()
    front = Front(cfg, servicer, loop, ROOT, env) if cfg.frontend == "process" else None
    server, port, health = _server(cfg.common, servicer, front)
    ticker = loop.create_task(feed.tick())

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
            front.link.drain(fatal=bool(built.engine.failed))
    try:
        await serve(server, health, cfg.common.grace, on_drain=drain, name="worker",
                    started=started, stop=stopped)
    except FrontendFailed as exc:
        log.error("%s", exc)
        await server.stop(0)
        return 1
    finally:
        ticker.cancel()
        if front is not None:
            await front.close(cfg.common.grace + 5)
        core.manager.close()
        stop.set()
        built.engine.wake()
        thread.join(5)
    if built.engine.failed:
        log.error("worker stopped: its engine failed (%s)", built.engine.failed)
        return 1
    return 1 if front is not None and front.failed else 0


def _server(common: ServiceFlags, servicer: WorkerServicer, front: Front | None):
    """The core's gRPC server (not started): on --listen, or with a front end process on the
    private socket it passes calls through (the front end then has the TLS, the token check
    and reflection); (server, port, health)."""
    server = create_server(
        front.core_address if front else common.listen,
        lambda s: (worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s),
                   ["lorafleet.v1.Worker"])[1],
        None if front else server_credentials(common.tls_cert, common.tls_key, common.tls_ca),
        reflection=common.reflection and front is None,
        service_token="" if front else read_token(common.service_token_file))
    describe("worker", read_token(common.service_token_file), common.tls_ca)
    return server


def main(argv: list[str] | None, env: dict[str, str]) -> int:
    """The worker's process: flags (argv; None: sys.argv) to exit status."""
    return run_service("worker", lambda: parse_args(argv),
                       lambda cfg: main_async(cfg, env))
