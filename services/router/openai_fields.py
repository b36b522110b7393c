"""The OpenAI request bodies, field by field: each field of `/v1/completions` and
`/v1/chat/completions` is honoured (mapped onto the GenerateRequest), accepted with no effect
on the output where it has none in OpenAI either (`user`, `metadata`, `service_tier`), or
refused with a 400 that names it (`param`) where lorafleet does not do what it asks. A field
OpenAI does not define is refused too ("unknown_parameter"), besides the extensions vLLM's
users send (`top_k`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `structured_outputs`
and the `guided_*` fields) and lorafleet's own `user_request_id`. Ranges are OpenAI's:
temperature 0-2, top_p 0-1, a positive `max_tokens`. Structured outputs and tools:
services.router.openai_structured.

A refusal is a BodyError: INVALID_ARGUMENT with the OpenAI `param` and `code`
("unknown_parameter", "unsupported_parameter", "unsupported_value", "invalid_type",
"invalid_value").
"""
from __future__ import annotations

import math

from services.common.errors import InvalidArgument
from services.common.gen.lorafleet.v1 import common_pb2, router_pb2 as rpb
from services.router import openai_structured
from services.router.openai_choices import MAX_CHOICES

U32 = (1 << 32) - 1


class BodyError(InvalidArgument):
    """A refused body field: OpenAI's param and code beside the message."""

    def __init__(self, message: str, param: str | None, code: str):
        super().__init__(message)
        self.param, self.openai_code = param, code


# The fields of both endpoints, honoured
SAMPLING = ("model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "stop",
            "seed", "n", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
            "top_k", "repetition_penalty", "ignore_eos", "min_tokens", "user_request_id",
            "structured_outputs", *openai_structured.GUIDED)
MAX_LOGIT_BIAS = 1024          # tokens a request may bias
TOP_LOGPROBS = {False: 5, True: 20}   # the most alternatives: completions' logprobs, chat's
# accepted, with no effect on the output (as in OpenAI: abuse tracking, stored-completion tags,
# the billing tier)
NO_EFFECT = ("user", "metadata", "service_tier")
# defined by OpenAI, refused unless left at the value that turns them off
OFF_VALUES = {
    "best_of": (None, 1), "suffix": (None, ""),
    "functions": (None, []), "function_call": (None, "none"), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,), "verbosity": (None,), "store": (None, False),
}
WHY = {"best_of": "not supported (n choices are; best_of would rank them by logprob)",
       "suffix": "insertion is not supported",
       "functions": "the deprecated function calling is not supported (tools are)",
       "function_call": "the deprecated function calling is not supported (tool_choice is)",
       "modalities": "text only", "audio": "text only", "prediction": "not supported",
       "reasoning_effort": "not a reasoning model", "web_search_options": "not supported",
       "verbosity": "not supported", "store": "completions are not stored"}
COMPLETIONS = {"prompt", "suffix", "echo", "best_of", "logprobs", "n", "presence_penalty",
               "frequency_penalty", "logit_bias", "min_tokens", "user", "service_tier"}
CHAT = {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "n",
        "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens", "response_format",
        "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
        "modalities", "audio", "prediction", "reasoning_effort", "web_search_options",
        "verbosity", "store", "metadata", "user", "service_tier"}


def check_fields(body: dict, chat: bool) -> None:
    """Refuse what the endpoint does not define and what it defines but lorafleet does not do."""
    known = set(SAMPLING) | (CHAT if chat else COMPLETIONS)
    for key, value in body.items():
        if key not in known:
            raise BodyError(f"{key}: unknown parameter", key, "unknown_parameter")
        if key in OFF_VALUES and not any(_is(value, off) for off in OFF_VALUES[key]):
            code = ("unsupported_value" if key in ("best_of", "modalities")
                    else "unsupported_parameter")
            raise BodyError(f"{key}: {WHY[key]} (got {value!r})", key, code)
    if body.get("stream_options") is not None and not body.get("stream"):
        raise BodyError("stream_options: only with stream true", "stream_options",
                        "invalid_value")
    for key in ("user", "service_tier"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise BodyError(f"{key}: expected a string, got {body[key]!r}", key, "invalid_type")


def _is(value, off) -> bool:
    """Whether a body's value is this "off" value: None and booleans as themselves, numbers
    by value (0 and 0.0), strings, lists and objects by equality."""
    if off is None or isinstance(off, bool):
        return value is off
    if isinstance(off, (int, float)):
        return not isinstance(value, bool) and isinstance(value, (int, float)) and value == off
    return type(value) is type(off) and value == off


def number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    """A JSON number in [lo, hi]."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BodyError(f"{key}: expected a number, got {value!r}", key, "invalid_type")
    try:
        value = float(value)
    except OverflowError:
        value = math.inf
    if not lo <= value <= hi:
        raise BodyError(f"{key}: {body[key]} is out of range [{lo:g}, {hi:g}]", key,
                        "invalid_value")
    return value


def integer(body: dict, key: str, default: int, lo: int = 0, hi: int = U32) -> int:
    """A JSON integer in [lo, hi] (2.0 is 2; 2.7, "2" and true are refused)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BodyError(f"{key}: expected an integer, got {value!r}", key, "invalid_type")
    if not lo <= value <= hi:
        raise BodyError(f"{key}: {value} is out of range [{lo}, {hi}]", key, "invalid_value")
    return value


def _bool(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BodyError(f"{key}: true or false, got {value!r}", key, "invalid_type")
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        return stop
    raise BodyError(f"stop: a string or a list of strings, got {stop!r}", "stop", "invalid_type")


def token_ids(prompt: list, key: str = "prompt") -> list[int]:
    """A prompt given as token ids: integers in [0, 2^32) (the vocabulary check is the
    worker's)."""
    for t in prompt:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= U32:
            raise BodyError(f"{key}: token ids are non-negative integers, got {t!r}", key,
                            "invalid_value")
    return prompt


def build_request(body: dict, prompt_text: str = "", prompt_ids=(), messages=(),
                  chat: bool = False) -> rpb.GenerateRequest:
    """The GenerateRequest an OpenAI body asks for, every field checked (check_fields). The
    reply's cap: `max_tokens` (chat: `max_completion_tokens` first); without one, 16 tokens
    for a completion (OpenAI's default) and the worker's default for a chat."""
    check_fields(body, chat)
    _bool(body, "stream")
    req = rpb.GenerateRequest(adapter_id=str(body.get("model") or ""), text=prompt_text,
                              prompt_token_ids=list(prompt_ids), messages=list(messages),
                              request_id=str(body.get("user_request_id", "")))
    s = req.sampling
    s.temperature = number(body, "temperature", 1.0, 0.0, 2.0)
    s.top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    s.top_k = integer(body, "top_k", 0)
    s.seed = integer(body, "seed", 0, -(1 << 63), (1 << 64) - 1) & ((1 << 64) - 1)
    s.repetition_penalty = number(body, "repetition_penalty", 0.0, 0.0, math.inf)
    cap_key = "max_completion_tokens" if chat and body.get(
        "max_completion_tokens") is not None else "max_tokens"
    req.stopping.max_new_tokens = integer(body, cap_key, 0 if chat else 16, 1)
    req.stopping.stop_sequences.extend(_stop(body))
    req.stopping.ignore_eos = _bool(body, "ignore_eos")
    req.stopping.min_new_tokens = integer(body, "min_tokens", 0)
    integer(body, "n", 1, 1, MAX_CHOICES)
    s.presence_penalty = number(body, "presence_penalty", 0.0, -2.0, 2.0)
    s.frequency_penalty = number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    for token, bias in _logit_bias(body).items():
        s.logit_bias[token] = bias
    _logprobs(body, chat, req.response)
    grammar, _ = openai_structured.grammar(body)
    if grammar is not None:
        s.grammar.CopyFrom(grammar)
    if chat:
        openai_structured.tools(body, req)
    return req


def _logit_bias(body: dict) -> dict[int, float]:
    """{"token id": bias in [-100, 100]} (OpenAI's keys are the ids as strings)."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise BodyError(f"logit_bias: an object of at most {MAX_LOGIT_BIAS} token ids",
                        "logit_bias", "invalid_type")
    out = {}
    for key in value:
        if not (isinstance(key, str) and key.isdigit() and int(key) <= U32):
            raise BodyError(f"logit_bias: {key!r} is not a token id", "logit_bias",
                            "invalid_value")
        bias = value[key]
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or \
                not -100 <= bias <= 100:
            raise BodyError(f"logit_bias: {key}: {bias!r} is not a number in [-100, 100]",
                            "logit_bias", "invalid_value")
        out[int(key)] = float(bias)
    return out


def _logprobs(body: dict, chat: bool, response) -> None:
    """Completions: `logprobs: k` (0-5) -> each token's logprob and the k likeliest; chat:
    `logprobs: true` and `top_logprobs: k` (0-20, only with logprobs)."""
    if chat:
        asked = _bool(body, "logprobs")
        top = integer(body, "top_logprobs", 0, 0, TOP_LOGPROBS[True])
        if top and not asked:
            raise BodyError("top_logprobs: only with logprobs true", "top_logprobs",
                            "invalid_value")
    else:
        value = body.get("logprobs")
        asked = value is not None and value is not False
        top = integer(body, "logprobs", 0, 0, TOP_LOGPROBS[False]) if asked else 0
        response.prompt_logprobs = asked and _bool(body, "echo")
    response.token_logprobs, response.top_n_tokens = asked, top


def _content(i: int, content) -> str:
    """A message's text: a string, null (""), or a list of text parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise BodyError(f"messages[{i}].content: only text parts are supported",
                            f"messages[{i}].content", "unsupported_value")
        return "".join(p["text"] for p in content)
    raise BodyError(f"messages[{i}].content: a string or a list of text parts",
                    f"messages[{i}].content", "invalid_type")


# OpenAI's roles -> what a chat template knows ("developer" is OpenAI's newer name for the
# system message)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}


def chat_messages(messages) -> list[common_pb2.ChatMessage]:
    """The body's messages for the worker's chat template: roles system (developer), user,
    assistant (with its tool_calls) and tool (a call's result, its tool_call_id), text content;
    the deprecated function messages are refused."""
    if not isinstance(messages, list) or not messages:
        raise BodyError("messages: a non-empty list is required", "messages", "invalid_value")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or (
                "content" not in m and not m.get("tool_calls")):
            raise BodyError(f"messages[{i}]: each needs a string role and content",
                            f"messages[{i}]", "invalid_type")
        role = ROLES.get(m["role"])
        if role is None:
            raise BodyError(f"messages[{i}].role: {m['role']!r} is not supported (system, "
                            "developer, user, assistant, tool)", f"messages[{i}].role",
                            "unsupported_value")
        if m.get("function_call"):
            raise BodyError(f"messages[{i}].function_call: the deprecated function calling is "
                            "not supported (tool_calls is)", f"messages[{i}]",
                            "unsupported_value")
        msg = common_pb2.ChatMessage(role=role, content=_content(i, m.get("content")))
        if m.get("tool_calls"):
            msg.tool_calls.extend(_tool_calls(i, m["tool_calls"], role))
        if role == "tool":
            msg.tool_call_id = _string(m, "tool_call_id", f"messages[{i}]", required=True)
        msg.name = _string(m, "name", f"messages[{i}]")
        out.append(msg)
    return out


def _string(m: dict, key: str, where: str, required: bool = False) -> str:
    value = m.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise BodyError(f"{where}.{key}: a string is required", f"{where}.{key}",
                        "invalid_type")
    return value


def _tool_calls(i: int, calls, role: str) -> list[common_pb2.ToolCall]:
    """An assistant message's tool_calls: [{id, type: function, function: {name, arguments
    (JSON text)}}]."""
    where = f"messages[{i}].tool_calls"
    if role != "assistant" or not isinstance(calls, list):
        raise BodyError(f"{where}: a list, on an assistant message", where, "invalid_type")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("arguments", ""), str):
            raise BodyError(f"{where}[{j}]: {{id, type: function, function: {{name, arguments "
                            "(a JSON string)}}}", f"{where}[{j}]", "invalid_type")
        out.append(common_pb2.ToolCall(index=j, id=str(c.get("id") or ""), name=fn["name"],
                                       arguments=fn.get("arguments") or "{}"))
    return out
