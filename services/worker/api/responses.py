"""Per-token details of a response (TGIS's TokenInfo): the sampled token's log-probability and
the most likely alternatives, with their texts. Torch-free: the worker's front end builds the
protos from what the core sends."""
from __future__ import annotations

from services.common.gen.lorafleet.v1 import common_pb2


class TokenTexts:
    """Each token id's own text (the tokenizer's decode of it alone), cached: a response with
    top-20 alternatives looks up 21 a token."""

    def __init__(self, tokenizer):
        self._tokenizer, self._texts = tokenizer, {}

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self._tokenizer.decode([token], skip_special_tokens=False)
        return text


def payload(ids: list[int], logprobs: list | None, text: TokenTexts) -> list | None:
    """What the core sends for an event's tokens: per token (id, text, logprob,
    ((id, text, logprob), ...)); None without logprobs."""
    if logprobs is None:
        return None
    return [(t, text(t), lp[0], tuple((i, text(i), v) for i, v in lp[1]))
            for t, lp in zip(ids, logprobs)]


def prompt_payload(items: list | None, text: TokenTexts) -> list | None:
    """The prompt's details (TokenEvent.prompt_logprobs) in payload's shape."""
    if items is None:
        return None
    return [(t, text(t), lp, tuple((i, text(i), v) for i, v in top)) for t, lp, top in items]


def protos(items: list | None) -> list[common_pb2.TokenInfo]:
    """payload's items as TokenInfo messages."""
    if not items:
        return []
    return [common_pb2.TokenInfo(id=t, text=s, logprob=lp, top_tokens=[
        common_pb2.TopToken(id=i, text=x, logprob=v) for i, x, v in top])
        for t, s, lp, top in items]
