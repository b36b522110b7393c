"""Every port a service listens on is its alone (issue 41: with gRPC's default SO_REUSEPORT a
second adapter-store on a taken port started without error and took a share of the new
connections). gRPC servers bind with `grpc.so_reuseport` 0 (services.common.server), /metrics
and the HTTP gateway without SO_REUSEPORT, and before anything else starts a service checks
that each of its ports is free (`check_ports`), so a second one exits at once with one line
naming the port instead of loading a model first or serving half the connections.
"""
from __future__ import annotations

import errno
import socket

GRPC_EXCLUSIVE = ("grpc.so_reuseport", 0)


class PortError(RuntimeError):
    """A port a service must listen on cannot be bound (its message names the flag and port)."""


def split(address: str) -> tuple[str, int]:
    """'HOST:PORT' or '[V6]:PORT' -> (host, port); an empty host is every interface."""
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


def taken(flag: str, address: str, port: int) -> PortError:
    return PortError(f"could not serve {flag} {address}: port {port} is taken by another "
                     "process (Address already in use)")


def check_free(flag: str, address: str) -> None:
    """Raise PortError if another socket listens on `address` (HOST:PORT, port 0 = any:
    nothing to check). The probe sets SO_REUSEADDR as the servers do (so a closed connection's
    TIME_WAIT does not count) and never SO_REUSEPORT: a listener there, shared or not, makes it
    fail. Other bind errors are left to the real bind, which reports them."""
    host, port = split(address)
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise taken(flag, address, port) from None


def service_ports(cfg) -> list[tuple[str, str]]:
    """(flag, HOST:PORT) of every port the service's config makes it listen on."""
    common = cfg.common
    ports = [("--listen", common.listen)]
    if getattr(cfg, "http_listen", ""):
        ports.append(("--http-listen", cfg.http_listen))
    if common.metrics_port:
        from services.common.runtime import metrics_host
        host = metrics_host(common)
        ports.append(("--metrics-port", f"[{host}]:{common.metrics_port}" if ":" in host
                      else f"{host}:{common.metrics_port}"))
    return ports


def check_ports(cfg) -> None:
    """Every port of the service is free (else PortError naming the first that is not)."""
    for flag, address in service_ports(cfg):
        check_free(flag, address)
