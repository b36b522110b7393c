"""OpenAI-compatible HTTP gateway: /v1/completions, /v1/chat/completions (SSE with "stream"),
/v1/models, and vLLM's /health, /tokenize and /detokenize. `model` names the adapter (the base
model's name, or "", is the base); each body field is honoured or refused by name
(services.router.openai_fields), and errors are OpenAI's error objects. Each route maps 1:1
onto a GenerationService call, made in-process on the router's own servicer, so auth (the
same bearer token), quotas, fair queuing and placement apply unchanged; a client that
disconnects cancels the request down to the worker.
"""
from __future__ import annotations

import json
import logging
import time
import uuid

from aiohttp import web

from services.common.errors import InvalidArgument, LorafleetError, NotFound, Unavailable
from services.common.gen.lorafleet.v1 import common_pb2, router_pb2 as rpb
from services.router.openai_choices import fan_out, gather as gather_choices
from services.router.openai_choices import requests as choice_requests
from services.router.openai_fields import BodyError, build_request, chat_messages, token_ids
from services.router.openai_errors import error_body, error_response
from services.router.openai_format import chunker, logprobs, message_json, usage_json
from services.router.openai_structured import GRAMMAR_KEYS, tool_list
from services.router.openai_http import GatewayRunner, check_strings, json_errors
from services.router import status_page

log = logging.getLogger(__name__)
FINISH = {common_pb2.MAX_TOKENS: "length", common_pb2.TIME_LIMIT: "length",
          common_pb2.EOS_TOKEN: "stop", common_pb2.STOP_SEQUENCE: "stop",
          common_pb2.CANCELLED: "stop"}


class _Context:
    """Just enough of grpc.aio.ServicerContext for the servicer's request path."""

    def __init__(self, request: web.Request, timeout: float | None):
        auth = request.headers.get("Authorization")
        self._metadata = [("authorization", auth)] if auth else []
        self._deadline = None if timeout is None else time.monotonic() + timeout

    def invocation_metadata(self):
        return self._metadata

    def time_remaining(self):
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())


class OpenAIGateway:
    """base_model: the served model's name, or an async callable that asks a worker for it
    (retried on each request until it answers, so a router started before its workers, or
    with a tenants file, still learns it)."""

    def __init__(self, servicer, base_model="", timeout: float = 600.0):
        self.servicer, self.timeout = servicer, timeout
        self._lookup = base_model if callable(base_model) else None
        self.base_model = "" if callable(base_model) else base_model
        self.app = web.Application(middlewares=[json_errors])
        self.app.add_routes([web.get("/v1/models", self.models),
                             web.get("/v1/models/{model}", self.model),
                             web.post("/v1/completions", self.completions),
                             web.post("/v1/chat/completions", self.chat),
                             web.get("/health", self.health),
                             web.post("/tokenize", self.tokenize),
                             web.post("/detokenize", self.detokenize),
                             web.get("/status", status_page.page),
                             web.get("/status.json", status_page.json_route(servicer))])
        self._runner: web.AppRunner | None = None

    async def start(self, listen: str) -> int:
        host, _, port = listen.rpartition(":")
        # handler_cancellation: a client that leaves cancels its handler, and with it the
        # request down to the worker (aiohttp's default lets it run to the end)
        self._runner = GatewayRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host or "127.0.0.1", int(port))
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _base(self) -> str:
        if not self.base_model and self._lookup is not None:
            try:
                self.base_model = await self._lookup()
            except Exception:  # noqa: BLE001 - no worker yet: base requests use model ""
                pass
        return self.base_model

    async def _adapter(self, model: str) -> str:
        return "" if model in ("", "base", await self._base()) else model

    async def _listing(self, request: web.Request) -> list[dict]:
        now, base = int(time.time()), await self._base()
        data = [{"id": base or "base", "object": "model", "created": now,
                 "owned_by": "lorafleet", "root": base or "base", "parent": None}]
        token = None
        while token != "":          # every page (REGISTERED adapters validate on first use)
            listed = await self.servicer.ListAdapters(
                rpb.ListAdaptersRequest(page_token=token or ""), _Context(request, 30))
            data += [{"id": a.id, "object": "model", "created": now, "root": a.id,
                      "parent": base, "owned_by": a.owner or "shared"} for a in listed.adapters
                     if a.state != "FAILED"]
            token = listed.next_page_token
        return data

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": await self._listing(request)})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        data = await self._listing(request)           # the base model first
        for m in data:
            if m["id"] == name or (name == "base" and m is data[0]):
                return web.json_response(m)
        raise NotFound(f"model {name!r} not found")

    async def health(self, request: web.Request) -> web.Response:
        """200 while some worker is ready to serve (what a load balancer's probe asks), else
        503."""
        live = len(self.servicer.app.workers.live())
        if not live:
            return error_response(Unavailable("no worker is ready"))
        return web.json_response({"status": "ok", "workers": live})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: {"prompt": text} or {"messages": [...], "tools": [...]} (rendered
        with the chat template, as a chat completion's prompt is) -> {"tokens", "count",
        "max_model_len"}."""
        body = await self._body(request)
        extra = set(body) - {"model", "prompt", "messages", "add_special_tokens", "tools"}
        if extra:
            key = sorted(extra)[0]
            raise BodyError(f"{key}: unknown parameter", key, "unknown_parameter")
        ctx = _Context(request, 30)
        if "messages" in body:
            req = rpb.TokenizeRequest(messages=chat_messages(body["messages"]),
                                      tools=tool_list(body))
        elif isinstance(body.get("prompt"), str):
            req = rpb.TokenizeRequest(text=body["prompt"])
        else:
            raise BodyError("prompt: a string (or give messages)", "prompt", "invalid_type")
        resp = await self.servicer.Tokenize(req, ctx)
        info = await self.servicer.ModelInfo(rpb.ModelInfoRequest(), ctx)
        return web.json_response({"tokens": list(resp.token_ids), "count": len(resp.token_ids),
                                  "max_model_len": info.max_sequence_length})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
        body = await self._body(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise BodyError("tokens: a list of token ids", "tokens", "invalid_type")
        resp = await self.servicer.Detokenize(
            rpb.DetokenizeRequest(token_ids=token_ids(tokens, "tokens")),
            _Context(request, 30))
        return web.json_response({"prompt": resp.text})

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise InvalidArgument("body: not JSON") from None
        except RecursionError:
            raise InvalidArgument("body: nested too deeply") from None
        if not isinstance(body, dict):
            raise InvalidArgument("body: a JSON object is required")
        check_strings(body)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise BodyError(f"model: expected a string, got {model!r}", "model", "invalid_type")
        body["model"] = await self._adapter(model or "")
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            prompt = body.get("prompt", "")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, list) and all(isinstance(t, (int, float)) for t in prompt):
                req = build_request(body, prompt_ids=token_ids(prompt))
            elif isinstance(prompt, str):
                req = build_request(body, prompt_text=prompt)
            else:
                raise BodyError("prompt: a string or a list of token ids", "prompt",
                                "invalid_type")
        except LorafleetError as err:
            return self._refused(request, err)
        return await self._run(request, req, body, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            req = build_request(body, messages=chat_messages(body.get("messages")), chat=True)
        except LorafleetError as err:
            return self._refused(request, err, chat=True)
        return await self._run(request, req, body, chat=True)

    def _refused(self, request: web.Request, err: LorafleetError,
                 chat: bool = False) -> web.Response:
        """A generation request refused here, before the servicer saw it: counted as the
        servicer counts its own refusals (lorafleet_router_requests_total, the tenant's
        requests under the status). The caller is authenticated first, so a bad token is a
        401 whatever the body, as the servicer answers a good body with a bad token."""
        try:
            caller = self.servicer.app.tenants.authenticate(
                _Context(request, None).invocation_metadata())
        except LorafleetError as auth:
            return error_response(auth, chat)
        self.servicer.app.stats.refuse(caller.tenant, err.code.name)
        return error_response(err, chat)

    async def _run(self, request, req, body, chat: bool) -> web.StreamResponse:
        key = _grammar_key(body, req)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        req.request_id = req.request_id or rid
        model = str(body.get("model") or await self._base())
        ctx = _Context(request, self.timeout)
        n = int(body.get("n") or 1)                    # checked by build_request
        reqs = [req] if n == 1 else choice_requests(req, n, body.get("seed") is not None)
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            if not isinstance(opts, dict):
                return self._refused(request, InvalidArgument("stream_options: an object"),
                                     chat)
            return await self._stream(request, reqs, ctx, rid, model, chat,
                                      bool(opts.get("include_usage")),
                                      bool(body.get("echo")) and not chat, key)
        try:
            if n == 1:
                resp = await self.servicer.Generate(req, ctx)
                done = [{"text": resp.text, "tokens": resp.tokens, "stop": resp.stop_reason,
                         "usage": resp.usage, "prompt_tokens": resp.prompt_tokens,
                         "tool_calls": resp.tool_calls}]
            else:
                done = await gather_choices(self.servicer, reqs, ctx)
        except LorafleetError as err:
            return error_response(err, chat, key)
        echo = "" if chat or not body.get("echo") else await self._echo(req, ctx)
        choices = []
        for i, c in enumerate(done):
            if echo or req.response.prompt_logprobs:
                c["text"] = echo + c["text"]
                c["tokens"] = [*c.get("prompt_tokens", ()), *c["tokens"]]
            finish, lp = FINISH.get(c["stop"], "stop"), logprobs(c["tokens"], req, chat,
                                                                c["text"])
            if c["tool_calls"] and finish == "stop":
                finish = "tool_calls"
            choices.append({"index": i, "message": message_json(c["text"], c["tool_calls"]),
                            "logprobs": lp, "finish_reason": finish} if chat else
                           {"index": i, "text": c["text"], "finish_reason": finish,
                            "logprobs": lp})
        return web.json_response({
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage_json([c["usage"] for c in done])})

    async def _echo(self, req, ctx) -> str:
        """A completion's prompt as text, for echo (a token-id prompt: detokenized)."""
        if not req.prompt_token_ids:
            return req.text
        resp = await self.servicer.Detokenize(
            rpb.DetokenizeRequest(token_ids=req.prompt_token_ids), ctx)
        return resp.text

    async def _stream(self, request, reqs, ctx, rid, model, chat, include_usage: bool = False,
                      echo: bool = False, key: str | None = None) -> web.StreamResponse:
        """SSE chunks, each of one choice (its index); with stream_options.include_usage, a
        last chunk with no choices and the usage, as OpenAI's."""
        req = reqs[0]
        source = _single(self.servicer.GenerateStream(req, ctx)) if len(reqs) == 1 else \
            fan_out(self.servicer, reqs, ctx)
        try:
            first = await source.__anext__()          # errors before any byte: a plain status
        except LorafleetError as err:
            await source.aclose()
            return error_response(err, chat, key)
        except StopAsyncIteration:
            first = None
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                          "Cache-Control": "no-cache"})
        await out.prepare(request)
        chunk = chunker(rid, model, chat)
        try:
            await self._write_chunks(out, chunk, source, first, reqs, ctx, chat, echo,
                                     include_usage, key)
        except ConnectionResetError:    # the client went away (aiohttp's ClientConnection-
            log.debug("HTTP gateway: %s: the client left mid-stream", rid)  # ResetError)
        return out

    async def _write_chunks(self, out, chunk, source, first, reqs, ctx, chat: bool,
                            echo: bool, include_usage: bool, key: str | None) -> None:
        """Each choice's messages as chunks (a tool call whole in one, as its text ends), then
        the usage (if asked) and [DONE]; the source is closed however it ends, which settles
        (or cancels) the requests."""
        req, usages = reqs[0], []
        sent = [0] * len(reqs)           # each choice's characters so far: its text_offset
        called = [False] * len(reqs)     # each choice made a tool call
        try:
            if chat:
                for i in range(len(reqs)):
                    await out.write(chunk(None, None, role=True, index=i))
            if echo and first is not None:             # the prompt, before each choice
                text = await self._echo(req, ctx)
                for i in range(len(reqs)):
                    await out.write(chunk(text, None, index=i, logprobs=logprobs(
                        first[1].prompt_tokens, req, chat, text)))
                sent = [len(text)] * len(reqs)
            item = first
            while item is not None:
                i, resp = item
                if resp.HasField("usage"):
                    usages.append(resp.usage)
                finish = FINISH.get(resp.stop_reason, "stop") if resp.stop_reason else None
                called[i] = called[i] or bool(resp.tool_calls)
                if called[i] and finish == "stop":
                    finish = "tool_calls"
                await out.write(chunk(resp.text, finish, index=i, logprobs=logprobs(
                    resp.tokens, req, chat, resp.text, sent[i]), tool_calls=resp.tool_calls))
                sent[i] += len(resp.text)
                item = await source.__anext__()
        except StopAsyncIteration:
            pass
        except LorafleetError as err:                   # mid-stream: an error event, then end
            await out.write(b"data: " + json.dumps(error_body(err, chat, key)[0]).encode()
                            + b"\n\n")
        finally:
            await source.aclose()
        if include_usage and usages:
            await out.write(chunk(None, None, usage=usage_json(usages)))
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()


def _grammar_key(body: dict, req) -> str | None:
    """The body's key the request's grammar came from (a refusal of it names that key)."""
    if req.tool_choice.mode in (req.tool_choice.REQUIRED, req.tool_choice.FUNCTION):
        return "tools"
    return next((k for k in GRAMMAR_KEYS if body.get(k) is not None), None)


async def _single(stream):
    """One stream's messages as choice 0's."""
    try:
        async for resp in stream:
            yield 0, resp
    finally:
        await stream.aclose()
