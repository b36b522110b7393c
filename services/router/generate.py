"""The request path: authenticate, resolve, quota, fair queue, place, forward, stream back.

A worker lost before the first token means one retry on another worker; after it, the stream
ends with UNAVAILABLE and nothing is duplicated. A client cancel cancels the worker call, which
frees the row and its KV blocks there.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import grpc

from services.common.errors import (InvalidArgument, LorafleetError, ResourceExhausted,
                                    Unavailable, from_rpc_error)
from services.common.gen.lorafleet.v1 import router_pb2, worker_pb2 as wpb
from services.common.telemetry import outgoing_metadata, tracer
from services.router.auth import Caller
from services.router.placement import NoWorker, choose_worker

log = logging.getLogger(__name__)
_tracer = tracer("lorafleet.router")
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
             grpc.StatusCode.UNKNOWN)


@dataclass
class Admitted:
    caller: Caller
    adapter: router_pb2.AdapterInfo | None
    est_tokens: int
    request_id: str


def validate(req: router_pb2.GenerateRequest) -> None:
    s, st = req.sampling, req.stopping
    if not req.text and not req.prompt_token_ids:
        raise InvalidArgument("text: empty prompt (give text or prompt_token_ids)")
    if s.temperature < 0 or s.temperature > 100:
        raise InvalidArgument("sampling.temperature: must be within [0, 100]")
    if not 0 <= s.top_p <= 1:
        raise InvalidArgument("sampling.top_p: must be within [0, 1]")
    if s.repetition_penalty < 0:
        raise InvalidArgument("sampling.repetition_penalty: must be >= 0")
    if any(len(x) > 256 for x in st.stop_sequences) or len(st.stop_sequences) > 16:
        raise InvalidArgument("stopping.stop_sequences: at most 16, each at most 256 chars")
    if len(req.request_id) > 128:
        raise InvalidArgument("request_id: at most 128 characters")


class RequestPath:
    def __init__(self, app):
        self.app = app   # services.router.servicer.RouterApp: tenants, quotas, gate, ...

    async def admit(self, req, caller: Caller, timeout: float | None) -> Admitted:
        validate(req)
        app = self.app
        adapter = None
        if req.adapter_id:
            adapter = await app.resolver.resolve(req.adapter_id, caller.tenant, timeout)
            app.stats.saw_adapter(adapter.id)
        est = len(req.prompt_token_ids) or max(1, len(req.text) // 4)
        est += req.stopping.max_new_tokens or 64
        wait = app.quotas.check(caller.tenant, est)
        if wait is not None:
            app.stats.throttle(caller.tenant)
            raise ResourceExhausted(f"tenant {caller.tenant!r} is over its quota; retry in "
                                    f"{wait:.2f}s", retry_after=wait)
        return Admitted(caller, adapter, est, req.request_id or uuid.uuid4().hex[:16])

    async def stream(self, req, adm: Admitted, context):
        """Yield GenerateResponse messages; the caller has already admitted the request."""
        app = self.app
        start = time.monotonic()
        tokens = prompt_tokens = 0
        status = "OK"
        self._prefetch(adm)
        ticket = await app.gate.acquire(adm.caller.tenant, adm.est_tokens)
        try:
            async for resp in self._forward(req, adm, context):
                tokens += len(resp.token_ids)
                app.gate.progress(ticket, len(resp.token_ids))
                if resp.HasField("usage"):
                    prompt_tokens = resp.usage.prompt_tokens
                    resp.timings.queue_s += ticket.queue_seconds
                yield resp
        except LorafleetError as err:
            status = err.code.name
            raise
        except asyncio.CancelledError:
            status = "CANCELLED"
            raise
        finally:
            app.gate.release(ticket, prompt_tokens, tokens)
            app.quotas.release(adm.caller.tenant, adm.est_tokens, prompt_tokens + tokens)
            app.stats.record(adm.caller.tenant, time.monotonic() - start, tokens, prompt_tokens,
                             status)

    def _prefetch(self, adm: Admitted) -> None:
        """Hint the likely worker at admission so staging overlaps the queue wait."""
        if adm.adapter is None:
            return
        try:
            addr = choose_worker(adm.adapter.id, self.app.workers.views())
        except NoWorker:
            return
        worker = self.app.workers.workers.get(addr)
        if worker is None or adm.adapter.id in worker.view().resident:
            return
        ref = self._ref(adm)
        task = asyncio.get_running_loop().create_task(
            worker.stub.Prefetch(wpb.PrefetchRequest(adapters=[ref]), timeout=2.0))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _ref(self, adm: Admitted) -> wpb.AdapterRef:
        a = adm.adapter
        return wpb.AdapterRef(id=a.id, version=a.version, tenant=adm.caller.tenant,
                              owner=a.owner)

    async def _forward(self, req, adm: Admitted, context):
        tried: set[str] = set()
        wreq = wpb.WorkerGenerateRequest(
            request_id=adm.request_id, prompt_token_ids=req.prompt_token_ids, text=req.text,
            sampling=req.sampling, stopping=req.stopping, tenant=adm.caller.tenant)
        if adm.adapter is not None:
            wreq.adapter.CopyFrom(self._ref(adm))
        for attempt in range(2):
            addr = self._choose(adm, tried)
            tried.add(addr)
            started = False
            call = self.app.workers.workers[addr].stub.Generate(
                wreq, timeout=context.time_remaining(), metadata=outgoing_metadata())
            try:
                async for wresp in call:
                    started = True
                    yield self._response(wresp, adm)
                return
            except grpc.RpcError as err:
                if started or attempt == 1 or err.code() not in RETRYABLE:
                    if started and err.code() in RETRYABLE:
                        raise Unavailable(f"worker {addr} lost mid-stream: {err.details()}")
                    raise from_rpc_error(err) from None
                log.warning("worker %s failed before the first token (%s); retrying elsewhere",
                            addr, err.code().name)
            finally:
                call.cancel()

    def _choose(self, adm: Admitted, tried: set[str]) -> str:
        try:
            return choose_worker(adm.adapter.id if adm.adapter else None,
                                 self.app.workers.views(), exclude=tried)
        except NoWorker as err:
            raise Unavailable(f"no worker available: {err}") from None

    @staticmethod
    def _response(w: wpb.WorkerGenerateResponse, adm: Admitted) -> router_pb2.GenerateResponse:
        out = router_pb2.GenerateResponse(token_ids=w.token_ids, text=w.text,
                                          stop_reason=w.stop_reason, request_id=adm.request_id)
        if w.HasField("usage"):
            out.usage.CopyFrom(w.usage)
            out.timings.CopyFrom(w.timings)
            if adm.adapter is not None:
                out.adapter_id, out.adapter_version = adm.adapter.id, adm.adapter.version
        return out
