"""python -m services.router: the public GenerationService over the workers and the store."""
from __future__ import annotations

import asyncio
import errno
import logging
import sys

from prometheus_client import REGISTRY

from services.common.gen.lorafleet.v1 import adapter_store_pb2_grpc, router_pb2_grpc
from services.common.ports import PortError, split, taken
from services.common.runtime import freeze_startup_objects, run_service
from services.common.tenant_labels import TenantLabels
from services.common.service_auth import read_token
from services.common.server import channel, create_server, serve, server_credentials
from services.router.auth import Tenants
from services.router.config import RouterConfig, parse_args
from services.router.fair_queue import FairGate
from services.router.limits import receive_limit
from services.router.openai_gateway import OpenAIGateway
from services.router.peers import Peers
from services.router.quotas import Quotas
from services.router.resolve import Resolver
from services.router.hot_set import HotSet, Warmer
from services.router.servicer import GenerationServicer, RouterApp
from services.router.stats import FleetCollector, RouterStats
from services.router.stats_view import poll_store_stats
from services.router.workers import WorkerSet

log = logging.getLogger("lorafleet.router")


async def main_async(cfg: RouterConfig) -> None:
    tenants = Tenants.load(cfg.tenants)
    if tenants.dev_mode:
        log.warning("no --tenants file: DEV MODE — the bearer token is taken as the tenant "
                    "name (no token: tenant 'dev') and any tenant may register adapters")
    common = cfg.common
    tls = (common.tls_ca, common.tls_cert, common.tls_key)
    token = read_token(common.service_token_file)       # sent on calls to the store, workers
    if cfg.tenants and common.insecure_internal and not (token or common.tls_ca):
        log.warning("--insecure-internal: the store and workers are called without a service "
                    "token or mTLS; anyone who reaches their ports can call them as any tenant")
    store_chan = channel(cfg.store, *tls, keepalive_s=common.keepalive_s, service_token=token)
    ready = Readiness()
    workers, hot, warmer = _fleet(cfg, tls, token, ready)
    stats = RouterStats(tenants=TenantLabels(cfg.metrics_tenants))
    REGISTRY.register(FleetCollector(workers, stats))
    app = RouterApp(
        tenants=tenants, quotas=Quotas(tenants.quotas),
        gate=FairGate(cfg.max_in_flight_per_worker * len(cfg.workers), fair=cfg.fair,
                      weights=tenants.weights,
                      foothold=cfg.foothold_per_worker * len(cfg.workers)),
        resolver=Resolver(store_chan, cfg.resolve_ttl, cfg.store), workers=workers,
        store=adapter_store_pb2_grpc.AdapterStoreStub(store_chan), stats=stats,
        per_worker=cfg.max_in_flight_per_worker, spill_rows=cfg.spill_rows,
        foothold_per_worker=cfg.foothold_per_worker, max_prompt_bytes=cfg.max_prompt_bytes,
        worker_wait=cfg.worker_wait, hot=hot)
    servicer = GenerationServicer(app)
    server, port, health = create_server(
        common.listen, lambda s: (router_pb2_grpc.add_GenerationServiceServicer_to_server(
            servicer, s), ["lorafleet.v1.GenerationService"])[1],
        server_credentials(common.tls_cert, common.tls_key, common.tls_ca),
        reflection=common.reflection,
        max_receive_bytes=receive_limit(cfg.max_prompt_bytes))
    gateway = None
    if cfg.http_listen:                 # bound before the router can say SERVING
        gateway = OpenAIGateway(servicer, servicer.base_model_name)
        http_port = await start_gateway(gateway, cfg.http_listen)
        log.info("OpenAI-compatible HTTP gateway on port %d (/v1/completions, "
                 "/v1/chat/completions, /v1/models)", http_port)
    await ready.attach(health)
    await workers.start()
    log.info("router serving on port %d; workers %s; store %s; fair queue %s", port,
             ", ".join(cfg.workers), cfg.store, "on" if cfg.fair else "off")
    loop = asyncio.get_running_loop()
    poller = loop.create_task(poll_store_stats(app.store, stats))
    peers = None
    if cfg.peers:                       # the quotas shared among the live replicas
        peers = Peers(list(cfg.peers), app.quotas, common.listen, cfg.peer_period, tls)
        peers.set_own_port(port)
        peers = loop.create_task(peers.run())
    freeze_startup_objects(log)
    try:
        await serve(server, health, common.grace, name="router",
                    on_drain=gateway.stop if gateway else None)
    finally:
        poller.cancel()
        if peers is not None:
            peers.cancel()
    warmer.close()
    await workers.close()


def _fleet(cfg: RouterConfig, tls: tuple, token: str, ready: "Readiness"
           ) -> tuple[WorkerSet, HotSet, Warmer]:
    """The worker set, the fleet's hot set, and the warmer that sends a worker joining empty
    its share of it (services/router/hot_set.py)."""
    hot = HotSet(cfg.hot_half_life_s)
    warmer = Warmer(hot, lambda: workers.views(), cfg.warm_adapters)
    workers = WorkerSet(list(cfg.workers), tls, cfg.dns_period,
                        keepalive_s=cfg.common.keepalive_s, service_token=token,
                        on_ready=ready.set,
                        on_join=lambda w: warmer.joined(w.addr, w.stub, empty=not w.adapters))
    return workers, hot, warmer


class Readiness:
    """The router can serve while some worker is live: its grpc.health.v1 status ("" and
    GenerationService) follows the worker set; until the first worker connects it is
    NOT_SERVING, and requests that come meanwhile wait for one (--worker-wait)."""

    def __init__(self):
        self._health = None
        self._tasks: set[asyncio.Task] = set()

    async def attach(self, health) -> None:
        self._health = health
        await health.update(ready=False)

    def set(self, ready: bool) -> None:
        log.log(logging.INFO if ready else logging.WARNING,
                "%s", "a worker is live: ready" if ready else
                "no live worker: NOT_SERVING until one connects (requests wait --worker-wait)")
        task = asyncio.get_running_loop().create_task(self._health.update(ready=ready))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def start_gateway(gateway: OpenAIGateway, listen: str) -> int:
    """Serve the HTTP gateway on `listen` (aiohttp binds without SO_REUSEPORT: the port is
    the router's alone); PortError naming the port when it cannot."""
    try:
        return await gateway.start(listen)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise taken("--http-listen", listen, split(listen)[1]) from None
        raise PortError(f"could not serve --http-listen {listen}: {exc.strerror}") from None


def main(argv: list[str] | None = None) -> int:
    return run_service("router", lambda: parse_args(argv), main_async)


if __name__ == "__main__":
    sys.exit(main())
