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


def logprobs(tokens, req, chat: bool) -> dict | None:
    """The OpenAI logprobs object of these tokens, when the request asked for them."""
    if not req.response.token_logprobs:
        return None
    return logprobs_json(tokens, chat, req.response.top_n_tokens)


def chunker(rid: str, model: str, chat: bool):
    created = int(time.time())

    def chunk(text, finish, role: bool = False, usage=None, logprobs=None,
              index: int = 0) -> bytes:
        if usage is not None:                      # the usage chunk: no choices
            data = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created, "model": model, "choices": [], "usage": usage}
            return b"data: " + json.dumps(data).encode() + b"\n\n"
        if chat:
            delta = {"role": "assistant"} if role else ({"content": text} if text else {})
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


def logprobs_json(tokens, chat: bool, top: int) -> dict | None:
    """The choice's (or a chunk's) `logprobs` object for these TokenInfo messages, in the
    endpoint's shape; None when none were asked for."""
    if chat:
        def entry(t):
            return {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}
        return {"content": [{**entry(t), "top_logprobs": [entry(a) for a in t.top_tokens]}
                            for t in tokens], "refusal": None}
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t.text)
    return {"tokens": [t.text for t in tokens],
            "token_logprobs": [None if math.isnan(t.logprob) else t.logprob for t in tokens],
            "top_logprobs": [{a.text: a.logprob for a in t.top_tokens} for t in tokens]
            if top else None, "text_offset": offsets}
