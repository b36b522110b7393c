"""The request path: authenticate, resolve, quota, fair queue, place, forward, stream back.

A worker lost before the first token means one retry on another worker; after it, the stream
ends with UNAVAILABLE and nothing is duplicated (tokens already sent are never sent again). A
unary Generate sends nothing before its end, so a worker lost mid-generation (UNAVAILABLE, the
connection gone) is retried once on another worker too. A client cancel cancels the worker
call, which frees the row and its KV blocks there. A worker that reports the adapter version it
was sent is no longer the store's (FAILED_PRECONDITION: an alias or id moved under us) makes the
router resolve the name again and retry once. When no attempt is left, the client gets the
failure's own cause (services/router/attempts.py), not "no worker".
"""
from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import uuid
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from services.common.errors import (InvalidArgument, LorafleetError, ResourceExhausted,
                                    Unavailable, from_rpc_error)
from services.common.gen.lorafleet.v1 import router_pb2, worker_pb2 as wpb
from services.common.names import ref_error
from services.common.telemetry import outgoing_metadata
from services.router.attempts import RETRYABLE, AttemptFailed, cause, retryable
from services.router.auth import Caller
from services.router.limits import check_prompt_size
from services.router.placement import NoWorker, choose_worker

log = logging.getLogger(__name__)
DEFAULT_NEW_TOKENS = 64     # the worker's default when max_new_tokens is 0 (for estimates)
WAIT_MARGIN_S = 0.25        # a wait for a live worker ends this long before the deadline


@dataclass
class Admitted:
    caller: Caller
    adapter: router_pb2.AdapterInfo | None
    prompt_estimate: int        # prompt tokens (text: about 4 characters a token)
    est_tokens: int             # prompt + max new tokens: what the token quota is charged
    request_id: str
    name: str = ""              # the adapter name as the client gave it (id or alias)


def validate(req: router_pb2.GenerateRequest, max_prompt_bytes: int = 0) -> None:
    """INVALID_ARGUMENT naming the public request's field (NaN fails every range check; a
    prompt over max_prompt_bytes: services/router/limits.py)."""
    s, st = req.sampling, req.stopping
    message = ref_error("adapter_id", req.adapter_id, allow_empty=True)
    if message is not None:
        raise InvalidArgument(message)
    if req.messages and (req.text or req.prompt_token_ids):
        raise InvalidArgument("messages: give messages, text or prompt_token_ids, not several")
    if not req.text and not req.prompt_token_ids and not req.messages:
        raise InvalidArgument("text: empty prompt (give text, prompt_token_ids or messages)")
    check_prompt_size(max_prompt_bytes, req.text, req.messages, req.prompt_token_ids)
    if not 0 <= s.temperature <= 100:
        raise InvalidArgument("sampling.temperature: must be within [0, 100]")
    if not 0 <= s.top_p <= 1:
        raise InvalidArgument("sampling.top_p: must be within [0, 1]")
    if not (math.isfinite(s.repetition_penalty) and s.repetition_penalty >= 0):
        raise InvalidArgument("sampling.repetition_penalty: must be finite and >= 0")
    if any(len(x) > 256 for x in st.stop_sequences) or len(st.stop_sequences) > 16:
        raise InvalidArgument("stopping.stop_sequences: at most 16, each at most 256 chars")
    if len(req.request_id) > 128:
        raise InvalidArgument("request_id: at most 128 characters")


class RequestPath:
    def __init__(self, app):
        self.app = app   # services.router.servicer.RouterApp: tenants, quotas, gate, ...
        self._hints: set[asyncio.Task] = set()

    async def admit(self, req, caller: Caller, timeout: float | None) -> Admitted:
        """Validate, resolve the adapter and take the tenant's quota (RESOURCE_EXHAUSTED with a
        retry delay when over it); the caller must then run `stream`, which gives it back.
        A refusal is counted in the tenant's requests under its status (`stream` counts the
        rest), so the request counts and the fairness index see refused tenants too."""
        started = time.monotonic()
        try:
            return await self._admit(req, caller, timeout)
        except LorafleetError as err:
            self.app.stats.refuse(caller.tenant, err.code.name)
            raise
        except asyncio.CancelledError:
            self.app.stats.refuse(caller.tenant, _ended(None, timeout, started))
            raise

    async def _admit(self, req, caller: Caller, timeout: float | None) -> Admitted:
        validate(req, self.app.max_prompt_bytes)
        app = self.app
        adapter = None
        if req.adapter_id:
            adapter = await app.resolver.resolve(req.adapter_id, caller.tenant, timeout)
            app.stats.saw_adapter(adapter.id)
            if app.hot is not None:
                app.hot.saw(wpb.AdapterRef(id=adapter.id, version=adapter.version,
                                           tenant=caller.tenant, owner=adapter.owner,
                                           pinned=adapter.pinned))
        chars = len(req.text) + sum(len(m.content) + 8 for m in req.messages)
        prompt = len(req.prompt_token_ids) or max(1, chars // 4)
        est = prompt + (req.stopping.max_new_tokens or DEFAULT_NEW_TOKENS)
        wait = app.quotas.check(caller.tenant, est)
        if wait is not None:
            app.stats.throttle(caller.tenant)
            raise ResourceExhausted(f"tenant {caller.tenant!r} is over its quota; retry in "
                                    f"{wait:.2f}s", retry_after=wait)
        return Admitted(caller, adapter, prompt, est, req.request_id or uuid.uuid4().hex[:16],
                        req.adapter_id)

    async def stream(self, req, adm: Admitted, context, unary: bool = False):
        """Yield GenerateResponse messages; the caller has already admitted the request.
        unary: the caller sends nothing before the end (Generate), so a worker lost
        mid-generation may be retried (see _forward)."""
        app = self.app
        start = time.monotonic()
        tokens = prompt_tokens = 0
        status = "OK"
        ticket = None
        first_token = queue_s = None     # when the first token came; the request's queue time
        finished = False                # the last message (stop_reason set) was handed on
        try:
            if app.gate.would_wait(adm.caller.tenant):
                self._prefetch(adm)     # it will queue: let the worker stage meanwhile
            ticket = await app.gate.acquire(adm.caller.tenant, adm.prompt_estimate)
            charge = functools.partial(app.gate.progress, ticket)   # settled at release
            async for resp in self._forward(req, adm, context, unary, charge):
                tokens += len(resp.token_ids)
                if first_token is None and resp.token_ids:
                    first_token = time.monotonic()
                if resp.HasField("usage"):
                    prompt_tokens = resp.usage.prompt_tokens
                    resp.timings.queue_s += ticket.queue_seconds
                    queue_s = resp.timings.queue_s
                    app.stats.cold_load(resp.timings)
                finished = resp.stop_reason != 0
                yield resp
        except LorafleetError as err:
            status = err.code.name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # a consumer that stops once it has the last message (the HTTP gateway) closes
            # the stream: that request succeeded
            if not finished:
                status = _ended(context)
            raise
        finally:
            if ticket is not None:
                app.gate.release(ticket, prompt_tokens, tokens)
            app.quotas.release(adm.caller.tenant, adm.est_tokens, prompt_tokens + tokens)
            app.stats.record(adm.caller.tenant, time.monotonic() - start, tokens, prompt_tokens,
                             status, ttft_s=None if first_token is None else first_token - start,
                             queue_s=queue_s)

    def _prefetch(self, adm: Admitted) -> None:
        """Hint the likely worker so staging overlaps the wait in the fair queue."""
        if adm.adapter is None:
            return
        try:
            addr = self._place(adm, set())
        except Unavailable:
            return
        worker = self.app.workers.workers.get(addr)
        if worker is None or worker.view().holds(adm.adapter.id):
            return
        request = wpb.PrefetchRequest(adapters=[self._ref(adm)])
        metadata = outgoing_metadata()

        async def hint() -> None:
            try:
                await worker.stub.Prefetch(request, timeout=2.0, metadata=metadata)
            except grpc.RpcError:
                pass            # only a hint: the request itself stages the adapter
        task = asyncio.get_running_loop().create_task(hint())
        self._hints.add(task)
        task.add_done_callback(self._hints.discard)

    def _ref(self, adm: Admitted) -> wpb.AdapterRef:
        a = adm.adapter
        return wpb.AdapterRef(id=a.id, version=a.version, tenant=adm.caller.tenant,
                              owner=a.owner, pinned=a.pinned)

    def _worker_request(self, req, adm: Admitted) -> wpb.WorkerGenerateRequest:
        wreq = wpb.WorkerGenerateRequest(
            request_id=adm.request_id, prompt_token_ids=req.prompt_token_ids, text=req.text,
            sampling=req.sampling, stopping=req.stopping, tenant=adm.caller.tenant,
            messages=req.messages, response=req.response,
            tools=req.tools if req.tool_choice.mode != req.tool_choice.NONE else ())
        if adm.adapter is not None:
            wreq.adapter.CopyFrom(self._ref(adm))
        return wreq

    async def _forward(self, req, adm: Admitted, context, unary: bool, charge):
        """Stream from one worker; one more attempt after a failure that sent the client
        nothing (attempts.retryable): elsewhere after a lost worker, anywhere after a moved
        version. Out of attempts, or with no other worker, the client gets the failure's own
        cause."""
        await self._await_worker(context)
        tried: set[str] = set()
        failed: AttemptFailed | None = None
        span = trace.get_current_span()
        for attempt in range(2):
            try:
                addr = self._place(adm, tried)
            except Unavailable:
                if failed is None:
                    raise
                raise await self._cause(failed, adm, context) from None   # nowhere to retry
            tried.add(addr)
            span.set_attribute("lora.worker", addr)
            try:
                async for resp in self._attempt(addr, req, adm, context, unary, charge):
                    yield resp
                return
            except AttemptFailed as lost:
                failed = lost
            if (not failed.started and attempt == 0
                    and await self._version_moved(failed.error, adm, context)):
                tried.discard(addr)
                continue
            if attempt == 1 or not retryable(failed, unary, context):
                raise await self._cause(failed, adm, context) from None
            code = failed.error.code().name
            span.add_event("retry", {"lora.worker": addr, "grpc.code": code})
            log.warning("worker %s failed %s (%s: %s); retrying elsewhere", addr,
                        "mid-generation" if failed.started else "before the first token", code,
                        failed.error.details())

    async def _await_worker(self, context) -> None:
        """A request that finds no live worker (the fleet is starting, or every worker is
        restarting) waits for one, --worker-wait seconds at most and within its deadline,
        woken by the residency stream that brings a worker live; UNAVAILABLE after that."""
        if self.app.workers.live():
            return
        remaining = context.time_remaining()      # ends a little before the deadline, so
        bound = self.app.worker_wait if remaining is None else min(    # the client learns why
            self.app.worker_wait, max(0.0, remaining - WAIT_MARGIN_S))
        if not await self.app.workers.wait_live(bound):
            raise Unavailable(f"no worker available: no live worker within {bound:.1f}s")

    async def _attempt(self, addr: str, req, adm: Admitted, context, unary: bool, charge):
        """One worker's answer, its tokens charged to the fair queue as they come (charge(n)).
        Unary: gathered whole before any of it is yielded, so a worker lost mid-generation has
        sent the client nothing and may be retried."""
        answer = []
        async for resp in self._call(addr, self._worker_request(req, adm), adm, context):
            charge(len(resp.token_ids))
            if unary:
                answer.append(resp)
            else:
                yield resp
        for resp in answer:
            yield resp

    async def _call(self, addr: str, wreq, adm: Admitted, context):
        """One worker call. A failure before any message, or a lost worker (RETRYABLE) after
        one, raises AttemptFailed; anything else after the first message is relayed."""
        worker = self.app.workers.workers[addr]
        adapter_id = adm.adapter.id if adm.adapter else None
        cold = adapter_id is not None and adapter_id not in worker.view().resident
        started = False
        worker.begin(adapter_id)
        call = worker.stub.Generate(wreq, timeout=context.time_remaining(),
                                    metadata=outgoing_metadata())
        try:
            async for wresp in call:
                started = True
                yield self._response(wresp, adm)
        except grpc.RpcError as err:
            if not started or err.code() in RETRYABLE:
                raise AttemptFailed(err, addr, started, cold) from None
            raise from_rpc_error(err) from None
        finally:
            call.cancel()           # a no-op when done; on a client cancel it reaches the worker
            worker.end(adapter_id)

    async def _cause(self, failed: AttemptFailed, adm: Admitted, context) -> LorafleetError:
        """The client's error for the last failed attempt (the store is probed after a failed
        cold load, to name it when it is down)."""
        adapter_id = adm.adapter.id if adm.adapter else None
        return await cause(failed, adapter_id, self.app.store, context)

    async def _version_moved(self, err: grpc.RpcError, adm: Admitted, context) -> bool:
        """After FAILED_PRECONDITION: resolve the name again; True (adm updated) if it moved."""
        if err.code() != grpc.StatusCode.FAILED_PRECONDITION or adm.adapter is None:
            return False
        self.app.resolver.invalidate(adm.name)
        self.app.resolver.invalidate(adm.adapter.id)
        fresh = await self.app.resolver.resolve(adm.name, adm.caller.tenant,
                                                context.time_remaining())
        if (fresh.id, fresh.version) == (adm.adapter.id, adm.adapter.version):
            return False
        log.info("adapter %s moved from %s@%s to %s@%s; retrying", adm.name, adm.adapter.id,
                 adm.adapter.version, fresh.id, fresh.version)
        adm.adapter = fresh
        return True

    def _place(self, adm: Admitted, tried: set[str]) -> str:
        try:
            return choose_worker(adm.adapter.id if adm.adapter else None,
                                 self.app.workers.views(), exclude=tried,
                                 spill_rows=self.app.spill_rows,
                                 load_floor=self.app.spill_rows)
        except NoWorker as err:
            raise Unavailable(f"no worker available: {err}") from None

    @staticmethod
    def _response(w: wpb.WorkerGenerateResponse, adm: Admitted) -> router_pb2.GenerateResponse:
        out = router_pb2.GenerateResponse(token_ids=w.token_ids, text=w.text, tokens=w.tokens,
                                          prompt_tokens=w.prompt_tokens,
                                          stop_reason=w.stop_reason, request_id=adm.request_id)
        if w.HasField("usage"):
            out.usage.CopyFrom(w.usage)
            out.timings.CopyFrom(w.timings)
            if adm.adapter is not None:
                out.adapter_id, out.adapter_version = adm.adapter.id, adm.adapter.version
        return out


def _ended(context, timeout: float | None = None, started: float = 0.0) -> str:
    """The status of a request the server cancelled: DEADLINE_EXCEEDED when its deadline had
    passed (gRPC cancels the handler then too), else CANCELLED (the client went away)."""
    if context is not None:
        left = context.time_remaining()
    else:
        left = None if timeout is None else timeout - (time.monotonic() - started)
    return "DEADLINE_EXCEEDED" if left is not None and left <= 0 else "CANCELLED"
