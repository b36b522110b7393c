"""The worker's Generate responses, built in one place for both processes: a step's tokens
(`token_response`) and a call's last response with its usage and timings (`final_response`,
from a link Final that `final` makes of the engine's last event), with per-token details (TGIS's
TokenInfo: the sampled token's log-probability and the most likely alternatives, with their
texts). Torch-free: the front end builds the protos from what the core sends; the in-process
servicer builds the same ones from the engine's events.
"""
from __future__ import annotations

from services.common.gen.lorafleet.v1 import common_pb2, worker_pb2 as wpb
from services.worker.api.link import Final


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


def details(ev, text: TokenTexts) -> tuple | None:
    """An engine event's (services.worker.engine.loop.TokenEvent) token details as the link
    carries them: (payload, prompt_payload); None when it has neither."""
    if ev.logprobs is None and ev.prompt_logprobs is None:
        return None
    return payload(ev.token_ids, ev.logprobs, text), prompt_payload(ev.prompt_logprobs, text)


def final(h: int, ev, cold_load_s: float, tier: int, token_details: tuple | None) -> Final:
    """A call's last engine event (stop set) as the link's Final (h: the call's handle)."""
    return Final(h, ev.token_ids, ev.text, int(ev.stop), ev.prompt_tokens, ev.generated_tokens,
                 ev.queue_s, ev.ttft_s, ev.total_s, ev.error, cold_load_s, tier, token_details)


def token_response(token_ids: list[int], text: str, token_details: tuple | None
                   ) -> wpb.WorkerGenerateResponse:
    """A response with a step's tokens of one call (token_details: as details gives them)."""
    tokens, prompt = token_details or (None, None)
    return wpb.WorkerGenerateResponse(token_ids=token_ids, text=text, tokens=protos(tokens),
                                      prompt_tokens=protos(prompt))


def final_response(f: Final) -> wpb.WorkerGenerateResponse:
    """A call's last response: its last tokens, the stop reason, usage and timings."""
    out = token_response(f.token_ids, f.text, f.details)
    out.stop_reason = f.stop
    out.usage.prompt_tokens, out.usage.generated_tokens = f.prompt_tokens, f.generated_tokens
    t = out.timings
    t.queue_s, t.time_to_first_token_s, t.total_s = f.queue_s, f.ttft_s, f.total_s
    t.cold_load_s, t.adapter_tier = f.cold_load_s, f.tier
    return out
