"""The router's configuration: one frozen dataclass built once in main()."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from services.common.config import ServiceFlags, add_flags
from services.common.internal_auth import check_router
from services.common.runtime import parse_bytes
from services.router.limits import DEFAULT_MAX_PROMPT_BYTES, RECEIVE_HEADROOM

# a message's cap stays under gRPC's 64 MiB one (services.common.server.CHANNEL_OPTIONS)
MAX_PROMPT_CAP = (64 << 20) - RECEIVE_HEADROOM


@dataclass(frozen=True)
class RouterConfig:
    http_listen: str = ""               # OpenAI-compatible HTTP gateway; "" = off
    store: str = "127.0.0.1:7003"
    workers: tuple[str, ...] = ("127.0.0.1:7002",)
    tenants: str | None = None
    fair: bool = True
    max_in_flight_per_worker: int = 64
    spill_rows: int = 32
    warm_adapters: int = 64         # hot adapters a worker that joins empty is warmed with
    hot_half_life_s: float = 300.0  # the hot set's request counts halve this often
    foothold_per_worker: int = 1
    resolve_ttl: float = 1.0
    retry_delay: float = 0.5
    dns_period: float = 10.0
    worker_wait: float = 30.0           # seconds a request waits for a live worker
    metrics_tenants: int = 50           # tenants named on /metrics; the rest are "other"
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES   # text, messages or ids (limits.py)
    peers: tuple[str, ...] = ()         # the other router replicas sharing the quotas
    peer_period: float = 2.0            # seconds between checks of the peers
    # the flags every service takes (services.common.config)
    common: ServiceFlags = ServiceFlags(listen="127.0.0.1:7001", metrics_port=9101)

    def __post_init__(self) -> None:
        if self.metrics_tenants < 0:
            raise ValueError("--metrics-tenants must be >= 0")
        if not self.workers:
            raise ValueError("at least one --worker is required")
        if self.max_in_flight_per_worker < 1:
            raise ValueError("--max-in-flight-per-worker must be >= 1")
        if self.foothold_per_worker < 0:
            raise ValueError("--foothold-per-worker must be >= 0")
        if self.spill_rows < 1:
            raise ValueError("--spill-rows must be >= 1")
        if not 0 <= self.warm_adapters <= 100_000:
            raise ValueError("--warm-adapters must be within [0, 100000]")
        if not (self.hot_half_life_s > 0 and self.hot_half_life_s < float("inf")):
            raise ValueError("--hot-half-life-s must be > 0")
        if self.resolve_ttl < 0:
            raise ValueError("--resolve-ttl must be >= 0")
        if not 0 <= self.worker_wait <= 3600:
            raise ValueError("--worker-wait must be within [0, 3600] seconds")
        if not 1 <= self.max_prompt_bytes <= MAX_PROMPT_CAP:
            raise ValueError(f"--max-prompt-bytes must be in 1..{MAX_PROMPT_CAP}, got "
                             f"{self.max_prompt_bytes}")
        if self.tenants:                 # read and checked now: a bad file exits 2, naming it
            from services.router.auth import Tenants
            try:
                Tenants.load(self.tenants)
            except (OSError, ValueError) as exc:
                raise ValueError(f"--tenants {self.tenants}: {exc}") from None
        check_router(self.common, self.tenants)


def _add_placement_flags(p: argparse.ArgumentParser) -> None:
    """Placement's flags, and the hot set that warms a worker joining empty."""
    p.add_argument("--spill-rows", type=int, default=32,
                   help="rows (running + waiting) of one adapter on its worker above which its "
                        "requests may spill to a second worker (32)")
    p.add_argument("--warm-adapters", type=int, default=64,
                   help="a worker that connects holding no adapter (new, or restarted) is sent "
                        "up to this many of the fleet's hottest adapters that placement would "
                        "give it, hottest first, to stage in the background (its host tier, "
                        "and its GPU pool within its --warm-gpu-share); 0: off (64)")
    p.add_argument("--hot-half-life-s", type=float, default=300.0,
                   help="the fleet's hot set counts each adapter's requests, halved every "
                        "this many seconds (300)")


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    p = argparse.ArgumentParser(prog="python -m services.router",
                                description="lorafleet router: the public GenerationService")
    add_flags(p, listen="127.0.0.1:7001", metrics_port=9101, grace=10.0)
    p.add_argument("--store", default=os.environ.get("LORAFLEET_STORE", "127.0.0.1:7003"),
                   help="adapter-store address (env LORAFLEET_STORE)")
    p.add_argument("--http-listen", default="",
                   help="host:port for the OpenAI-compatible HTTP gateway (/v1/completions, "
                        "/v1/chat/completions, /v1/models); empty = off")
    p.add_argument("--worker", action="append", default=[],
                   help="worker address, repeatable; a DNS name (headless Service) is "
                        "re-resolved periodically (default 127.0.0.1:7002)")
    p.add_argument("--tenants", default=None,
                   help="tenants file (tokens, roles, weights, quotas); without it: dev mode")
    p.add_argument("--fair-queue", choices=("on", "off"), default="on",
                   help="weighted VTC fair queue under saturation (on) or FIFO (off)")
    p.add_argument("--max-in-flight-per-worker", type=int, default=64,
                   help="requests forwarded per live worker before the fair queue holds them")
    p.add_argument("--foothold-per-worker", type=int, default=1,
                   help="extra requests per live worker past that limit, only for tenants with "
                        "nothing in flight, so a light tenant need not wait for a heavy one's "
                        "request to end (1; fair queue only)")
    _add_placement_flags(p)
    p.add_argument("--resolve-ttl", type=float, default=1.0, help="adapter name cache seconds")
    p.add_argument("--dns-period", type=float, default=10.0,
                   help="seconds between re-resolving DNS worker names")
    p.add_argument("--worker-wait", type=float, default=30.0,
                   help="seconds a request that finds no live worker (the fleet starting or "
                        "restarting) waits for one, within its deadline, before UNAVAILABLE (30)")
    p.add_argument("--metrics-tenants", type=int, default=50, help="tenants named in /metrics' "
                   "tenant labels, most requests first; the rest are tenant=other (50)")
    p.add_argument("--peer", action="append", default=[],
                   help="another router replica (HOST:PORT, or a DNS name resolving to every "
                        "replica, e.g. a headless Service), repeatable: the tenants' quotas are "
                        "shared among the live ones")
    p.add_argument("--peer-period", type=float, default=2.0,
                   help="seconds between checks of the peers (2)")
    p.add_argument("--max-prompt-bytes", type=parse_bytes, default=DEFAULT_MAX_PROMPT_BYTES,
                   help="largest prompt accepted: text or chat messages (UTF-8 bytes) or token "
                        "ids (4 bytes each) (1MiB)")
    a = p.parse_args(argv)
    return RouterConfig(
        common=ServiceFlags.from_args(a), http_listen=a.http_listen, store=a.store,
        workers=tuple(a.worker or ["127.0.0.1:7002"]),
        tenants=a.tenants, fair=a.fair_queue == "on",
        max_in_flight_per_worker=a.max_in_flight_per_worker, spill_rows=a.spill_rows,
        warm_adapters=a.warm_adapters, hot_half_life_s=a.hot_half_life_s,
        foothold_per_worker=a.foothold_per_worker,
        resolve_ttl=a.resolve_ttl,
        dns_period=a.dns_period, worker_wait=a.worker_wait, max_prompt_bytes=a.max_prompt_bytes,
        peers=tuple(a.peer), peer_period=a.peer_period,
        metrics_tenants=a.metrics_tenants)
