"""The one server interceptor every service runs (services.common.server.create_server).

For each unary-request call it:
- decodes the request itself, so bytes that are not the method's message end the call with
  INVALID_ARGUMENT and one debug line (gRPC's own decoding answers UNKNOWN and logs an ERROR
  traceback, before the handler, so before any authentication);
- maps LorafleetError to its status, anything else to INTERNAL, logged with a traceback;
- runs both styles of streaming handler: async generators (the services' own) and coroutines
  that write with context.write() (grpc_health's Watch);
- counts the call in a CallGate, which refuses new calls (UNAVAILABLE) once a drain begins,
  while health checks and reflection keep being answered;
- ends quietly a call the transport already finished (its deadline passed or the client
  went away while the handler wrote or aborted), which grpc.aio would log as an
  ExecuteBatchError when it wins the race against its own cancellation.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from services.common.errors import LorafleetError

try:                                        # grpc.aio's failed-batch error (not public API)
    from grpc._cython.cygrpc import ExecuteBatchError as _BatchError
except ImportError:                         # pragma: no cover - another gRPC build
    class _BatchError(Exception):
        pass

log = logging.getLogger("services.common.server")
# Calls a drain never refuses and never waits for (they are how a drain is observed).
UNGATED = ("/grpc.health.v1.Health/", "/grpc.reflection.")


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


class CallGate:
    """The calls a server has in flight, and whether it still takes new ones (a drain closes
    it: new calls are refused UNAVAILABLE while those in flight finish)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.closed = False

    def close(self) -> None:
        self.closed = True

    async def wait_idle(self, timeout: float, poll: float = 0.05) -> bool:
        """Wait until no gated call is in flight (True) or timeout seconds pass (False)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self.in_flight and loop.time() < end:
            await asyncio.sleep(min(poll, max(0.0, end - loop.time())))
        return not self.in_flight

    @contextlib.asynccontextmanager
    async def call(self, method: str, context):
        if method.startswith(UNGATED):
            yield
            return
        if self.closed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is draining")
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Decodes requests, maps errors to statuses and gates calls (see the module docstring)."""

    def __init__(self, gate: CallGate | None = None):
        self.gate = gate or CallGate()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        method, decode = details.method, handler.request_deserializer
        if handler.unary_unary:
            return handler._replace(request_deserializer=None, unary_unary=_wrap_unary(
                handler.unary_unary, method, decode, self.gate))
        if handler.unary_stream:
            return handler._replace(request_deserializer=None, unary_stream=_wrap_stream(
                handler.unary_stream, method, decode, self.gate))
        return handler


async def _decode(raw: bytes, decode, context, method: str):
    if decode is None:
        return raw
    try:
        return decode(raw)
    except Exception as exc:  # noqa: BLE001 - DecodeError and kin: the caller's bytes
        log.debug("%s: undecodable request (%d bytes): %s", method, len(raw), exc)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request: not a valid {method.rsplit('/', 1)[-1]} request message")


async def _map(context, exc: BaseException, method: str) -> None:
    """End the call with exc's status; a call the transport already ended stays ended."""
    try:
        if isinstance(exc, LorafleetError):
            await abort_with(context, exc)
        log.exception("unhandled error in %s", method, exc_info=exc)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
    except _BatchError:
        raise asyncio.CancelledError from None


def _wrap_unary(fn, method, decode, gate: CallGate):
    async def wrapper(raw, context):
        async with gate.call(method, context):
            request = await _decode(raw, decode, context, method)
            try:
                return await fn(request, context)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except _BatchError:
                raise asyncio.CancelledError from None
            except Exception as exc:  # noqa: BLE001 - mapped to a status
                await _map(context, exc, method)
    return wrapper


def _wrap_stream(fn, method, decode, gate: CallGate):
    generator = inspect.isasyncgenfunction(fn)

    async def wrapper(raw, context):
        async with gate.call(method, context):
            request = await _decode(raw, decode, context, method)
            try:
                if generator:
                    await _relay(fn(request, context), context)
                else:               # a coroutine that writes with context.write() itself
                    await fn(request, context)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except _BatchError:     # a write to a call its deadline or its client ended
                raise asyncio.CancelledError from None
            except Exception as exc:  # noqa: BLE001 - mapped to a status
                await _map(context, exc, method)
    return wrapper


async def _relay(responses, context) -> None:
    """Write an async generator's items; close it here, in this task and context, however the
    call ends (left to the garbage collector, its finally blocks would run elsewhere)."""
    try:
        async for item in responses:
            await context.write(item)
    finally:
        await responses.aclose()
