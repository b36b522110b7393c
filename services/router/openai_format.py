"""OpenAI response bodies: usage, logprobs objects and streamed chunks (the router's HTTP
gateway, services.router.openai_gateway)."""
from __future__ import annotations

import json
import math
import time


def usage_json(usages) -> dict:
    """OpenAI's usage of n choices: the prompt once, every choice's completion tokens."""
    prompt = usages[0].prompt_tokens if usages else 0
    completion = sum(u.generated_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def logprobs(tokens, req, chat: bool, text: str | None = None, start: int = 0) -> dict | None:
    """The OpenAI logprobs object of these tokens, when the request asked for them; text:
    what the reply carries for them, which starts at `start` in the choice's text."""
    if not req.response.token_logprobs:
        return None
    return logprobs_json(tokens, chat, req.response.top_n_tokens, text, start)


def chunker(rid: str, model: str, chat: bool):
    created = int(time.time())

    def chunk(text, finish, role: bool = False, usage=None, logprobs=None,
              index: int = 0, tool_calls=()) -> bytes:
        if usage is not None:                      # the usage chunk: no choices
            data = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created, "model": model, "choices": [], "usage": usage}
            return b"data: " + json.dumps(data).encode() + b"\n\n"
        if chat:
            delta = {"role": "assistant"} if role else ({"content": text} if text else {})
            if tool_calls:
                delta["tool_calls"] = [{**call_json(c), "index": c.index} for c in tool_calls]
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "", "finish_reason": finish,
                      "logprobs": logprobs}
            obj = "text_completion"
        data = {"id": rid, "object": obj, "created": created, "model": model,
                "choices": [choice]}
        return b"data: " + json.dumps(data).encode() + b"\n\n"
    return chunk


def call_json(call) -> dict:
    """OpenAI's tool call object of a ToolCall."""
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def message_json(text: str, calls) -> dict:
    """A chat reply's message: its text (null when it is only calls) and its tool calls."""
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None,
            "tool_calls": [call_json(c) for c in calls]}


def text_offsets(tokens, text: str | None, start: int = 0) -> list[int]:
    """Each token's offset in the choice's text, of which `text` (the tokens' part of it)
    starts at `start`: an index into what the reply returns. A token whose text the reply does
    not hold there (the prompt's BOS `<s>` under echo, a stop sequence's cut) is zero-width."""
    offsets, at = [], 0
    for t in tokens:
        offsets.append(start + at)
        if text is None or text.startswith(t.text, at):
            at += len(t.text)
    return offsets


def logprobs_json(tokens, chat: bool, top: int, text: str | None = None,
                  start: int = 0) -> dict | None:
    """The choice's (or a chunk's) `logprobs` object for these TokenInfo messages, in the
    endpoint's shape (text, start: text_offsets)."""
    if chat:
        def entry(t):
            return {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}
        return {"content": [{**entry(t), "top_logprobs": [entry(a) for a in t.top_tokens]}
                            for t in tokens], "refusal": None}
    return {"tokens": [t.text for t in tokens],
            "token_logprobs": [None if math.isnan(t.logprob) else t.logprob for t in tokens],
            "top_logprobs": [{a.text: a.logprob for a in t.top_tokens} for t in tokens]
            if top else None, "text_offset": text_offsets(tokens, text, start)}
