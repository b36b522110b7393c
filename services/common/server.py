"""gRPC server helpers shared by the three services: create_server (with the interceptor of
services.common.interceptor, health and, optionally, reflection), and graceful drain on SIGTERM.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.service_auth import (ServiceTokenCheck, SyncTokenClient,
                                          aio_token_interceptors)
from services.common.ports import GRPC_EXCLUSIVE, PortError, check_free
from services.common.interceptor import (CallGate, ErrorInterceptor, abort_with,  # noqa: F401
                                         status_for)

log = logging.getLogger(__name__)

# Large enough for adapter chunks and long prompts; keepalives so dead peers are noticed.
KEEPALIVE_S = 20.0                    # a client's ping interval (--keepalive-s)
MIN_KEEPALIVE_S = 1.0                 # the shortest --keepalive-s takes
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]
# A server accepts a peer's pings on an idle connection as often as every half of the
# shortest client interval. gRPC's default, one every 5 minutes, makes a server answer a client
# that pings every 20 s with GOAWAY too_many_pings after three pings. gRPC 1.85's server reads
# the bound from min_ping_interval_without_data_ms (tests/test_keepalive.py); older releases
# from min_recv_ping_interval_without_data_ms: both are set.
SERVER_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", int(MIN_KEEPALIVE_S * 500)),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", int(MIN_KEEPALIVE_S * 500)),
    ("grpc.http2.max_ping_strikes", 2),
]


def client_options(keepalive_s: float = KEEPALIVE_S) -> list[tuple]:
    """A service's channels to its peers: pings every keepalive_s; after an outage, reconnect
    within ~2 s of the peer being back (gRPC's default backoff grows to 120 s: a worker down
    for two minutes was found again a minute after it returned)."""
    options = [(k, v) for k, v in CHANNEL_OPTIONS if k != "grpc.keepalive_time_ms"]
    return options + [
        ("grpc.keepalive_time_ms", int(max(keepalive_s, MIN_KEEPALIVE_S) * 1000)),
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.min_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


CLIENT_OPTIONS = client_options()


LIVENESS = "liveness"    # health name SERVING while the process serves, ready or not


class Health(health.aio.HealthServicer):
    """grpc.health.v1 for one server: the service names set_serving() marks, and the gate of
    its calls (closed when a drain begins).

    "" and the service names say whether the server can serve now: SERVING once started, until
    its drain, and only while it is ready (a service that depends on others, the router on a
    live worker, says so with set_ready). LIVENESS says only that the process serves (for a
    liveness probe: a router with no worker yet is not to be restarted)."""

    def __init__(self, names: list[str], gate: CallGate):
        super().__init__()
        self.names, self.gate = ["", *names], gate
        self._watches: set[asyncio.Task] = set()
        self._ending = False
        self._serving = False       # started, not draining
        self._ready = True

    async def update(self, serving: bool | None = None, ready: bool | None = None) -> None:
        """Record serving and/or ready, and set every name's status from them."""
        self._serving = self._serving if serving is None else serving
        self._ready = self._ready if ready is None else ready
        up = health_pb2.HealthCheckResponse.SERVING
        down = health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.names:
            await self.set(name, up if self._serving and self._ready else down)
        await self.set(LIVENESS, up if self._serving else down)

    async def Watch(self, request, context):
        """grpc_health's Watch, which streams until the client leaves, ended with OK by
        end_watches() (a stream still open when the server stops is cancelled, and grpc.aio
        logs that as an error)."""
        watch = asyncio.ensure_future(super().Watch(request, context))
        self._watches.add(watch)
        try:
            await watch
        except asyncio.CancelledError:
            if not (self._ending and watch.cancelled()):
                raise
        finally:
            self._watches.discard(watch)

    def end_watches(self) -> None:
        """End every Watch stream (the server is about to stop: each has seen NOT_SERVING)."""
        self._ending = True
        for watch in self._watches:
            watch.cancel()


def reflection_available() -> bool:
    """Whether grpcio-reflection is installed (--reflection needs it)."""
    try:
        import grpc_reflection.v1alpha.reflection  # noqa: F401
    except ImportError:
        return False
    return True


def create_server(listen: str, register: Callable[[grpc.aio.Server], Iterable[str]],
                  credentials: grpc.ServerCredentials | None = None,
                  interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
                  reflection: bool = False, max_receive_bytes: int | None = None,
                  service_token: str = "") -> tuple[grpc.aio.Server, int, Health]:
    """Build a grpc.aio server on `listen` (port 0 = any free port).

    `register(server)` adds the service's servicers and returns their full service names, which
    are reported SERVING by grpc.health.v1 once the server starts. With `reflection`, the
    server also answers grpc.reflection (grpcurl, grpcui) for those names and health.
    `max_receive_bytes` lowers the largest request message taken (gRPC refuses a larger one
    RESOURCE_EXHAUSTED as it arrives). With `service_token`, calls without it are
    UNAUTHENTICATED (services.common.service_auth). Returns (server, port, health).
    """
    gate = CallGate()
    options = SERVER_OPTIONS + [GRPC_EXCLUSIVE]      # the port is this server's alone
    if max_receive_bytes is not None:
        options = [o for o in options if o[0] != "grpc.max_receive_message_length"]
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    checks = [ServiceTokenCheck(service_token)] if service_token else []
    server = grpc.aio.server(interceptors=[*checks, *interceptors, ErrorInterceptor(gate)],
                             options=options)
    names = list(register(server))
    health_servicer = Health(names, gate)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if reflection:
        from grpc_reflection.v1alpha import reflection as grpc_reflection
        grpc_reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             grpc_reflection.SERVICE_NAME], server)
    return server, bind(server, listen, credentials), health_servicer


def bind(server: grpc.aio.Server, listen: str,
         credentials: grpc.ServerCredentials | None) -> int:
    """Add the listening port (exclusive: GRPC_EXCLUSIVE); PortError when it cannot be bound,
    naming the port and whether another process holds it."""
    try:
        port = (server.add_insecure_port(listen) if credentials is None
                else server.add_secure_port(listen, credentials))
    except RuntimeError:
        port = 0
    if port == 0:
        if not listen.startswith("unix:"):
            check_free("--listen", listen)          # raises if another process holds it
        raise PortError(f"could not serve --listen {listen}")
    return port


async def set_serving(health_servicer: Health, serving: bool) -> None:
    """Mark every registered service (and the server as a whole) SERVING, as far as it is
    ready (Health.update), or NOT_SERVING."""
    await health_servicer.update(serving=serving)


async def drain(server: grpc.aio.Server, health_servicer: Health, grace: float,
                on_drain: Callable[[], object] | None = None,
                flush_s: float = 0.5) -> None:
    """Drain: NOT_SERVING (Watch streams see it), refuse new calls UNAVAILABLE, on_drain(),
    let the calls in flight finish within `grace`, then stop. Health checks are answered
    (NOT_SERVING) for the whole drain: the server itself stops only once the calls are done
    or the grace is spent, after `flush_s` more for their last messages (what is still open
    then, such as health Watch streams, is cancelled)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + grace
    await set_serving(health_servicer, False)
    health_servicer.gate.close()
    if on_drain is not None:
        result = on_drain()
        if asyncio.iscoroutine(result):
            await result
    if not await health_servicer.gate.wait_idle(max(0.0, end - loop.time())):
        log.warning("%d calls still in flight after the %.1fs grace: cancelled",
                    health_servicer.gate.in_flight, grace)
    health_servicer.end_watches()
    await server.stop(min(flush_s, max(0.0, end - loop.time())))


async def serve(server: grpc.aio.Server, health_servicer: Health, grace: float,
                on_drain: Callable[[], object] | None = None, name: str = "service",
                started: Callable[[], Awaitable[None]] | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Start (then await started(), if given), report SERVING, and on SIGTERM/SIGINT (or when
    `stop` is set) drain (see drain) and return."""
    await server.start()
    if started is not None:
        await started()
    await set_serving(health_servicer, True)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("%s draining (grace %.1fs)", name, grace)
    await drain(server, health_servicer, grace, on_drain)
    log.info("%s stopped", name)


def server_credentials(cert: str | None, key: str | None, client_ca: str | None):
    """TLS server credentials (mTLS when client_ca is given), or None for plaintext."""
    if not cert:
        return None
    with open(cert, "rb") as f:
        cert_pem = f.read()
    with open(key, "rb") as f:
        key_pem = f.read()
    ca = open(client_ca, "rb").read() if client_ca else None
    return grpc.ssl_server_credentials([(key_pem, cert_pem)], root_certificates=ca,
                                       require_client_auth=ca is not None)


def channel(target: str, ca: str | None = None, cert: str | None = None,
            key: str | None = None, keepalive_s: float = KEEPALIVE_S,
            service_token: str = "") -> grpc.aio.Channel:
    """An aio channel to another lorafleet service (TLS when a CA is given; the service token
    on every call when one is given: services.common.service_auth)."""
    options = client_options(keepalive_s)
    interceptors = aio_token_interceptors(service_token) if service_token else None
    if ca:
        return grpc.aio.secure_channel(target, _credentials(ca, cert, key), options=options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)


def sync_channel(target: str, ca: str | None = None, cert: str | None = None,
                 key: str | None = None, keepalive_s: float = KEEPALIVE_S,
                 service_token: str = "") -> grpc.Channel:
    """A blocking channel to another lorafleet service, for calls made from worker threads
    (the worker's adapter fetches), with the same options, TLS and token as `channel`."""
    options = client_options(keepalive_s)
    if ca:
        chan = grpc.secure_channel(target, _credentials(ca, cert, key), options=options)
    else:
        chan = grpc.insecure_channel(target, options=options)
    return grpc.intercept_channel(chan, SyncTokenClient(service_token)) if service_token \
        else chan


def _credentials(ca: str, cert: str | None, key: str | None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        open(ca, "rb").read(), open(key, "rb").read() if key else None,
        open(cert, "rb").read() if cert else None)
