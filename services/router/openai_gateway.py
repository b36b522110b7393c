"""OpenAI-compatible HTTP gateway: /v1/completions, /v1/chat/completions (SSE with "stream"),
/v1/models. `model` names the adapter (the base model's name, or "", is the base). Each route
maps 1:1 onto a GenerationService call, made in-process on the router's own servicer, so auth
(the same bearer token), quotas, fair queuing and placement apply unchanged; a client that
disconnects cancels the request down to the worker.
"""
from __future__ import annotations

import json
import logging
import time
import uuid

from aiohttp import web

from services.common.errors import InvalidArgument, LorafleetError
from services.common.gen.lorafleet.v1 import common_pb2, router_pb2 as rpb

log = logging.getLogger(__name__)
HTTP_STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400,
               "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
               "ALREADY_EXISTS": 409, "RESOURCE_EXHAUSTED": 429, "CANCELLED": 499,
               "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
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


def _error(err: LorafleetError) -> web.Response:
    name = err.code.name
    headers = {"Retry-After": f"{max(1, round(err.retry_after))}"} if err.retry_after else None
    body = {"error": {"message": err.message, "type": name.lower(), "code": name}}
    return web.json_response(body, status=HTTP_STATUS.get(name, 500), headers=headers)


def _num(body: dict, key: str, kind, default):
    value = body.get(key, default)
    if value is None:
        return default
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{key}: expected a number, got {value!r}") from None


def build_request(body: dict, prompt_text: str = "", prompt_ids=()) -> rpb.GenerateRequest:
    """The GenerateRequest an OpenAI body asks for (unsupported options are refused)."""
    if _num(body, "n", int, 1) != 1 or body.get("best_of", 1) not in (1, None):
        raise InvalidArgument("n / best_of: only 1 is supported")
    if body.get("logprobs") or body.get("echo"):
        raise InvalidArgument("logprobs / echo: not supported")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    req = rpb.GenerateRequest(adapter_id=str(body.get("model") or ""), text=prompt_text,
                              prompt_token_ids=list(prompt_ids),
                              request_id=str(body.get("user_request_id", "")))
    s = req.sampling
    s.temperature = _num(body, "temperature", float, 1.0)
    s.top_p = _num(body, "top_p", float, 1.0)
    s.top_k = _num(body, "top_k", int, 0)
    s.seed = _num(body, "seed", int, 0) & ((1 << 64) - 1)
    s.repetition_penalty = _num(body, "repetition_penalty", float, 0.0)
    req.stopping.max_new_tokens = _num(body, "max_tokens", int, 16)
    req.stopping.stop_sequences.extend(str(x) for x in stop)
    return req


def chat_prompt(messages) -> str:
    """A plain role-prefixed transcript ending with the assistant's turn (the served models
    carry no chat template)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages: a non-empty list is required")
    lines = []
    for m in messages:
        if not isinstance(m, dict) or "content" not in m:
            raise InvalidArgument("messages: each needs a role and content")
        lines.append(f"{m.get('role', 'user')}: {m['content']}")
    return "\n".join(lines) + "\nassistant:"


class OpenAIGateway:
    def __init__(self, servicer, base_model: str = "", timeout: float = 600.0):
        self.servicer, self.base_model, self.timeout = servicer, base_model, timeout
        self.app = web.Application()
        self.app.add_routes([web.get("/v1/models", self.models),
                             web.post("/v1/completions", self.completions),
                             web.post("/v1/chat/completions", self.chat)])
        self._runner: web.AppRunner | None = None

    async def start(self, listen: str) -> int:
        host, _, port = listen.rpartition(":")
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host or "127.0.0.1", int(port))
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _adapter(self, model: str) -> str:
        return "" if model in ("", "base", self.base_model) else model

    async def models(self, request: web.Request) -> web.Response:
        ctx = _Context(request, 30)
        try:
            listed = await self.servicer.ListAdapters(rpb.ListAdaptersRequest(), ctx)
        except LorafleetError as err:
            return _error(err)
        now = int(time.time())
        data = [{"id": self.base_model or "base", "object": "model", "created": now,
                 "owned_by": "lorafleet"}]
        data += [{"id": a.id, "object": "model", "created": now, "parent": self.base_model,
                  "owned_by": a.owner or "shared"} for a in listed.adapters
                 if a.state == "READY"]
        return web.json_response({"object": "list", "data": data})

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise InvalidArgument("body: not JSON") from None
        if not isinstance(body, dict):
            raise InvalidArgument("body: a JSON object is required")
        body["model"] = self._adapter(str(body.get("model") or ""))
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            prompt = body.get("prompt", "")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                req = build_request(body, prompt_ids=prompt)
            elif isinstance(prompt, str):
                req = build_request(body, prompt_text=prompt)
            else:
                raise InvalidArgument("prompt: a string or a list of token ids")
        except LorafleetError as err:
            return _error(err)
        return await self._run(request, req, body, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            req = build_request(body, prompt_text=chat_prompt(body.get("messages")))
        except LorafleetError as err:
            return _error(err)
        return await self._run(request, req, body, chat=True)

    async def _run(self, request, req, body, chat: bool) -> web.StreamResponse:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        req.request_id = req.request_id or rid
        model = str(body.get("model") or self.base_model)
        ctx = _Context(request, self.timeout)
        if body.get("stream"):
            return await self._stream(request, req, ctx, rid, model, chat)
        try:
            resp = await self.servicer.Generate(req, ctx)
        except LorafleetError as err:
            return _error(err)
        finish = FINISH.get(resp.stop_reason, "stop")
        choice = ({"index": 0, "message": {"role": "assistant", "content": resp.text},
                   "finish_reason": finish} if chat else
                  {"index": 0, "text": resp.text, "finish_reason": finish, "logprobs": None})
        u = resp.usage
        return web.json_response({
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.generated_tokens,
                      "total_tokens": u.prompt_tokens + u.generated_tokens}})

    async def _stream(self, request, req, ctx, rid, model, chat) -> web.StreamResponse:
        stream = self.servicer.GenerateStream(req, ctx)
        try:
            first = await stream.__anext__()          # errors before any byte: a plain status
        except LorafleetError as err:
            return _error(err)
        except StopAsyncIteration:
            first = None
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                          "Cache-Control": "no-cache"})
        await out.prepare(request)
        chunk = _chunker(rid, model, chat)
        if chat:
            await out.write(chunk(None, None, role=True))
        try:
            resp = first
            while resp is not None:
                finish = FINISH.get(resp.stop_reason, "stop") if resp.stop_reason else None
                await out.write(chunk(resp.text, finish))
                resp = await stream.__anext__() if finish is None else None
        except StopAsyncIteration:
            pass
        except LorafleetError as err:                   # mid-stream: an error event, then end
            await out.write(b"data: " + json.dumps({"error": {
                "message": err.message, "code": err.code.name}}).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


def _chunker(rid: str, model: str, chat: bool):
    created = int(time.time())

    def chunk(text, finish, role: bool = False) -> bytes:
        if chat:
            delta = {"role": "assistant"} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        data = {"id": rid, "object": obj, "created": created, "model": model,
                "choices": [choice]}
        return b"data: " + json.dumps(data).encode() + b"\n\n"
    return chunk
