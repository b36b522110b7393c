"""GetStats: the four health signals aggregated over every live worker and the store."""
from __future__ import annotations

import asyncio

import grpc

from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb
from services.common.gen.lorafleet.v1 import router_pb2 as rpb
from services.common.gen.lorafleet.v1 import worker_pb2 as wpb
from services.router.stats import percentile

COLD_TIERS = {"WORKER_HOST": "worker_host", "STORE_HOST": "store_host", "SOURCE": "source"}


async def _gather(app):
    async def info(w):
        try:
            return await w.stub.Info(wpb.WorkerInfoRequest(), timeout=5)
        except grpc.RpcError:
            return None
    async def store():
        try:
            return await app.store.Stats(spb.StoreStatsRequest(), timeout=5)
        except grpc.RpcError:
            return None
    workers = list(app.workers.live().values())
    results = await asyncio.gather(store(), *(info(w) for w in workers))
    if results[0] is not None:
        app.stats.store_snapshot = results[0]
    # each worker's own counts, for the status page's Workers table: the same figures the
    # adapter counts below sum, so the page's panels agree
    app.stats.worker_infos = {w.addr: r for w, r in zip(workers, results[1:]) if r is not None}
    # the store unreachable: its last figures, as /metrics keeps them (the reply's shape does
    # not change, and `registered` does not read 0 while the adapters still serve)
    return app.stats.store_snapshot, [r for r in results[1:] if r is not None]


async def poll_store_stats(store, stats, period: float = 10.0) -> None:
    """Keep RouterStats.store_snapshot fresh for /metrics (the collector cannot await)."""
    while True:
        try:
            stats.store_snapshot = await store.Stats(spb.StoreStatsRequest(), timeout=5)
        except grpc.RpcError:
            pass                       # the store is down: keep the last figures
        await asyncio.sleep(period)


def _tier(name: str, hits: int, misses: int) -> rpb.TierStats:
    total = hits + misses
    return rpb.TierStats(tier=name, hits=hits, misses=misses,
                         hit_rate=hits / total if total else 0.0)


async def build_stats(app) -> rpb.GetStatsResponse:
    store, infos = await _gather(app)
    out = rpb.GetStatsResponse(workers=len(infos), jain_index=app.stats.jain())
    sums: dict[str, list[int]] = {"gpu": [0, 0], "worker_host": [0, 0]}
    samples: dict[str, list[float]] = {v: [] for v in COLD_TIERS.values()}
    counts = {v: 0 for v in COLD_TIERS.values()}
    for info in infos:
        for c in info.cache:
            acc = sums.setdefault(c.tier, [0, 0])
            acc[0] += c.hits
            acc[1] += c.misses
        for h in info.cold_loads:
            name = COLD_TIERS.get(h.tier)
            if name:
                samples[name].extend(h.samples)
                counts[name] += h.count
    for name, (hits, misses) in sums.items():
        out.cache.append(_tier(name, hits, misses))
    if store is not None:
        out.cache.append(_tier("store_host", store.host_hits, store.host_misses))
    for name, xs in samples.items():
        out.cold_load.append(rpb.ColdLoadStats(tier=name, count=counts[name],
                                               p50=percentile(xs, 50), p95=percentile(xs, 95),
                                               p99=percentile(xs, 99)))
    for tenant, rec in sorted(app.stats.tenants.items()):
        out.tenants.append(rpb.TenantStats(
            tenant=tenant, requests=rec.requests, tokens_served=rec.tokens,
            prompt_tokens=rec.prompt_tokens, throttled=rec.throttled,
            p50_latency_s=percentile(rec.latencies, 50),
            p99_latency_s=percentile(rec.latencies, 99)))
    a = out.adapters
    a.registered = store.registered if store else 0
    a.store_host = store.host_resident if store else 0
    a.worker_host = sum(i.host_resident for i in infos)
    a.gpu_resident = sum(i.gpu_resident for i in infos)
    a.working_set = app.stats.working_set()
    return out
