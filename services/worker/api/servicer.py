"""The Worker gRPC servicer: proto in, domain calls, proto out."""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import hashlib
import itertools
import math
import random
import threading
import time


from services.common import span_attrs
from services.common.errors import InvalidArgument, LorafleetError, Unavailable
from services.common.names import name_error
from services.common.gen.lorafleet.v1 import common_pb2, worker_pb2 as wpb, worker_pb2_grpc
from services.common.telemetry import incoming_context, traced, tracer
from services.worker import metrics
from services.worker.adapters.manager import AdapterManager
from services.worker.adapters.state import Acquired
from services.worker.adapters.warm import WarmQueue
from services.worker.api import responses, structured
from services.worker.api.chat_template import (ChatTemplate, check_messages, check_tools,
                                               fallback as chat_fallback)
from services.worker.api.responses import TokenTexts
from services.worker.config import WorkerConfig
from services.worker.engine.loop import TokenEvent
from services.worker.engine.sequence import Sampling, Sequence, Stop, Stopping
from services.worker.engine.step_profile import StepProfile
from services.worker.startup.factory import Built

_tracer = tracer("lorafleet.worker")
_ids = itertools.count()


MAX_TOP_N = 20                 # the most alternatives a token's details carry (as OpenAI's)


def sampling_from(p: common_pb2.SamplingParams,
                  stopping: common_pb2.StoppingCriteria | None = None,
                  response: common_pb2.ResponseOptions | None = None,
                  vocab: int = 1 << 32) -> Sampling:
    """A request's Sampling (its min_new_tokens and token details included), checked."""
    stopping = stopping or common_pb2.StoppingCriteria()
    response = response or common_pb2.ResponseOptions()
    if not (math.isfinite(p.temperature) and p.temperature >= 0 and 0 <= p.top_p <= 1
            and math.isfinite(p.repetition_penalty) and p.repetition_penalty >= 0):
        raise InvalidArgument("sampling: finite temperature >= 0, 0 <= top_p <= 1 and finite "
                              "repetition_penalty >= 0 are required")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(p, name) <= 2:
            raise InvalidArgument(f"sampling.{name}: must be within [-2, 2]")
    for token, bias in p.logit_bias.items():
        if token >= vocab or not -100 <= bias <= 100:
            raise InvalidArgument(f"sampling.logit_bias: token {token} bias {bias}: tokens "
                                  f"below {vocab}, biases within [-100, 100]")
    if response.top_n_tokens > MAX_TOP_N:
        raise InvalidArgument(f"response.top_n_tokens: at most {MAX_TOP_N}")
    if stopping.min_new_tokens > (stopping.max_new_tokens or stopping.min_new_tokens):
        raise InvalidArgument("stopping.min_new_tokens: above max_new_tokens")
    logprobs = response.top_n_tokens if response.token_logprobs or response.top_n_tokens else -1
    prompt_logprobs = response.top_n_tokens if response.prompt_logprobs else -1
    seed = p.seed & ((1 << 63) - 1) if p.seed else random.getrandbits(62) + 1
    return Sampling(p.temperature, p.top_k, p.top_p or 1.0, seed, p.repetition_penalty or 1.0,
                    p.presence_penalty, p.frequency_penalty,
                    tuple(sorted((int(t), float(b)) for t, b in p.logit_bias.items())),
                    stopping.min_new_tokens, logprobs, prompt_logprobs)


def generate_attributes(request: wpb.WorkerGenerateRequest, model: str) -> dict:
    """worker.generate's attributes at its start (RPC and GenAI conventions, lora.*)."""
    return {**span_attrs.rpc("Worker", "Generate"),
            **span_attrs.genai_request("chat" if request.messages else "text_completion",
                                       request.adapter.id or model),
            "gen_ai.request.id": request.request_id, "lora.adapter_id": request.adapter.id,
            "lora.tenant": request.tenant}


def stopping_from(s: common_pb2.StoppingCriteria, cfg: WorkerConfig) -> Stopping:
    n = s.max_new_tokens or cfg.max_new_tokens
    if n > cfg.max_new_tokens_limit:
        raise InvalidArgument(f"stopping.max_new_tokens: {n} is above the limit "
                              f"{cfg.max_new_tokens_limit}")
    return Stopping(n, tuple(x for x in s.stop_sequences if x), s.time_limit_ms / 1000.0,
                    s.ignore_eos)


class EventHandoff:
    """Hands calls from the engine thread to an event loop with one loop wake-up per burst.

    loop.call_soon_threadsafe costs several microseconds a call (a Handle and a write to the
    loop's self-pipe, each time); an engine step makes one call per row. put() queues the call
    and wakes the loop only when no wake-up is pending, so a step's rows share one; the loop
    then makes the queued calls in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._calls: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._armed = False                  # a _drain is scheduled and has not started

    def put(self, fn, arg) -> None:
        """Call fn(arg) on the loop (any thread)."""
        self._calls.append((fn, arg))
        with self._lock:
            if self._armed:
                return
            self._armed = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            self._armed = False              # calls queued from now on schedule a new drain
        calls = self._calls
        while calls:
            fn, arg = calls.popleft()
            try:
                fn(arg)
            except Exception as exc:  # noqa: BLE001 - as the loop treats a failing callback
                self.loop.call_exception_handler({"message": "EventHandoff call failed",
                                                  "exception": exc})


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, cfg: WorkerConfig, built: Built, manager: AdapterManager, feed,
                 worker_id: str, chat_template: ChatTemplate | None = None, grammars=None,
                 step_profile: StepProfile | None = None):
        """chat_template: the checkpoint's (None: chats are rendered by the fallback);
        grammars: structured output's GrammarCompiler (None: off, a grammar is refused);
        step_profile: the engine's, which Info reports (None: none)."""
        self.step_profile = step_profile
        self.cfg, self.built, self.engine = cfg, built, built.engine
        self.chat_template, self.grammars = chat_template, grammars
        self.manager, self.feed, self.worker_id = manager, feed, worker_id
        self.warm = WarmQueue(manager, cfg.warm_gpu_share)     # Prefetch(warm): the fleet's
        self.metrics = metrics.RequestMetrics(manager.evictions.tenants, built.spec.name)
        self.draining = False
        self._background: set[asyncio.Task] = set()   # prefetch tasks, referenced until done
        self._handoff: EventHandoff | None = None        # engine thread -> this loop

    async def _prompt(self, request: wpb.WorkerGenerateRequest) -> list[int]:
        if request.prompt_token_ids:
            ids = list(request.prompt_token_ids)
            if max(ids) >= self.built.spec.vocab_size:
                raise InvalidArgument(f"prompt_token_ids: id {max(ids)} is outside the "
                                      f"vocabulary ({self.built.spec.vocab_size})")
            return ids
        if request.messages:
            if request.text:
                raise InvalidArgument("messages: give messages or text, not both")
            return (await self._encode_chat(request.messages, request.tools)).ids
        if not request.text:
            raise InvalidArgument("text: empty prompt (give text or prompt_token_ids)")
        return (await self._encode(request.text)).ids

    async def _encode(self, text: str, special: bool = True, field: str = "text"):
        """A text's encoding (special: with the tokenizer's own special tokens, BOS), off the
        event loop when it is long (a long text took seconds, and every other stream of this
        worker waited); a text too long to fit the model whatever its tokens is refused
        without encoding it."""
        limit = self.engine.max_model_len * self._chars_per_token
        if len(text) > limit:
            raise InvalidArgument(f"{field}: {len(text)} characters cannot fit the model's "
                                  f"{self.engine.max_model_len} tokens")
        if len(text) <= 4096:
            return self.built.tokenizer.encode(text, add_special_tokens=special)
        return await asyncio.to_thread(self.built.tokenizer.encode, text,
                                       add_special_tokens=special)

    async def _encode_chat(self, messages, tools=()):
        """A chat (and its tools) rendered with the checkpoint's template
        (services.worker.api.chat_template) and encoded as apply_chat_template does; without a
        template, the fallback transcript (the tools are not rendered then)."""
        size = sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls)
                   for m in messages) + sum(len(t.parameters_json) for t in tools)
        if size > self.engine.max_model_len * self._chars_per_token:
            raise InvalidArgument(f"messages: {size} characters cannot fit the model's "
                                  f"{self.engine.max_model_len} tokens")
        chat, tool_list = check_messages(messages), check_tools(tools)
        template = self.chat_template
        if template is None:
            return await self._encode(chat_fallback(chat), field="messages")
        text = template.render(chat, tools=tool_list) if size <= 4096 else \
            await asyncio.to_thread(template.render, chat, True, tool_list)
        return await self._encode(text, special=False, field="messages")

    @functools.cached_property
    def _chars_per_token(self) -> int:
        """A bound on the characters one token covers: four times the longest vocabulary entry
        (normalizers may drop characters)."""
        vocab = self.built.tokenizer.get_vocab()
        return 4 * max((len(piece) for piece in vocab), default=1)

    async def Generate(self, request, context):
        span = _tracer.start_span(
            "worker.generate", context=incoming_context(context.invocation_metadata()),
            attributes=generate_attributes(request, self.built.spec.name))
        try:                # current only while _generate runs, never across a yield
            with span_attrs.grpc_status(span, context):
                async for item in traced(span, self._generate(request, context)):
                    span_attrs.genai_last(span, item)
                    yield item
        finally:
            span.end()

    async def admit(self, request: wpb.WorkerGenerateRequest, arrival: float,
                    remaining: float | None) -> tuple[Sequence, Acquired | None]:
        """A Generate request made ready for the engine: its prompt's tokens, its sampling and
        stopping checked, its adapter staged and pinned (release it when done)."""
        if self.draining:
            raise Unavailable("worker is draining")
        deadline = arrival + remaining if remaining is not None else None
        prompt = await self._prompt(request)
        sampling = sampling_from(request.sampling, request.stopping, request.response,
                                 self.built.spec.vocab_size)
        stopping = stopping_from(request.stopping, self.cfg)
        matcher = await structured.matcher(self.grammars, request.sampling, request.stopping)
        if matcher is not None:
            sampling = dataclasses.replace(sampling, constrained=True)
        acq = None
        if request.adapter.id:
            acq = await self.manager.acquire(request.adapter.id, request.adapter.version,
                                             request.tenant or request.adapter.tenant, deadline,
                                             pinned=request.adapter.pinned)
        seq = Sequence(f"{request.request_id or 'req'}#{next(_ids)}", prompt,
                       slot=acq.slot if acq else -1, adapter=acq.key if acq else "",
                       tenant=request.tenant, sampling=sampling, stopping=stopping,
                       arrival=arrival, matcher=matcher)
        # prompt blocks are shared within a tenant and adapter version (block_manager)
        seq.prefix_key = hashlib.blake2b(f"{request.tenant}\0{seq.adapter}".encode(),
                                         digest_size=16).digest()
        return seq, acq

    async def _generate(self, request, context):
        arrival = time.monotonic()
        seq, acq = await self.admit(request, arrival, context.time_remaining())
        events = self._submit(seq, acq)
        finished = False
        try:
            while True:
                ev: TokenEvent = await events.get()
                if ev.stop is Stop.ERROR:
                    raise LorafleetError(f"generation failed: {ev.error}")
                finished = ev.stop is not Stop.NONE
                yield self._response(ev, acq)
                if finished:
                    self.metrics.finished(request.tenant, ev)
                    return
        finally:
            if not finished:
                self.engine.abort(seq.request_id)   # cancel or deadline: free row and KV now

    def _submit(self, seq: Sequence, acq) -> asyncio.Queue:
        """Hand seq to the engine; the adapter pin is released when the engine is done."""
        loop = asyncio.get_running_loop()
        if self._handoff is None or self._handoff.loop is not loop:
            self._handoff = EventHandoff(loop)
        handoff = self._handoff
        events: asyncio.Queue = asyncio.Queue()
        def deliver(ev: TokenEvent) -> None:
            events.put_nowait(ev)
            if ev.stop is not Stop.NONE and acq is not None:
                self.manager.release(acq.key)
        try:
            self.engine.submit(seq, lambda ev: handoff.put(deliver, ev))
        except BaseException:
            if acq is not None:
                self.manager.release(acq.key)
            raise
        return events

    @functools.cached_property
    def tool_call_format(self) -> str:
        """How the template has the model write tool calls (--tool-call-format, else read from
        the template: services.worker.api.chat_template)."""
        return structured.tool_call_format(self.cfg.tool_call_format, self.chat_template)

    @functools.cached_property
    def token_texts(self) -> TokenTexts:
        return TokenTexts(self.built.tokenizer)

    def _response(self, ev: TokenEvent, acq) -> wpb.WorkerGenerateResponse:
        """An engine event as a response (services.worker.api.responses, as the front end's)."""
        details = responses.details(ev, self.token_texts)
        if ev.stop is Stop.NONE:
            return responses.token_response(ev.token_ids, ev.text, details)
        return responses.final_response(responses.final(
            0, ev, acq.seconds if acq else 0.0,
            acq.tier if acq else common_pb2.TIER_UNSPECIFIED, details))

    async def LoadAdapter(self, request, context):
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        a = request.adapter
        _check_ref(a, "adapter")
        acq = await self.manager.acquire(a.id, a.version, a.tenant, deadline)
        self.manager.release(acq.key)
        return wpb.LoadAdapterResponse(from_tier=acq.tier, seconds=acq.seconds)

    async def OffloadAdapter(self, request, context):
        """Idempotent: an adapter that is not resident is left as it is."""
        message = name_error("id", request.id)
        if message is not None:
            raise InvalidArgument(message)
        self.manager.offload(request.id, request.to_host)
        return wpb.OffloadAdapterResponse()

    async def Prefetch(self, request, context):
        parent = incoming_context(context.invocation_metadata())
        for i, a in enumerate(request.adapters):
            _check_ref(a, f"adapters[{i}]")
        if request.warm:
            return wpb.PrefetchResponse(queued=self.warm.submit(request.adapters))
        for a in request.adapters:                 # the staging joins the caller's trace
            with _tracer.start_as_current_span("worker.prefetch", context=parent) as span:
                span.set_attribute("lora.adapter_id", a.id)
                task = asyncio.get_running_loop().create_task(self._prefetch(a))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return wpb.PrefetchResponse()

    async def _prefetch(self, a) -> None:
        try:
            acq = await self.manager.acquire(a.id, a.version, a.tenant, time.monotonic() + 30)
            self.manager.release(acq.key)
        except Exception:  # noqa: BLE001 - a failed prefetch shows again on the real request
            pass

    async def WatchResidency(self, request, context):
        async for update in self.feed.watch():
            yield update

    async def Tokenize(self, request, context):
        if request.messages and request.text:
            raise InvalidArgument("messages: give messages or text, not both")
        enc = await (self._encode_chat(request.messages, request.tools) if request.messages
                     else self._encode(request.text))
        return wpb.WorkerTokenizeResponse(token_ids=enc.ids, tokens=enc.tokens)

    async def Detokenize(self, request, context):
        ids = list(request.token_ids)
        if ids and max(ids) >= self.built.spec.vocab_size:
            raise InvalidArgument(f"token_ids: id {max(ids)} is outside the vocabulary "
                                  f"({self.built.spec.vocab_size})")
        text = self.built.tokenizer.decode(ids, skip_special_tokens=False) if len(ids) <= 4096 \
            else await asyncio.to_thread(self.built.tokenizer.decode, ids, False)
        return wpb.WorkerDetokenizeResponse(text=text)

    async def Info(self, request, context):
        s, m = self.built.spec, self.manager
        cache = [wpb.CacheCounters(tier=n, hits=p.totals().hits, misses=p.totals().misses)
                 for n, p in (("gpu", m.gpu), ("worker_host", m.host.policy))]
        cold = [wpb.ColdLoadHistogram(tier=common_pb2.Tier.Name(t), samples=v,
                                      count=m.cold_load_count.get(t, 0))
                for t, v in m.cold_loads.items()]
        return wpb.WorkerInfoResponse(
            model_name=s.name, architecture=s.architecture, vocab_size=s.vocab_size,
            max_sequence_length=self.engine.max_model_len, hidden_size=s.hidden_size,
            num_layers=s.num_layers, dtype=str(self.built.dtype).replace("torch.", ""),
            max_lora_rank=128, worker_id=self.worker_id, cache=cache, cold_loads=cold,
            gpu_resident=sum(1 for i in m.info.values() if i.gpu),
            host_resident=len(m.host), device=str(self.built.device),
            eos_token_id=s.eos_token_ids[0] if s.eos_token_ids else 0,
            has_chat_template=self.chat_template is not None,
            tool_call_format=self.tool_call_format,
            cold_load_records=(m.log.since(request.cold_loads_since)
                               if request.cold_load_records else []),
            cold_load_seq=m.log.seq,
            step_profile=[wpb.StepClass(kind=k, rows=r, prompt_tokens=p, adapters=a, steps=n,
                                        seconds=sec) for k, r, p, a, n, sec in
                          (self.step_profile.classes() if self.step_profile else ())])


def _check_ref(ref, field: str) -> None:
    """An AdapterRef an operator RPC names: a valid id and the version to stage (residency is
    kept per version, and a request names the version the router resolved; a ref without one
    would stage a copy that no request uses)."""
    message = name_error(f"{field}.id", ref.id)
    if message is not None:
        raise InvalidArgument(message)
    if not ref.version:
        raise InvalidArgument(f"{field}.version: required (the store's List or "
                              "`lorafleet adapters --json` gives it)")
