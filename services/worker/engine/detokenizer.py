"""A request's output text as its tokens arrive: incremental detokenization and stop sequences.

The engine calls it for every row of every step (services.worker.engine.loop._append), so a step
costs O(1) a row: only a window of the newest tokens is decoded, a decode step's previous
token's text is memoised, and the text held back for stop sequences is bounded by the longest.
"""
from __future__ import annotations

from services.worker.engine.sequence import Sequence, Stop

_NO_STOP = Stop.NONE
TOKEN_TEXTS_MAX = 1 << 18          # single-token texts memoised (a vocabulary's worth)


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def detokenize(self, seq: Sequence, final: bool) -> tuple[str, Stop]:
        """Text safe to emit since the last emit; STOP_SEQUENCE (text cut before it) if one
        matched. Until final, the last len(longest stop) - 1 characters are held back, since
        they may be the start of a stop sequence that the output must not contain."""
        full = self.decoded(seq, final)
        if full is None:
            return "", _NO_STOP           # a partial UTF-8 character: wait for the rest
        text, stopping = seq.text, seq.stopping
        stop, end = _NO_STOP, len(full)
        for s in stopping.stops:
            at = full.find(s, max(0, len(text) - len(s) + 1))
            if 0 <= at < end:
                stop, end = Stop.STOP_SEQUENCE, at
        if stop is _NO_STOP and not final:
            end -= stopping.held_back
        if not full.startswith(text):
            return "", stop               # the tokenizer rewrote emitted text: nothing new
        delta = full[len(text):max(end, len(text))]
        seq.text = text + delta
        return delta, stop

    def decoded(self, seq: Sequence, final: bool) -> str | None:
        """All output text so far (see decode_new); None while the newest bytes end inside a
        UTF-8 character (unless final)."""
        return None if self.decode_new(seq, final) is None else seq.decoded

    def decode_new(self, seq: Sequence, final: bool) -> str | None:
        """Decode the newest output tokens and append their text to seq.decoded; returns that
        text, or None while the newest bytes end inside a UTF-8 character (unless final).

        Only a window of the newest tokens is decoded (the text of out[prefix:] minus that of
        out[prefix:read]), so a step costs O(1) per row, not O(n). In a decode step
        out[prefix:read] is the previous step's one token, whose text is memoised."""
        start, prefix = len(seq.prompt), seq.detok_prefix
        window = seq.tokens[start + prefix:]
        read = seq.detok_read - prefix
        if read == 1:
            before = self.token_text(window[0])
        else:
            before = self.tokenizer.decode(window[:read], skip_special_tokens=True) if read else ""
        now = self.tokenizer.decode(window, skip_special_tokens=True)
        if now.endswith("\ufffd") and not final:
            return None
        piece = now[len(before):]
        seq.decoded += piece
        seq.detok_prefix, seq.detok_read = seq.detok_read, len(seq.tokens) - start
        return piece

    def token_text(self, token: int) -> str:
        """tokenizer.decode([token], skip_special_tokens=True), memoised."""
        text = self._texts.get(token)
        if text is None:
            text = self.tokenizer.decode([token], skip_special_tokens=True)
            if len(self._texts) < TOKEN_TEXTS_MAX:
                self._texts[token] = text
        return text
