"""The capacity simulator's synthetic workload (v1's, now with request lengths): A adapters
(ranks 8-64, 2 MiB per unit of rank: q,k,v,o of a 7B model in bf16) owned by N tenants, Zipf
popularity within each tenant's adapters; tenant "bursty" owns a share of them and sends
``burst_factor`` times its rate for ``burst_on_s`` of every ``burst_period_s`` over a flatter
popularity. Poisson arrivals; deterministic for a seed."""
from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass

from bench.capacity.fleet import SimRequest

RANKS, RANK_WEIGHTS = (8, 16, 32, 64), (0.3, 0.4, 0.2, 0.1)
BYTES_PER_RANK = 2 << 20


@dataclass(frozen=True)
class WorkloadConfig:
    """The synthetic workload."""
    adapters: int = 10_000
    tenants: int = 8
    requests: int = 20_000
    rate: float = 40.0                  # requests/s of all tenants outside bursts
    zipf: float = 1.0
    bursty_zipf: float = 0.6            # flatter: a burst sweeps over many of its adapters
    bursty_adapters: float = 0.3        # share of the adapters owned by the bursty tenant
    burst_factor: float = 4.0
    burst_period_s: float = 30.0
    burst_on_s: float = 6.0
    prompt: int = 128
    output: int = 128
    seed: int = 0


def _zipf_cum(n: int, s: float) -> list[float]:
    return list(itertools.accumulate(1.0 / (j + 1) ** s for j in range(n)))


def _arrivals(rng: random.Random, rate: float, horizon: float, burst: tuple | None) -> list[float]:
    """Poisson arrivals; with burst=(factor, period, on) the rate is multiplied while 'on'."""
    peak = rate * (burst[0] if burst else 1.0)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= horizon:
            return out
        if burst is None or t % burst[1] < burst[2] or rng.random() < 1.0 / burst[0]:
            out.append(t)


def make_requests(cfg: WorkloadConfig) -> list[SimRequest]:
    """The request stream, arrival order."""
    rng = random.Random(cfg.seed)
    sizes = [r * BYTES_PER_RANK for r in rng.choices(RANKS, RANK_WEIGHTS, k=cfg.adapters)]
    n_bursty = int(cfg.adapters * cfg.bursty_adapters)
    steady = (cfg.adapters - n_bursty) // max(1, cfg.tenants - 1)
    spans = [(0, n_bursty)] + [(n_bursty + i * steady, steady) for i in range(cfg.tenants - 1)]
    per_tenant = cfg.rate / cfg.tenants
    duty = cfg.burst_on_s / cfg.burst_period_s
    mean_rate = cfg.rate + per_tenant * (cfg.burst_factor - 1) * duty
    horizon = 1.1 * cfg.requests / mean_rate
    names = ["bursty"] + [f"steady{i}" for i in range(1, cfg.tenants)]
    stream = []
    for tenant, (start, count) in enumerate(spans):
        burst = (cfg.burst_factor, cfg.burst_period_s, cfg.burst_on_s) if tenant == 0 else None
        cum = _zipf_cum(count, cfg.bursty_zipf if tenant == 0 else cfg.zipf)
        for t in _arrivals(rng, per_tenant, horizon, burst):
            j = bisect.bisect_left(cum, rng.random() * cum[-1])
            stream.append((t, start + min(j, count - 1), tenant))
    stream.sort()
    return [SimRequest(i, t, f"a{a}", names[tenant], cfg.prompt, cfg.output, sizes[a])
            for i, (t, a, tenant) in enumerate(stream[:cfg.requests])]
