"""The other router replicas, so that the tenants' quotas hold across them: each replica
enforces its part of a quota (Quotas.set_replicas: 1 / the live replicas), the replicas being
this one and the peers that answer health SERVING.

`--peers` names the other replicas: HOST:PORT entries, or a DNS name (k8s: a headless Service
over the router pods) resolved every period to all of them; an address that is this router
(its --listen port on one of this host's addresses) is not counted twice. A peer that stops
answering stops counting at the next round, so the survivors take the whole quota back.
"""
from __future__ import annotations

import asyncio
import logging
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.server import channel
from services.router.quotas import Quotas
from services.router.workers import _is_literal, _join

log = logging.getLogger(__name__)


class Peers:
    def __init__(self, targets: list[str], quotas: Quotas, listen: str, period: float = 2.0,
                 tls: tuple = (None, None, None)):
        self.targets, self.quotas, self.period, self.tls = targets, quotas, period, tls
        self._own_port = listen.rpartition(":")[2]
        self._own_hosts = _own_addresses()
        self.live: set[str] = set()

    async def run(self) -> None:
        """Every period: resolve, health-check, and set the quotas' share."""
        while True:
            addrs = await self._addresses()
            live = await asyncio.gather(*(_serving(a, self.tls) for a in addrs))
            now = {a for a, ok in zip(addrs, live) if ok}
            if now != self.live:
                log.info("router peers live: %s; this replica enforces 1/%d of each quota",
                         ", ".join(sorted(now)) or "none", 1 + len(now))
            self.live = now
            self.quotas.set_replicas(1 + len(now))
            await asyncio.sleep(self.period)

    def set_own_port(self, port: int) -> None:
        """The port actually bound (for --listen with port 0)."""
        self._own_port = str(port)

    async def _addresses(self) -> list[str]:
        out = set()
        for target in self.targets:
            host, _, port = target.rpartition(":")
            if _is_literal(target):
                hosts = [host.strip("[]")]
            else:
                try:
                    infos = await asyncio.get_running_loop().getaddrinfo(
                        host, int(port), type=socket.SOCK_STREAM)
                except OSError as err:
                    log.warning("resolving peers %s: %s", target, err)
                    continue
                hosts = [i[4][0] for i in infos]
            out |= {_join(h, port) for h in hosts
                    if not (port == self._own_port and h in self._own_hosts)}
        return sorted(out)


def _own_addresses() -> set[str]:
    hosts = {"127.0.0.1", "::1", "localhost", "0.0.0.0"}
    try:
        hosts |= {i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        pass
    return hosts


async def _serving(addr: str, tls: tuple) -> bool:
    """Whether the router at addr answers health SERVING within a second."""
    try:
        async with channel(addr, *tls) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=1.0)
        return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
