"""The core's end of the link to the worker's front end (see services.worker.api.link).

Each Generate call the front end takes arrives as a Generate message: it is admitted here as the
in-process servicer admits one (prompt, sampling, adapter staged and pinned), then handed to
the engine with a sink that appends its events to the current step's; after each step the
engine thread sends them as one StepEvents frame. The event loop sees a call twice (admission
and its end), never per token.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

from google.rpc import code_pb2, status_pb2
from opentelemetry import trace

from services.common import span_attrs
from services.common.errors import LorafleetError
from services.common.server import status_for
from services.common.gen.lorafleet.v1 import common_pb2, worker_pb2 as wpb
from services.common.telemetry import incoming_context, tracer
from services.worker.api import responses
from services.worker.api.link import (Abort, BlockingEnd, Bye, Drain, Final, Generate, Ready,
                                      Refused, StepEvents)
from services.worker.api.servicer import generate_attributes
from services.worker.engine.loop import TokenEvent
from services.worker.engine.sequence import Stop

log = logging.getLogger(__name__)
_tracer = tracer("lorafleet.worker")
_NONE = Stop.NONE


@dataclass(slots=True)
class _Call:
    tenant: str = ""
    task: asyncio.Task | None = None
    request_id: str = ""           # the engine's id, once submitted
    acq_key: str = ""
    span: object = None
    aborted: bool = False


class CoreLink:
    """The core's end of the link: admits the front end's calls, sends their events."""

    def __init__(self, end: BlockingEnd, servicer, loop: asyncio.AbstractEventLoop):
        self.end, self.servicer, self.loop = end, servicer, loop
        self.engine, self.manager = servicer.engine, servicer.manager
        # this step's events (engine thread only): (h, token ids, text, details) rows, Finals
        self._tokens: list[tuple] = []
        self._finals: list[Final] = []
        self._calls: dict[int, _Call] = {}    # loop only
        self.front_port: asyncio.Future = loop.create_future()
        self.closed = asyncio.Event()         # the front end said bye, or its end closed
        self.bye = False
        self._reader = threading.Thread(target=self._read, name="link-reader", daemon=True)

    def start(self) -> None:
        self.engine.flush = self.flush
        self._reader.start()

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    # --- engine thread --------------------------------------------------------------------
    def flush(self) -> None:
        """Send the step's events (called by the engine thread after each step)."""
        if self._tokens or self._finals:
            tokens, self._tokens = self._tokens, []
            finals, self._finals = self._finals, []
            self.end.send(StepEvents.of(tokens, finals))

    def _sink(self, h: int, call: _Call, cold_s: float, tier: int):
        out_of, loop, finished = self, self.loop, self._finished
        texts = self.servicer.token_texts

        def sink(ev: TokenEvent) -> None:
            details = None if ev.logprobs is None and ev.prompt_logprobs is None else \
                responses.details(ev, texts)          # (no call in the usual case)
            if ev.stop is _NONE:
                out_of._tokens.append((h, ev.token_ids, ev.text, details))
                return
            out_of._finals.append(responses.final(h, ev, cold_s, tier, details))
            loop.call_soon_threadsafe(finished, h, ev)
        return sink

    # --- reader thread --------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            msg = self.end.recv()
            if msg is None:
                break
            self.loop.call_soon_threadsafe(self._dispatch, msg)
        self.loop.call_soon_threadsafe(self._eof)

    # --- the event loop -------------------------------------------------------------------
    def _dispatch(self, msg) -> None:
        kind = type(msg)
        if kind is Generate:
            call = self._calls[msg.h] = _Call()
            call.task = self.loop.create_task(
                self._admit(msg.h, call, msg.request, msg.remaining_s, msg.metadata))
        elif kind is Abort:
            self._abort(msg.h)
        elif kind is Ready:
            if not self.front_port.done():
                self.front_port.set_result(msg.port)
        elif kind is Bye:
            self.bye = True
            self.closed.set()
        else:
            log.error("link: unknown message %r from the front end", kind.__name__)

    def _eof(self) -> None:
        if not self.front_port.done():
            self.front_port.set_result(None)
        for h in list(self._calls):
            self._abort(h)
        self.closed.set()

    async def _admit(self, h: int, call: _Call, raw: bytes, remaining, metadata) -> None:
        arrival = time.monotonic()
        acq = None
        try:
            request = wpb.WorkerGenerateRequest.FromString(raw)
            call.tenant = request.tenant
            call.span = _tracer.start_span(
                "worker.generate", context=incoming_context(metadata),
                attributes=generate_attributes(request, self.servicer.built.spec.name))
            with trace.use_span(call.span, end_on_exit=False):   # the cold load's spans
                seq, acq = await self.servicer.admit(request, arrival, remaining)
            call.acq_key = acq.key if acq else ""
            sink = self._sink(h, call, acq.seconds if acq else 0.0,
                              acq.tier if acq else common_pb2.TIER_UNSPECIFIED)
            self.engine.submit(seq, sink)
            call.request_id = seq.request_id
        except asyncio.CancelledError:          # aborted while staging its adapter
            self._end(h, call, "cancelled")
        except LorafleetError as exc:
            self._refuse(h, call, status_for(exc))
        except Exception as exc:  # noqa: BLE001 - mapped to INTERNAL, as the interceptor does
            log.exception("unhandled error in Generate", exc_info=exc)
            self._refuse(h, call, status_pb2.Status(
                code=code_pb2.INTERNAL, message=f"internal error: {type(exc).__name__}"))
        finally:
            call.task = None

    def _refuse(self, h: int, call: _Call, status: status_pb2.Status) -> None:
        self.end.send(Refused(h, status.SerializeToString()))
        self._end(h, call, "refused", status.code)

    def _end(self, h: int, call: _Call, outcome: str, code: int = code_pb2.CANCELLED) -> None:
        """code: the call's gRPC status (rpc.grpc.status_code on its span)."""
        self._calls.pop(h, None)
        if call.acq_key:
            self.manager.release(call.acq_key)
            call.acq_key = ""
        if call.span is not None:
            call.span.set_attributes({"lora.outcome": outcome, "rpc.grpc.status_code": code})
            call.span.end()

    def _finished(self, h: int, ev: TokenEvent) -> None:
        call = self._calls.get(h)
        if call is None:
            return
        if call.span is not None:
            span_attrs.genai_response(call.span, ev.stop, ev.prompt_tokens, ev.generated_tokens)
        code = {Stop.ERROR: code_pb2.INTERNAL, Stop.CANCELLED: code_pb2.CANCELLED}
        self._end(h, call, ev.stop.name, code.get(ev.stop, code_pb2.OK))
        self.servicer.metrics.finished(call.tenant, ev)

    def _abort(self, h: int) -> None:
        call = self._calls.get(h)
        if call is None or call.aborted:
            return
        call.aborted = True
        if call.request_id:
            self.engine.abort(call.request_id)  # its CANCELLED event ends it (_finished)
        elif call.task is not None:
            call.task.cancel()

    def drain(self, fatal: bool = False) -> None:
        """Tell the front end to drain; fatal: the engine failed (it exits 1, not 0)."""
        self.end.send(Drain(fatal))

    def close(self) -> None:
        self.end.close()
