"""gRPC server helpers shared by the three services: create_server, the error-mapping
interceptor, health, and graceful drain on SIGTERM.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Awaitable, Callable, Iterable

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from services.common.errors import LorafleetError

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


def status_for(err: LorafleetError) -> status_pb2.Status:
    """The google.rpc.Status for a domain error, with RetryInfo when it carries a delay."""
    status = status_pb2.Status(code=err.code.value[0], message=err.message)
    if err.retry_after is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(err.retry_after * 1e9))
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        status.details.append(detail)
    return status


async def abort_with(context: grpc.aio.ServicerContext, err: LorafleetError) -> None:
    """End the call with the domain error's status (and details); never returns."""
    status = status_for(err)
    if status.details:
        await context.abort_with_status(rpc_status.to_status(status))
    await context.abort(err.code, err.message)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps LorafleetError to its status; anything else to INTERNAL, logged with a trace."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        if handler.unary_unary:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary, method))
        if handler.unary_stream:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream, method))
        return handler


async def _map(context, exc: BaseException, method: str) -> None:
    if isinstance(exc, LorafleetError):
        await abort_with(context, exc)
    log.exception("unhandled error in %s", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


def _wrap_unary(fn, method):
    async def wrapper(request, context):
        try:
            return await fn(request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await _map(context, exc, method)
    return wrapper


def _wrap_stream(fn, method):
    async def wrapper(request, context):
        try:
            async for item in fn(request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await _map(context, exc, method)
    return wrapper


def create_server(listen: str, register: Callable[[grpc.aio.Server], Iterable[str]],
                  credentials: grpc.ServerCredentials | None = None,
                  interceptors: Iterable[grpc.aio.ServerInterceptor] = ()
                  ) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Build a grpc.aio server on `listen` (port 0 = any free port).

    `register(server)` adds the service's servicers and returns their full service names, which
    are reported SERVING by grpc.health.v1 once the server starts. Returns (server, port, health).
    """
    server = grpc.aio.server(interceptors=[*interceptors, ErrorInterceptor()],
                             options=SERVER_OPTIONS)
    names = list(register(server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if credentials is None:
        port = server.add_insecure_port(listen)
    else:
        port = server.add_secure_port(listen, credentials)
    if port == 0:
        raise RuntimeError(f"could not bind {listen}")
    health_servicer._lorafleet_names = ["", *names]  # what set_serving() marks
    return server, port, health_servicer


async def set_serving(health_servicer, serving: bool) -> None:
    """Mark every registered service (and the server as a whole) SERVING or NOT_SERVING."""
    state = (health_pb2.HealthCheckResponse.SERVING if serving
             else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in health_servicer._lorafleet_names:
        await health_servicer.set(name, state)


async def serve(server: grpc.aio.Server, health_servicer, grace: float,
                on_drain: Callable[[], object] | None = None, name: str = "service",
                started: Callable[[], Awaitable[None]] | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Start (then await started(), if given), report SERVING, and on SIGTERM/SIGINT (or when
    `stop` is set) drain: NOT_SERVING, on_drain(), stop(grace), return."""
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
    await set_serving(health_servicer, False)
    if on_drain is not None:
        result = on_drain()
        if asyncio.iscoroutine(result):
            await result
    await server.stop(grace)
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
            key: str | None = None, keepalive_s: float = KEEPALIVE_S) -> grpc.aio.Channel:
    """An aio channel to another lorafleet service (TLS when a CA is given)."""
    options = client_options(keepalive_s)
    if ca:
        return grpc.aio.secure_channel(target, _credentials(ca, cert, key), options=options)
    return grpc.aio.insecure_channel(target, options=options)


def sync_channel(target: str, ca: str | None = None, cert: str | None = None,
                 key: str | None = None, keepalive_s: float = KEEPALIVE_S) -> grpc.Channel:
    """A blocking channel to another lorafleet service, for calls made from worker threads
    (the worker's adapter fetches), with the same options and TLS as `channel`."""
    options = client_options(keepalive_s)
    if ca:
        return grpc.secure_channel(target, _credentials(ca, cert, key), options=options)
    return grpc.insecure_channel(target, options=options)


def _credentials(ca: str, cert: str | None, key: str | None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        open(ca, "rb").read(), open(key, "rb").read() if key else None,
        open(cert, "rb").read() if cert else None)
