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

from services.common.errors import InvalidArgument, LorafleetError, NotFound
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


# GenerateRequest fields the servicers name in their refusals -> the OpenAI body's keys
HTTP_FIELDS = {"sampling.temperature": "temperature", "sampling.top_p": "top_p",
               "sampling.repetition_penalty": "repetition_penalty",
               "stopping.stop_sequences": "stop", "stopping.max_new_tokens": "max_tokens",
               "prompt_token_ids": "prompt", "request_id": "user_request_id"}


def _http_message(message: str, chat: bool) -> str:
    """A refusal that names a GenerateRequest field, reworded with the body's key."""
    field, sep, rest = message.partition(":")
    if not sep:
        return message
    if field == "text":
        return ("messages" if chat else "prompt") + sep + rest
    if chat and field == "stopping.max_new_tokens":
        return "max_completion_tokens / max_tokens" + sep + rest
    return HTTP_FIELDS.get(field, field) + sep + rest


def _error(err: LorafleetError, chat: bool = False) -> web.Response:
    name = err.code.name
    headers = {"Retry-After": f"{max(1, round(err.retry_after))}"} if err.retry_after else None
    message = _http_message(err.message, chat) if name == "INVALID_ARGUMENT" else err.message
    body = {"error": {"message": message, "type": name.lower(), "code": name}}
    return web.json_response(body, status=HTTP_STATUS.get(name, 500), headers=headers)


U32 = (1 << 32) - 1


def _float(body: dict, key: str, default: float) -> float:
    """A JSON number (the range checks are the servicer's, which name the field too)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{key}: expected a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise InvalidArgument(f"{key}: {value} is out of range") from None


def _int(body: dict, key: str, default: int, lo: int = 0, hi: int = U32) -> int:
    """A JSON integer in [lo, hi] (2.0 is 2; 2.7, "2" and true are refused)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{key}: expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise InvalidArgument(f"{key}: {value} is out of range [{lo}, {hi}]")
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        return stop
    raise InvalidArgument(f"stop: a string or a list of strings, got {stop!r}")


def token_ids(prompt: list) -> list[int]:
    """A prompt given as token ids: integers in [0, 2^32) (the vocabulary check is the
    servicer's)."""
    for t in prompt:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= U32:
            raise InvalidArgument(f"prompt: token ids are non-negative integers, got {t!r}")
    return prompt


def build_request(body: dict, prompt_text: str = "", prompt_ids=(),
                  chat: bool = False) -> rpb.GenerateRequest:
    """The GenerateRequest an OpenAI body asks for (unsupported options are refused, and so
    are values of the wrong type). The reply's cap: `max_tokens` (chat: `max_completion_tokens`
    first); without one, 16 tokens for a completion (OpenAI's default) and the worker's
    default for a chat."""
    if _int(body, "n", 1) != 1 or body.get("best_of", 1) not in (1, None):
        raise InvalidArgument("n / best_of: only 1 is supported")
    if body.get("logprobs") or body.get("echo"):
        raise InvalidArgument("logprobs / echo: not supported")
    if not isinstance(body.get("stream", False), (bool, type(None))):
        raise InvalidArgument(f"stream: true or false, got {body['stream']!r}")
    req = rpb.GenerateRequest(adapter_id=str(body.get("model") or ""), text=prompt_text,
                              prompt_token_ids=list(prompt_ids),
                              request_id=str(body.get("user_request_id", "")))
    s = req.sampling
    s.temperature = _float(body, "temperature", 1.0)
    s.top_p = _float(body, "top_p", 1.0)
    s.top_k = _int(body, "top_k", 0)
    s.seed = _int(body, "seed", 0, -(1 << 63), (1 << 64) - 1) & ((1 << 64) - 1)
    s.repetition_penalty = _float(body, "repetition_penalty", 0.0)
    cap_key = "max_completion_tokens" if chat and body.get(
        "max_completion_tokens") is not None else "max_tokens"
    req.stopping.max_new_tokens = _int(body, cap_key, 0 if chat else 16)
    req.stopping.stop_sequences.extend(_stop(body))
    return req


def _content(i: int, content) -> str:
    """A message's text: a string, null (""), or a list of text parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise InvalidArgument(f"messages[{i}].content: only text parts are supported")
        return "".join(p["text"] for p in content)
    raise InvalidArgument(f"messages[{i}].content: a string or a list of text parts")


def chat_prompt(messages) -> str:
    """A plain role-prefixed transcript ending with the assistant's turn (the served models
    carry no chat template)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages: a non-empty list is required")
    lines = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "content" not in m:
            raise InvalidArgument("messages: each needs a role and content")
        lines.append(f"{m.get('role', 'user')}: {_content(i, m['content'])}")
    return "\n".join(lines) + "\nassistant:"


@web.middleware
async def _json_errors(request: web.Request, handler):
    """Every error as an OpenAI-style JSON body: unknown routes and methods too, and anything
    unforeseen (logged) as a 500 rather than aiohttp's plain text."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        body = {"error": {"message": f"{request.method} {request.path}: {exc.reason}",
                          "type": "invalid_request_error",
                          "code": exc.reason.upper().replace(" ", "_")}}
        return web.json_response(body, status=exc.status)
    except LorafleetError as err:
        return _error(err)
    except Exception:  # noqa: BLE001 - a bug must not reach the client as a bare 500 page
        log.exception("HTTP gateway: %s %s failed", request.method, request.path)
        return web.json_response({"error": {"message": "internal error", "type": "internal",
                                            "code": "INTERNAL"}}, status=500)


class OpenAIGateway:
    """base_model: the served model's name, or an async callable that asks a worker for it
    (retried on each request until it answers, so a router started before its workers, or
    with a tenants file, still learns it)."""

    def __init__(self, servicer, base_model="", timeout: float = 600.0):
        self.servicer, self.timeout = servicer, timeout
        self._lookup = base_model if callable(base_model) else None
        self.base_model = "" if callable(base_model) else base_model
        self.app = web.Application(middlewares=[_json_errors])
        self.app.add_routes([web.get("/v1/models", self.models),
                             web.get("/v1/models/{model}", self.model),
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
        listed = await self.servicer.ListAdapters(rpb.ListAdaptersRequest(),
                                                  _Context(request, 30))
        now, base = int(time.time()), await self._base()
        data = [{"id": base or "base", "object": "model", "created": now,
                 "owned_by": "lorafleet"}]
        data += [{"id": a.id, "object": "model", "created": now, "parent": base,
                  "owned_by": a.owner or "shared"} for a in listed.adapters
                 if a.state == "READY"]
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

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise InvalidArgument("body: not JSON") from None
        except RecursionError:
            raise InvalidArgument("body: nested too deeply") from None
        if not isinstance(body, dict):
            raise InvalidArgument("body: a JSON object is required")
        body["model"] = await self._adapter(str(body.get("model") or ""))
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
                raise InvalidArgument("prompt: a string or a list of token ids")
        except LorafleetError as err:
            return _error(err)
        return await self._run(request, req, body, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            req = build_request(body, prompt_text=chat_prompt(body.get("messages")), chat=True)
        except LorafleetError as err:
            return _error(err, chat=True)
        return await self._run(request, req, body, chat=True)

    async def _run(self, request, req, body, chat: bool) -> web.StreamResponse:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        req.request_id = req.request_id or rid
        model = str(body.get("model") or await self._base())
        ctx = _Context(request, self.timeout)
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            if not isinstance(opts, dict):
                return _error(InvalidArgument("stream_options: an object"))
            return await self._stream(request, req, ctx, rid, model, chat,
                                      bool(opts.get("include_usage")))
        try:
            resp = await self.servicer.Generate(req, ctx)
        except LorafleetError as err:
            return _error(err, chat)
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

    async def _stream(self, request, req, ctx, rid, model, chat,
                      include_usage: bool = False) -> web.StreamResponse:
        """SSE chunks; with stream_options.include_usage, a last chunk with no choices and the
        usage, as OpenAI's."""
        stream = self.servicer.GenerateStream(req, ctx)
        try:
            first = await stream.__anext__()          # errors before any byte: a plain status
        except LorafleetError as err:
            return _error(err, chat)
        except StopAsyncIteration:
            first = None
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                          "Cache-Control": "no-cache"})
        await out.prepare(request)
        chunk = _chunker(rid, model, chat)
        if chat:
            await out.write(chunk(None, None, role=True))
        usage = None
        try:
            resp = first
            while resp is not None:
                if resp.HasField("usage"):
                    usage = resp.usage
                finish = FINISH.get(resp.stop_reason, "stop") if resp.stop_reason else None
                await out.write(chunk(resp.text, finish))
                resp = await stream.__anext__() if finish is None else None
        except StopAsyncIteration:
            pass
        except LorafleetError as err:                   # mid-stream: an error event, then end
            await out.write(b"data: " + json.dumps({"error": {
                "message": err.message, "code": err.code.name}}).encode() + b"\n\n")
        if include_usage and usage is not None:
            await out.write(chunk(None, None, usage=usage))
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


def _chunker(rid: str, model: str, chat: bool):
    created = int(time.time())

    def chunk(text, finish, role: bool = False, usage=None) -> bytes:
        if usage is not None:                      # the usage chunk: no choices
            data = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created, "model": model, "choices": [],
                    "usage": {"prompt_tokens": usage.prompt_tokens,
                              "completion_tokens": usage.generated_tokens,
                              "total_tokens": usage.prompt_tokens + usage.generated_tokens}}
            return b"data: " + json.dumps(data).encode() + b"\n\n"
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
