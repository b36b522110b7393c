"""services.common.interceptor on a real grpc.aio server in this process, over loopback:
both styles of streaming handler, undecodable requests, and the deadline race (a handler that
gives up at its deadline and aborts DEADLINE_EXCEEDED while the transport ends the call: the
abort's batch failed and grpc.aio logged "ExecuteBatchError raised in core" with a traceback,
a few calls in a hundred)."""
from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.common.errors import DeadlineExceeded
from services.common.server import create_server

REQUEST = health_pb2.HealthCheckRequest
RESPONSE = health_pb2.HealthCheckResponse


async def _gives_up_at_deadline(request, context):
    try:
        await asyncio.wait_for(asyncio.sleep(10), context.time_remaining())
    except asyncio.TimeoutError:
        raise DeadlineExceeded("deadline exceeded while waiting") from None


async def _stream_gives_up(request, context):
    yield RESPONSE(status=RESPONSE.SERVING)
    await _gives_up_at_deadline(request, context)


async def _writes(request, context):          # grpc_health's Watch style: context.write()
    for status in (RESPONSE.SERVING, RESPONSE.NOT_SERVING):
        await context.write(RESPONSE(status=status))


def _register(server):
    def unary(fn):
        return grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=REQUEST.FromString,
            response_serializer=RESPONSE.SerializeToString)

    def stream(fn):
        return grpc.unary_stream_rpc_method_handler(
            fn, request_deserializer=REQUEST.FromString,
            response_serializer=RESPONSE.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {
        "Unary": unary(_gives_up_at_deadline), "Stream": stream(_stream_gives_up),
        "Writes": stream(_writes)}),))
    return ["t.T"]


async def _serve(body):
    server, port, _health = create_server("127.0.0.1:0", _register)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            return await body(ch)
    finally:
        await server.stop(0)


def test_a_handler_that_writes_with_context_write_streams():
    async def body(ch):
        call = ch.unary_stream("/t.T/Writes", request_serializer=REQUEST.SerializeToString,
                               response_deserializer=RESPONSE.FromString)
        return [r.status async for r in call(REQUEST(), timeout=5)]
    assert asyncio.run(_serve(body)) == [RESPONSE.SERVING, RESPONSE.NOT_SERVING]


def test_undecodable_request_is_invalid_argument():
    async def body(ch):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ch.unary_unary("/t.T/Unary")(b"\xff\xff\xff", timeout=5)
        return err.value
    err = asyncio.run(_serve(body))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "request: not a valid Unary request message"


def test_aborting_at_the_deadline_logs_nothing(caplog):
    async def one(ch, k):
        method = "/t.T/Stream" if k % 2 else "/t.T/Unary"
        call = (ch.unary_stream if k % 2 else ch.unary_unary)(
            method, request_serializer=REQUEST.SerializeToString)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            result = call(REQUEST(), timeout=0.05)
            if k % 2:
                async for _ in result:
                    pass
            else:
                await result
        return err.value.code()

    async def body(ch):
        codes = []
        for _ in range(15):
            codes += await asyncio.gather(*(one(ch, k) for k in range(20)))
        await asyncio.sleep(0.2)
        return codes
    with caplog.at_level(logging.DEBUG, logger="grpc"):
        codes = asyncio.run(_serve(body))
    assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED}
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors, [r.getMessage() for r in errors][:3]
