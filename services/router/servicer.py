"""The public GenerationService: thin methods over the router's parts (RouterApp)."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from services.common.errors import (InvalidArgument, LorafleetError, Unavailable,
                                    from_rpc_error, with_prefix)
from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb
from services.common.gen.lorafleet.v1 import router_pb2 as rpb, router_pb2_grpc
from services.common.gen.lorafleet.v1 import worker_pb2 as wpb
from services.common import span_attrs
from services.common.names import name_error, ref_error
from services.common.telemetry import incoming_context, outgoing_metadata, traced, tracer
from services.router.auth import Tenants, require_admin
from services.router.fair_queue import FairGate
from services.router.limits import DEFAULT_MAX_PROMPT_BYTES, check_prompt_size
from services.router.generate import RequestPath
from services.router.hot_set import HotSet
from services.router.quotas import Quotas
from services.router.resolve import Resolver
from services.router.stats import QUEUED, RouterStats
from services.router.stats_view import build_stats
from services.router import tools
from services.router.workers import WorkerSet

log = logging.getLogger(__name__)
_tracer = tracer("lorafleet.router")
MAX_BATCH = 256                  # requests in one GenerateBatch call


@dataclass
class RouterApp:
    tenants: Tenants
    quotas: Quotas
    gate: FairGate
    resolver: Resolver
    workers: WorkerSet
    store: object           # AdapterStoreStub
    stats: RouterStats
    per_worker: int             # requests forwarded per live worker before the gate holds them
    spill_rows: int = 32        # placement: an adapter's rows on one worker before it spills
    foothold_per_worker: int = 1   # gate slots past per_worker for tenants with none in flight
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES   # --max-prompt-bytes (limits.py)
    worker_wait: float = 30.0   # --worker-wait: how long a request waits for a live worker
    hot: HotSet | None = None   # the fleet's hot adapters (hot_set.py; None: not kept)


async def _store_call(coro):
    try:
        return await coro
    except grpc.RpcError as err:
        raise from_rpc_error(err) from None


class GenerationServicer(router_pb2_grpc.GenerationServiceServicer):
    def __init__(self, app: RouterApp):
        self.app = app
        self.path = RequestPath(app)
        self.tool_formats = tools.ToolFormats(app.workers, app.worker_wait)

    def _caller(self, context):
        return self.app.tenants.authenticate(context.invocation_metadata())

    async def GenerateStream(self, request, context):
        responses = self._generate(request, context, unary=False)
        try:
            async for resp in responses:
                yield resp
        finally:            # closed here, however this one is closed (the HTTP gateway's,
            await responses.aclose()    # at the last message): the request is settled now

    async def _generate(self, request, context, unary: bool):
        """Admit, then stream from a worker; unary (Generate) sends the client nothing before
        the end, which lets the request path retry a worker lost mid-generation."""
        caller = self._caller(context)
        parent = incoming_context(context.invocation_metadata())
        span = _tracer.start_span("router.generate", context=parent, attributes={
            **span_attrs.rpc("GenerationService", "Generate" if unary else "GenerateStream"),
            **span_attrs.genai_request("chat" if request.messages else "text_completion",
                                       request.adapter_id or "base"),
            "gen_ai.request.max_tokens": request.stopping.max_new_tokens,
            "gen_ai.request.temperature": request.sampling.temperature,
            "lora.tenant": caller.tenant, "lora.adapter_id": request.adapter_id})
        try:             # the span is current only around non-yielding parts (traced)
            with span_attrs.grpc_status(span, context):
                with trace.use_span(span, end_on_exit=False):
                    self._resize_gate()
                    fmt = await self._tools(request, caller)
                    adm = await self.path.admit(request, caller, context.time_remaining())
                span.set_attribute("gen_ai.request.id", adm.request_id)
                stream = self.path.stream(request, adm, context, unary)
                if fmt is not None:                 # calls parsed out of the text
                    stream = tools.parsed(stream, fmt)
                async for resp in traced(span, stream):
                    span_attrs.genai_last(span, resp)
                    yield resp
        finally:
            span.end()

    async def _tools(self, request, caller) -> str | None:
        """The request's tools checked and a required call's grammar added (services.router.
        tools); the format to parse the reply in. A refusal counts as the admission's do."""
        if not request.tools and not request.tool_choice.mode:
            return None
        try:
            return await tools.prepare(request, self.tool_formats)
        except LorafleetError as err:
            self.app.stats.refuse(caller.tenant, err.code.name)
            raise

    async def Generate(self, request, context):
        out = rpb.GenerateResponse()
        text = []
        async for resp in self._generate(request, context, unary=True):
            out.token_ids.extend(resp.token_ids)
            out.tokens.extend(resp.tokens)
            out.prompt_tokens.extend(resp.prompt_tokens)
            out.tool_calls.extend(resp.tool_calls)
            text.append(resp.text)
            if resp.stop_reason:
                out.stop_reason = resp.stop_reason
                out.usage.CopyFrom(resp.usage)
                out.timings.CopyFrom(resp.timings)
                out.request_id = resp.request_id
                out.adapter_id, out.adapter_version = resp.adapter_id, resp.adapter_version
        out.text = "".join(text)
        return out

    async def GenerateBatch(self, request, context):
        """Each request as its own Generate, concurrently; the responses in order. A refusal
        names the request's index and cancels the others."""
        if len(request.requests) > MAX_BATCH:
            raise InvalidArgument(f"requests: at most {MAX_BATCH} a call")

        async def one(i: int, req):
            try:
                return await self.Generate(req, context)
            except LorafleetError as err:
                raise with_prefix(err, f"requests[{i}]: ") from None
        tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(request.requests)]
        try:
            return rpb.GenerateBatchResponse(responses=await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()

    def _resize_gate(self) -> None:
        live = max(1, len(self.app.workers.live()))
        self.app.gate.set_max_concurrency(live * self.app.per_worker,
                                          live * self.app.foothold_per_worker)
        QUEUED.set(self.app.gate.waiting)

    def _any_worker(self):
        live = list(self.app.workers.live().values())
        if not live:
            raise Unavailable("no worker available")
        return live[0]

    async def Tokenize(self, request, context):
        self._caller(context)
        check_prompt_size(self.app.max_prompt_bytes, request.text, request.messages)
        w = self._any_worker()
        resp = await _store_call(w.stub.Tokenize(wpb.WorkerTokenizeRequest(
            text=request.text, messages=request.messages, tools=request.tools), timeout=10))
        return rpb.TokenizeResponse(token_ids=resp.token_ids, tokens=resp.tokens)

    async def Detokenize(self, request, context):
        self._caller(context)
        check_prompt_size(self.app.max_prompt_bytes, token_ids=request.token_ids)
        resp = await _store_call(self._any_worker().stub.Detokenize(
            wpb.WorkerDetokenizeRequest(token_ids=request.token_ids), timeout=10))
        return rpb.DetokenizeResponse(text=resp.text)

    async def base_model_name(self) -> str:
        """The served model's name, from any worker (no caller: the HTTP gateway's own use)."""
        info = await _store_call(self._any_worker().stub.Info(wpb.WorkerInfoRequest(), timeout=10))
        return info.model_name

    async def ModelInfo(self, request, context):
        """The served model, from any worker; the largest LoRA rank is the store's (it refuses
        larger adapters at Register: --max-rank), from its last Stats reply (poll_store_stats),
        so a store outage does not fail this call."""
        self._caller(context)
        info = await _store_call(self._any_worker().stub.Info(wpb.WorkerInfoRequest(), timeout=10))
        store = self.app.stats.store_snapshot
        return rpb.ModelInfoResponse(
            model_name=info.model_name, architecture=info.architecture,
            vocab_size=info.vocab_size, max_sequence_length=info.max_sequence_length,
            hidden_size=info.hidden_size, num_layers=info.num_layers, dtype=info.dtype,
            max_lora_rank=(store.max_rank if store is not None else 0) or info.max_lora_rank,
            num_workers=len(self.app.workers.live()), has_chat_template=info.has_chat_template,
            tool_call_format=info.tool_call_format)

    async def ListAdapters(self, request, context):
        """One page of the store's listing for the caller's tenant (the store checks the page
        size, filters and token, bound to the tenant): a page is never more than the store's
        page, however large the registry. An admin (not dev mode's) who names an owner lists
        that tenant's adapters, private ones included."""
        caller = self._caller(context)
        resp = await _store_call(self.app.store.List(
            spb.ListRequest(tenant=caller.tenant, page_size=request.page_size,
                            page_token=request.page_token, owner=request.owner,
                            prefix=request.prefix,
                            all_tenants=self._sees_all(caller) and bool(request.owner)),
            timeout=10, metadata=outgoing_metadata()))
        return rpb.ListAdaptersResponse(adapters=resp.adapters,
                                        next_page_token=resp.next_page_token)

    async def ListAdapterVersions(self, request, context):
        """The store's kept versions of one adapter as the caller sees it (an admin: any)."""
        caller = self._caller(context)
        message = name_error("adapter_id", request.adapter_id)
        if message is not None:
            raise InvalidArgument(message)
        return await _store_call(self.app.store.Versions(
            spb.VersionsRequest(id=request.adapter_id, tenant=caller.tenant,
                                all_tenants=self._sees_all(caller)),
            timeout=10, metadata=outgoing_metadata()))

    def _sees_all(self, caller) -> bool:
        """An admin of the --tenants file sees every tenant's adapters when it asks; in dev
        mode, where every caller may manage adapters, a caller sees as its tenant (the token
        names any tenant there)."""
        return caller.admin and not self.app.tenants.dev_mode

    async def RegisterAdapter(self, request, context):
        caller = self._caller(context)
        require_admin(caller)
        for field, value, empty_ok in (("id", request.id, False),
                                       ("tenant", request.tenant, True),
                                       *(("aliases", a, False) for a in request.aliases)):
            message = name_error(field, value, empty_ok)   # named as the public API names them
            if message is not None:
                raise InvalidArgument(message)
        parent = incoming_context(context.invocation_metadata())
        with _tracer.start_as_current_span("router.register", context=parent) as span, \
                span_attrs.grpc_status(span, context):
            span.set_attributes({**span_attrs.rpc("GenerationService", "RegisterAdapter"),
                                 "lora.tenant": caller.tenant, "lora.adapter_id": request.id,
                                 "lora.owner": request.tenant, "lora.source": request.source})
            # replace: a new version of an existing id, the aliases given moving to it (the
            # store moves them atomically): cached resolutions are stale after it.
            resp = await _store_call(self.app.store.Register(
                spb.RegisterRequest(id=request.id, source=request.source, owner=request.tenant,
                                    aliases=request.aliases, replace=request.replace),
                timeout=context.time_remaining() or 60, metadata=outgoing_metadata()))
        self.app.resolver.invalidate(request.id, *request.aliases)   # the names it touched
        log.info("tenant %s registered adapter %s from %s", caller.tenant, request.id,
                 request.source)
        return rpb.RegisterAdapterResponse(adapter=resp.adapter)

    async def DeleteAdapter(self, request, context):
        caller = self._caller(context)
        require_admin(caller)
        await _store_call(self.app.store.Delete(spb.DeleteRequest(id=request.id), timeout=10,
                                                metadata=outgoing_metadata()))
        self.app.resolver.invalidate(request.id)     # the id and every alias resolving to it
        if self.app.hot is not None:
            self.app.hot.forget(request.id)
        return rpb.DeleteAdapterResponse()

    async def SetAlias(self, request, context):
        """Admins: the store points the alias at the target (an id or ID@VERSION: a rollback);
        cached resolutions are stale after it."""
        require_admin(self._caller(context))
        for field, value, check in (("alias", request.alias, name_error),
                                    ("target", request.target, ref_error)):
            message = check(field, value)
            if message is not None:
                raise InvalidArgument(message)
        resp = await _store_call(self.app.store.SetAlias(
            rpb.SetAliasRequest(alias=request.alias, target=request.target), timeout=10,
            metadata=outgoing_metadata()))
        self.app.resolver.invalidate(request.alias)  # in every owner scope; other names stay
        log.info("alias %s -> %s (version %s)", request.alias, request.target,
                 resp.adapter.version)
        return resp

    async def GetStats(self, request, context):
        caller = self._caller(context)
        out = await build_stats(self.app)
        if not caller.admin:         # (a --tenants file's user) its own row; fleet figures stay
            mine = [t for t in out.tenants if t.tenant == caller.tenant]
            del out.tenants[:]
            out.tenants.extend(mine)
        return out
