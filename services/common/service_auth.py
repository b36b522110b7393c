"""Who may call the internal services: the worker and the adapter store answer only the router
and the workers. With mTLS (`--tls-ca`) the TLS handshake already requires a certificate the CA
signed. Otherwise a shared service token (`--service-token-file`, the same file on every
service) is sent by every internal client in the `x-lorafleet-service-token` metadata and
checked by the worker's and the store's servers (`ServiceTokenCheck`): a call without it is
UNAUTHENTICATED, except health checks and reflection. With neither, internal calls are open
(development), and each service says so in its log at start.
"""
from __future__ import annotations

import hmac
import logging
import pathlib
from collections import namedtuple

import grpc

HEADER = "x-lorafleet-service-token"
OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")
log = logging.getLogger(__name__)


def read_token(path: str | None) -> str:
    """The token in the file (stripped); "" for no file. A file that is empty or cannot be
    read is a configuration error (ValueError)."""
    if not path:
        return ""
    try:
        token = pathlib.Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"--service-token-file {path}: {exc.strerror}") from None
    if not token:
        raise ValueError(f"--service-token-file {path}: empty")
    return token


def describe(service: str, token: str, tls_ca: str | None) -> None:
    """Say in the log how internal calls to this service are authenticated."""
    if tls_ca:
        log.info("%s: internal calls authenticated by mTLS (--tls-ca)", service)
    elif token:
        log.info("%s: internal calls authenticated by the service token", service)
    else:
        log.warning("%s: internal calls are NOT authenticated (no --service-token-file, no "
                    "--tls-ca): anyone who reaches this port may call it", service)


class ServiceTokenCheck(grpc.aio.ServerInterceptor):
    """Refuse (UNAUTHENTICATED) a call without the service token, health checks and
    reflection excepted."""

    def __init__(self, token: str):
        self._token = token.encode()

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get(HEADER, "")
        if hmac.compare_digest(str(given).encode(), self._token):
            return await continuation(details)
        handler = await continuation(details)
        return _refusal(handler)


def _refusal(handler):
    """A handler of the same kind as `handler` that ends the call UNAUTHENTICATED."""
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "service token missing or wrong")

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "service token missing or wrong")
        yield  # pragma: no cover - abort raises

    if handler is None:
        return None
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
    return grpc.unary_stream_rpc_method_handler(
        stream, request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer)


def _with_token(metadata, token: str):
    return (*(metadata or ()), (HEADER, token))


class _AioToken:
    def __init__(self, token: str):
        self._token = token

    def _details(self, d):
        return grpc.aio.ClientCallDetails(d.method, d.timeout,
                                          _with_token(d.metadata, self._token), d.credentials,
                                          d.wait_for_ready)


class _AioUnaryToken(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioStreamToken(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


def aio_token_interceptors(token: str) -> list:
    """Interceptors adding the service token to every call of an aio channel (grpc.aio files
    an interceptor under one kind only: one object a kind)."""
    return [_AioUnaryToken(token), _AioStreamToken(token)]


_Details = namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                   "wait_for_ready", "compression"))


class SyncTokenClient(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the service token to every call of a blocking channel."""

    def __init__(self, token: str):
        self._token = token

    def _details(self, d):
        return _Details(d.method, d.timeout, _with_token(d.metadata, self._token),
                        d.credentials, getattr(d, "wait_for_ready", None),
                        getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)
