"""python -m services.worker: serve one base model and its adapters on one device."""
from __future__ import annotations

import asyncio
import logging
import sys
import threading
import uuid

import torch

from services.common.gen.lorafleet.v1 import worker_pb2 as wpb, worker_pb2_grpc
from services.common.runtime import run_service
from services.common.server import create_server, serve, server_credentials, sync_channel
from services.worker import metrics
from services.worker.adapter_manager import AdapterManager
from services.worker.config import WorkerConfig, parse_args
from services.worker.factory import EngineOptions, build_engine
from services.worker.host_tier import HostTier
from services.worker.residency import ResidencyFeed
from services.worker.servicer import WorkerServicer
from services.worker.store_client import StoreClient

log = logging.getLogger("lorafleet.worker")


def engine_options(cfg: WorkerConfig) -> EngineOptions:
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return EngineOptions(device=device, dtype=cfg.dtype, kv_cache_bytes=cfg.kv_cache_bytes,
                         block_size=cfg.block_size, max_batch_tokens=cfg.max_batch_tokens,
                         max_running=cfg.max_running, pool_bytes=cfg.gpu_pool_bytes,
                         pool_slots=cfg.pool_slots, max_model_len=cfg.max_model_len)


def load_fn(engine):
    def load() -> wpb.WorkerLoad:
        running, waiting, kv = engine.load
        metrics.RUNNING.set(running)
        metrics.WAITING.set(waiting)
        metrics.KV_USED.set(kv)
        return wpb.WorkerLoad(running=running, waiting=waiting, kv_used_fraction=kv)
    return load


async def main_async(cfg: WorkerConfig) -> None:
    worker_id = cfg.worker_id or f"worker-{uuid.uuid4().hex[:8]}"
    if engine_options(cfg).device == "cpu" and cfg.cpu_threads > 0:
        torch.set_num_threads(cfg.cpu_threads)
    built = await asyncio.to_thread(build_engine, cfg.model, engine_options(cfg))
    store = StoreClient(sync_channel(cfg.store, cfg.tls_ca, cfg.tls_cert, cfg.tls_key),
                        shm_dir=cfg.store_shm_dir or None)
    host = await asyncio.to_thread(HostTier, cfg.host_pool_bytes, cfg.tenant_share or None,
                                   built.device.type == "cuda", built.spec)
    await asyncio.to_thread(built.pool.warm_up)
    feed_ref: list[ResidencyFeed] = []
    manager = AdapterManager(built.pool, built.spec, host, store,
                             tenant_share=cfg.tenant_share or None,
                             on_change=lambda key: feed_ref[0].mark(key),
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
    feed_ref.append(feed)
    feed.bind(asyncio.get_running_loop())
    servicer = WorkerServicer(cfg, built, manager, feed, worker_id)
    stop = threading.Event()
    thread = threading.Thread(target=built.engine.run, args=(stop,), name="engine", daemon=True)
    thread.start()
    server, port, health = create_server(
        cfg.listen, lambda s: (worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s),
                               ["lorafleet.v1.Worker"])[1],
        server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_ca))
    ticker = asyncio.get_running_loop().create_task(feed.tick())
    log.info("worker %s serving %s on port %d (device %s)", worker_id, built.spec.name, port,
             built.device)
    def drain():
        servicer.draining = True
        feed._publish([])           # routers see draining at once
        feed.close()
    await serve(server, health, cfg.grace, on_drain=drain, name="worker")
    ticker.cancel()
    manager.close()
    stop.set()
    thread.join(5)


def main(argv: list[str] | None = None) -> int:
    return run_service("worker", lambda: parse_args(argv), main_async)


if __name__ == "__main__":
    sys.exit(main())
