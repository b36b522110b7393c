"""The engine loop: schedule, run, post-process — on its own thread.

The servicer submits sequences and receives TokenEvents through a sink callback (called on the
engine thread; it must only hand the event over, e.g. loop.call_soon_threadsafe).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from services.common.errors import InvalidArgument
from services.worker.runner import ModelRunner
from services.worker.scheduler import Scheduled, Scheduler
from services.worker.sequence import Sequence, Stop

log = logging.getLogger(__name__)


@dataclass
class TokenEvent:
    """What a request gets after a step: new tokens and text, and the end when stop is set."""
    token_ids: list[int]
    text: str
    stop: Stop = Stop.NONE
    prompt_tokens: int = 0
    generated_tokens: int = 0
    queue_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0
    error: str = ""


Sink = Callable[[TokenEvent], None]


class Engine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, tokenizer,
                 eos_token_ids: tuple[int, ...], max_model_len: int):
        self.runner, self.scheduler, self.tokenizer = runner, scheduler, tokenizer
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, tuple[Sequence, Sink]] = {}
        self._wake = threading.Event()
        self.steps = 0
        self.tokens_generated = 0

    # --- thread-safe entry points -------------------------------------------------------
    def submit(self, seq: Sequence, sink: Sink) -> None:
        """Queue a sequence; raises InvalidArgument if it can never fit."""
        total = len(seq.prompt) + seq.stopping.max_new_tokens
        if not seq.prompt:
            raise InvalidArgument("prompt: empty")
        if seq.stopping.max_new_tokens < 1:
            raise InvalidArgument("stopping.max_new_tokens: must be at least 1")
        if total > self.max_model_len:
            raise InvalidArgument(
                f"prompt ({len(seq.prompt)}) + max_new_tokens ({seq.stopping.max_new_tokens}) "
                f"exceeds the model's {self.max_model_len} tokens")
        blocks = self.scheduler.blocks
        if blocks.blocks_for(total) > blocks.num_blocks:
            raise InvalidArgument(f"request needs {blocks.blocks_for(total)} KV blocks; the "
                                  f"cache has {blocks.num_blocks}")
        self._inbox.put(("add", seq, sink))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Cancel a request: its row and KV blocks are freed before the next step."""
        self._inbox.put(("abort", request_id, None))
        self._wake.set()

    @property
    def load(self) -> tuple[int, int, float]:
        s = self.scheduler
        return len(s.running), len(s.waiting), s.blocks.used_fraction

    # --- the loop -------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if not self.step():
                self._wake.wait(0.05)
                self._wake.clear()

    def step(self) -> bool:
        """One engine step; False when there was nothing to do."""
        self._drain_inbox()
        self._expire()
        batch = self.scheduler.schedule()
        if not batch:
            return False
        now = time.monotonic()
        for b in batch:
            if b.seq.first_scheduled is None:
                b.seq.first_scheduled = now
        try:
            sampled, tokens = self.runner.run(batch)
        except Exception as exc:  # noqa: BLE001 - one bad step must not kill the worker
            log.exception("step failed; failing its %d requests", len(batch))
            for b in batch:
                self._finish(b.seq, Stop.ERROR, error=f"{type(exc).__name__}: {exc}")
            return True
        for b in batch:
            b.seq.num_computed += b.num_tokens
        self.steps += 1
        self.tokens_generated += len(tokens)
        for b, tok in zip(sampled, tokens):
            self._append(b, tok)
        return True

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item, sink = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add" and item.request_id in self._sinks:
                sink(TokenEvent([], "", Stop.ERROR, error=f"request_id {item.request_id!r} "
                                                          "is already running"))
            elif kind == "add":
                self._sinks[item.request_id] = (item, sink)
                self.scheduler.add(item)
            elif item in self._sinks:
                self._finish(self._sinks[item][0], Stop.CANCELLED)

    def _expire(self) -> None:
        now = time.monotonic()
        for seq, _ in list(self._sinks.values()):
            limit = seq.stopping.time_limit_s
            if limit and seq.first_scheduled and now - seq.first_scheduled >= limit:
                self._finish(seq, Stop.TIME_LIMIT)

    def _append(self, b: Scheduled, token: int) -> None:
        seq = b.seq
        if seq.request_id not in self._sinks:
            return
        seq.tokens.append(token)
        if seq.first_token is None:
            seq.first_token = time.monotonic()
        stop = self._stop_reason(seq, token)
        delta, matched = self._detokenize(seq, final=stop is not Stop.NONE)
        stop = matched if matched is not Stop.NONE else stop
        if stop is Stop.NONE:
            self._sinks[seq.request_id][1](TokenEvent([token], delta))
        else:
            self._finish(seq, stop, last=([token], delta))

    def _stop_reason(self, seq: Sequence, token: int) -> Stop:
        if token in self.eos and not seq.stopping.ignore_eos:
            return Stop.EOS_TOKEN
        if seq.num_output >= seq.stopping.max_new_tokens:
            return Stop.MAX_TOKENS
        return Stop.NONE

    def _detokenize(self, seq: Sequence, final: bool) -> tuple[str, Stop]:
        """Text safe to emit since the last emit; STOP_SEQUENCE (text cut before it) if one
        matched. Until final, the last len(longest stop) - 1 characters are held back, since
        they may be the start of a stop sequence that the output must not contain."""
        full = self._decoded(seq, final)
        if full is None:
            return "", Stop.NONE          # a partial UTF-8 character: wait for the rest
        stops = [s for s in seq.stopping.stop_sequences if s]
        stop, end = Stop.NONE, len(full)
        for s in stops:
            at = full.find(s, max(0, len(seq.text) - len(s) + 1))
            if 0 <= at < end:
                stop, end = Stop.STOP_SEQUENCE, at
        if stop is Stop.NONE and not final and stops:
            end -= max(map(len, stops)) - 1
        if not full.startswith(seq.text):
            return "", stop               # the tokenizer rewrote emitted text: nothing new
        delta = full[len(seq.text):max(end, len(seq.text))]
        seq.text += delta
        return delta, stop

    def _decoded(self, seq: Sequence, final: bool) -> str | None:
        """All output text so far, decoding only a window of the newest tokens (the text of
        out[prefix:] minus that of out[prefix:read]), so a step costs O(1) per row, not O(n).
        None while the newest bytes end inside a UTF-8 character (unless final)."""
        start = len(seq.prompt)
        window = seq.tokens[start + seq.detok_prefix:]
        read = seq.detok_read - seq.detok_prefix
        before = self.tokenizer.decode(window[:read], skip_special_tokens=True) if read else ""
        now = self.tokenizer.decode(window, skip_special_tokens=True)
        if now.endswith("\ufffd") and not final:
            return None
        seq.decoded += now[len(before):]
        seq.detok_prefix, seq.detok_read = seq.detok_read, seq.num_output
        return seq.decoded

    def _finish(self, seq: Sequence, stop: Stop, last=None, error: str = "") -> None:
        """End a request: free its row and blocks, send the final event (with any text held
        back for stop sequences)."""
        entry = self._sinks.pop(seq.request_id, None)
        self.scheduler.remove(seq)
        seq.stop = stop
        if entry is None:
            return
        if last is None:
            last = ([], self._detokenize(seq, final=True)[0] if seq.num_output else "")
        now = time.monotonic()
        start = seq.first_scheduled or now
        entry[1](TokenEvent(
            last[0], last[1], stop, prompt_tokens=len(seq.prompt),
            generated_tokens=seq.num_output, queue_s=start - seq.arrival,
            ttft_s=(seq.first_token or now) - seq.arrival, total_s=now - seq.arrival,
            error=error))
