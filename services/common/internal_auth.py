"""When a service may run with its internal calls open (issue 41: with --tenants set, the
store still answered `Resolve` for any tenant from anyone who reached its port).

Internal calls (router -> worker, router and worker -> store) are authenticated by a shared
service token (--service-token-file) or by mTLS (--tls-ca with --tls-cert/--tls-key:
services.common.service_auth). A configuration that is plainly production refuses to start
without either, unless the operator says so with --insecure-internal:

- the router with --tenants (its production mode): its calls would go out unauthenticated,
  so the store and workers it calls could not be checking who calls them;
- the store or a worker listening beyond loopback (anything but 127.0.0.0/8, ::1, localhost
  or a unix socket): whoever reaches the port could call it.

A store and worker on loopback and a router without --tenants (`make run`, dev mode) need
nothing. The router's own port is public and checks tenant tokens instead.
"""
from __future__ import annotations

import ipaddress
import socket

HOW = ("give every service the same --service-token-file FILE, or mTLS (--tls-ca with "
       "--tls-cert/--tls-key); --insecure-internal runs with them open")


def authenticated(flags) -> bool:
    """Whether internal calls to or from this service (flags: its ServiceFlags) are
    authenticated (token or mTLS)."""
    return bool(flags.service_token_file) or bool(flags.tls_ca and flags.tls_cert)


def loopback(host: str) -> bool:
    """Whether a listen host is reachable from this machine only."""
    host = host.strip("[]")
    if host.startswith("unix:") or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not host:
        return False
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def check_internal_server(flags) -> None:
    """A store or worker (flags: its ServiceFlags): refuse (ValueError) open internal calls
    beyond loopback."""
    if flags.insecure_internal or authenticated(flags):
        return
    listen = flags.listen
    host = listen if listen.startswith("unix:") else listen.rpartition(":")[0]
    if not loopback(host):
        raise ValueError(f"--listen {listen} is reachable beyond this machine, and internal "
                         f"calls to it would not be authenticated: {HOW}")


def check_router(flags, tenants: str | None) -> None:
    """The router (flags: its ServiceFlags): refuse (ValueError) --tenants with open internal
    calls."""
    if tenants and not (flags.insecure_internal or authenticated(flags)):
        raise ValueError(f"--tenants (production mode) needs authenticated internal calls: "
                         f"{HOW}")
