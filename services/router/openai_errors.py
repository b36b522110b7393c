"""OpenAI's error objects for the HTTP gateway (services.router.openai_gateway): a refusal's
gRPC status -> the HTTP status, OpenAI's `type` and `code`, and the body's key as `param` where
the servicers named a GenerateRequest field; a context-length refusal worded as vLLM's, with
both counts and the OpenAI field (`max_tokens`)."""
from __future__ import annotations

import re

from aiohttp import web

from services.common.errors import LorafleetError
from services.router.openai_fields import BodyError
from services.router.openai_structured import http_param

HTTP_STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400,
               "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
               "ALREADY_EXISTS": 409, "RESOURCE_EXHAUSTED": 429, "CANCELLED": 499,
               "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
# GenerateRequest fields the servicers name in their refusals -> the OpenAI body's keys
HTTP_FIELDS = {"sampling.temperature": "temperature", "sampling.top_p": "top_p",
               "sampling.repetition_penalty": "repetition_penalty",
               "stopping.stop_sequences": "stop", "stopping.max_new_tokens": "max_tokens",
               "stopping.min_new_tokens": "min_tokens",
               "prompt_token_ids": "prompt", "request_id": "user_request_id"}
# gRPC status -> OpenAI's error type
ERROR_TYPES = {"INVALID_ARGUMENT": "invalid_request_error",
               "FAILED_PRECONDITION": "invalid_request_error",
               "OUT_OF_RANGE": "invalid_request_error", "ALREADY_EXISTS": "invalid_request_error",
               "CANCELLED": "invalid_request_error", "UNAUTHENTICATED": "authentication_error",
               "PERMISSION_DENIED": "permission_error", "NOT_FOUND": "not_found_error",
               "RESOURCE_EXHAUSTED": "rate_limit_error"}
# gRPC status -> OpenAI's code, where OpenAI has one for it
ERROR_CODES = {"UNAUTHENTICATED": "invalid_api_key", "NOT_FOUND": "model_not_found",
               "RESOURCE_EXHAUSTED": "rate_limit_exceeded"}


def _http_message(message: str, chat: bool) -> tuple[str, str | None]:
    """A refusal that names a GenerateRequest field, reworded with the body's key; and that
    key (the error's param)."""
    field, sep, rest = message.partition(":")
    if not sep or " " in field:
        return message, None
    if field in ("text", "prompt"):
        key = "messages" if chat else "prompt"
    elif chat and field == "stopping.max_new_tokens":
        return "max_completion_tokens / max_tokens" + sep + rest, "max_tokens"
    else:
        key = HTTP_FIELDS.get(field, field)
    return key + sep + rest, key


def error_body(err: LorafleetError, chat: bool = False,
               grammar_key: str | None = None) -> tuple[dict, int]:
    """OpenAI's error object for a refusal: message, type, param, code (and the gRPC status
    it came from as grpc_code); and the HTTP status. grammar_key: the body's key the request's
    grammar came from (a refusal of the grammar names it)."""
    name = err.code.name
    message, param, code = err.message, None, ERROR_CODES.get(name)
    if name == "INVALID_ARGUMENT":
        message, param = http_param(err.message, grammar_key) or _http_message(err.message,
                                                                               chat)
        code = "invalid_value"
        if "exceeds the model's" in message or "cannot fit the model's" in message:
            code = "context_length_exceeded"
        vllm = context_message(err.message, chat)
        if vllm is not None:
            message, param = vllm, "max_tokens"
    if isinstance(err, BodyError):
        param, code = err.param, err.openai_code
    status = HTTP_STATUS.get(name, 500)
    return {"error": {"message": message, "type": ERROR_TYPES.get(name, "server_error"),
                      "param": param, "code": code or name.lower(), "grpc_code": name}}, status


def error_response(err: LorafleetError, chat: bool = False,
                   grammar_key: str | None = None) -> web.Response:
    headers = {"Retry-After": f"{max(1, round(err.retry_after))}"} if err.retry_after else None
    body, status = error_body(err, chat, grammar_key)
    return web.json_response(body, status=status, headers=headers)


# the engine's refusal of a prompt and a cap that do not fit (services/worker/engine/loop.py)
CONTEXT = re.compile(r"prompt \((\d+)\) \+ max_new_tokens \((\d+)\) exceeds the model's "
                     r"(\d+) tokens")


def context_message(message: str, chat: bool) -> str | None:
    """vLLM's wording of a context-length refusal, naming the OpenAI fields, or None."""
    m = CONTEXT.search(message)
    if m is None:
        return None
    prompt, cap, limit = (int(x) for x in m.groups())
    where = "messages" if chat else "prompt"
    cap_key = "max_completion_tokens / max_tokens" if chat else "max_tokens"
    return (f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt + cap} tokens ({prompt} in the {where}, {cap} in the completion: "
            f"{cap_key}). Please reduce the length of the {where} or {cap_key}.")


def json_error(message: str, kind: str, code: str, status: int = 400, param=None,
               grpc_code: str | None = None) -> web.Response:
    """An OpenAI error object not made from a LorafleetError (routes, HTTP parsing)."""
    error = {"message": message, "type": kind, "param": param, "code": code}
    if grpc_code:
        error["grpc_code"] = grpc_code
    return web.json_response({"error": error}, status=status)
