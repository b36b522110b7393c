"""The worker's front end: its public gRPC port, in a process of its own (no torch).

Started by the worker's core (services.worker.__main__) with one end of a socketpair (the link,
services.worker.api.link) and the path of the core's private gRPC socket. Generate calls go over
the link and their tokens come back one frame per engine step; every other Worker RPC is passed
through to the core as bytes, with its metadata, deadline and status. grpc.health.v1 here
says SERVING from the start (the core starts this process once it serves) until the core
says drain. The core directs its life: SIGINT and SIGTERM are ignored here, "drain" stops the
server with the grace period and says bye, and the end of the link (the core gone) ends every
call UNAVAILABLE and exits.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import signal
import socket
import sys

import grpc
from google.rpc import status_pb2
from grpc_status import rpc_status

from services.common.errors import LorafleetError
from services.common.gen.lorafleet.v1 import worker_pb2 as wpb
from services.common.runtime import freeze_startup_objects, setup_logging
from services.common.server import (CLIENT_OPTIONS, create_server, drain, server_credentials,
                                    set_serving)
from services.common.service_auth import read_token
from services.worker.api import responses
from services.worker.api.link import (Abort, Bye, Drain, Final, Generate, Ready, Refused,
                                      StepEvents, Tokens, encode, read_message)
from services.worker.engine.sequence import Stop

log = logging.getLogger("lorafleet.worker.frontend")
SERVICE = wpb.DESCRIPTOR.services_by_name["Worker"]
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_ERROR = int(Stop.ERROR)
_DROP = (":", "grpc-")                   # metadata the transport sets, not the caller
# the channel to the core's unix socket: large messages, no keepalive pings (a local socket
# does not go half-dead, and the server would answer idle pings with GOAWAY too_many_pings)
CORE_OPTIONS = [(k, v) for k, v in CLIENT_OPTIONS if "keepalive" not in k
                and k != "grpc.http2.max_pings_without_data"]


def forwarded(context: grpc.aio.ServicerContext) -> tuple:
    """The caller's metadata, to pass on to the core (trace context, auth, ...)."""
    return tuple((k, v) for k, v in (context.invocation_metadata() or ())
                 if not k.startswith(_DROP) and k != "user-agent")


async def abort_with_status(context, status: status_pb2.Status) -> None:
    if status.details:
        await context.abort_with_status(rpc_status.to_status(status))
    await context.abort(_CODES.get(status.code, grpc.StatusCode.UNKNOWN), status.message)


async def relay_error(context, err: grpc.aio.AioRpcError) -> None:
    trailing = tuple((k, v) for k, v in (err.trailing_metadata() or ())
                     if not k.startswith(":"))
    await context.abort(err.code(), err.details() or "", trailing_metadata=trailing)


class Frontend:
    def __init__(self, writer: asyncio.StreamWriter, core: grpc.aio.Channel):
        self.writer, self.core = writer, core
        self.draining = False
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Queue] = {}

    def send(self, msg) -> None:
        if not self.writer.is_closing():
            self.writer.write(encode(msg))

    # --- the link -------------------------------------------------------------------------
    def deliver(self, step: StepEvents) -> None:
        """A step's events to their calls: each one's Tokens, then the Finals."""
        calls = self._calls
        for h, ids, text, details in zip(step.calls, step.token_ids, step.texts, step.details):
            q = calls.get(h)
            if q is not None:
                q.put_nowait(Tokens(ids, text, details))
        for final in step.finals:
            q = calls.get(final.h)
            if q is not None:
                q.put_nowait(final)

    def refuse(self, refused: Refused) -> None:
        q = self._calls.get(refused.h)
        if q is not None:
            q.put_nowait(refused)

    def core_gone(self) -> None:
        gone = status_pb2.Status(code=grpc.StatusCode.UNAVAILABLE.value[0],
                                 message="worker engine exited").SerializeToString()
        for h, q in self._calls.items():
            q.put_nowait(Refused(h, gone))

    async def drain(self, server: grpc.aio.Server, health, grace: float) -> None:
        """NOT_SERVING, refuse new calls, let those in flight finish (grace; health checks are
        answered NOT_SERVING meanwhile: services.common.server.drain), say bye."""
        self.draining = True
        await drain(server, health, grace)
        self.send(Bye())
        await self.writer.drain()

    # --- Generate -------------------------------------------------------------------------
    async def generate(self, request: bytes, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
        h = next(self._ids)
        q: asyncio.Queue = asyncio.Queue()
        self._calls[h] = q
        self.send(Generate(h, request, context.time_remaining(), forwarded(context)))
        done = False
        try:
            while True:
                item: Tokens | Final | Refused = await q.get()
                if type(item) is Tokens:
                    yield responses.token_response(*item)
                    continue
                done = True
                if type(item) is Refused:
                    await abort_with_status(context, status_pb2.Status.FromString(item.status))
                if item.stop == _ERROR:
                    await context.abort(LorafleetError.code, f"generation failed: {item.error}")
                yield responses.final_response(item)
                return
        finally:
            self._calls.pop(h, None)
            if not done:
                self.send(Abort(h))      # cancelled or past its deadline: free its row now

    # --- every other RPC: passed through as bytes ----------------------------------------
    def _unary(self, path: str):
        call = self.core.unary_unary(path)

        async def handler(request: bytes, context):
            try:
                return await call(request, timeout=context.time_remaining(),
                                  metadata=forwarded(context))
            except grpc.aio.AioRpcError as err:
                await relay_error(context, err)
        return handler

    def _stream(self, path: str):
        open_call = self.core.unary_stream(path)

        async def handler(request: bytes, context):
            call = open_call(request, timeout=context.time_remaining(),
                             metadata=forwarded(context))
            try:
                async for item in call:
                    yield item
            except grpc.aio.AioRpcError as err:
                await relay_error(context, err)
            finally:
                call.cancel()
        return handler

    def handler(self) -> grpc.GenericRpcHandler:
        methods = {}
        for m in SERVICE.methods:
            path = f"/{SERVICE.full_name}/{m.name}"
            if m.name == "Generate":
                methods[m.name] = grpc.unary_stream_rpc_method_handler(
                    self.generate,
                    response_serializer=wpb.WorkerGenerateResponse.SerializeToString)
            elif m.server_streaming:
                methods[m.name] = grpc.unary_stream_rpc_method_handler(self._stream(path))
            else:
                methods[m.name] = grpc.unary_unary_rpc_method_handler(self._unary(path))
        return grpc.method_handlers_generic_handler(SERVICE.full_name, methods)


async def main_async(args) -> int:
    sock = socket.socket(fileno=args.link_fd)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    core = grpc.aio.insecure_channel(args.core, options=CORE_OPTIONS)
    front = Frontend(writer, core)
    server, port, health = create_server(
        args.listen, lambda s: (s.add_generic_rpc_handlers((front.handler(),)),
                                [SERVICE.full_name])[1],
        server_credentials(args.tls_cert, args.tls_key, args.tls_ca), reflection=args.reflection,
        service_token=read_token(args.service_token_file))
    await server.start()
    freeze_startup_objects(log)
    await set_serving(health, True)
    front.send(Ready(port))
    draining, fatal = None, False
    while True:
        msg = await read_message(reader)
        if msg is None:                         # the core is gone (or closed after "bye")
            if draining is not None and draining.done():
                return 1 if fatal else 0        # fatal: the core's engine failed
            log.error("worker core exited: ending every call")
            front.core_gone()
            await server.stop(0.5)
            return 1
        if type(msg) is StepEvents:
            front.deliver(msg)
        elif type(msg) is Refused:
            front.refuse(msg)
        elif type(msg) is Drain and draining is None:
            fatal = msg.fatal
            draining = asyncio.get_running_loop().create_task(
                front.drain(server, health, args.grace))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m services.worker.api.frontend",
                                description="the worker's public gRPC port (started by the "
                                            "worker; not run by hand)")
    p.add_argument("--listen", required=True)
    p.add_argument("--core", required=True, help="the core's private gRPC address")
    p.add_argument("--link-fd", type=int, required=True)
    p.add_argument("--grace", type=float, default=10.0)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--tls-cert", default=None)
    p.add_argument("--tls-key", default=None)
    p.add_argument("--tls-ca", default=None)
    p.add_argument("--reflection", action="store_true")
    p.add_argument("--service-token-file", default="")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the core directs this process
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging("worker", args.log_level)
    try:
        return asyncio.run(main_async(args))
    except RuntimeError as exc:                     # e.g. the port could not be bound
        log.error("front end: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
