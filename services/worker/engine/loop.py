"""The engine loop: schedule, launch, post-process — on its own thread.

The device side is a `Runner` (services.worker.executor: the eager ModelRunner, the GraphRunner
that replays CUDA graphs, the FaultyRunner test hook): `run` a step and wait for its tokens, or
`launch` it and `collect` them later. The scheduler keeps the per-sequence bookkeeping of a step
(services.worker.engine.scheduler: what runs, what it computed, the next decode step of one in
flight); the engine turns sampled tokens into requests' events.

Overlap. With a runner that can launch a step without waiting (GraphRunner.launch), a decode
step is launched, and on the next call the step after it is launched from it (input tokens
gathered on the device) before the first one's tokens are read and post-processed: the host's
per-row work (detokenization, stop checks, events) and the next step's metadata run while the
GPU computes. This holds while every running sequence decodes; any other
step (arrivals, a queued request that could start, prefill, preemption, KV blocks short for the
next token) first collects the step in flight. (A mixed step replayed from a graph is launched
the same way; the decode step after it is launched from it when every running sequence sampled
in it.) A
sequence that stops on EOS or a stop sequence has had one more token computed, which is dropped;
one that reaches max_new_tokens is left out of the next step in advance.

A forward pass that raises (runner.run, launch or collect) is fatal: a device error leaves the
device unusable, so no step is retried. Every request in the engine ends with the error
(Stop.ERROR: INTERNAL), later submits are refused UNAVAILABLE (another worker may serve them),
and on_fatal tells the process, which drains (NOT_SERVING) and exits 1 for its supervisor. A
request's own refusals (InvalidArgument at submit) are not faults.

The servicer submits sequences and receives TokenEvents through a sink callback (called on the
engine thread; it must only hand the event over, e.g. loop.call_soon_threadsafe).

For the step profile (services.worker.engine.step_profile) the engine keeps what the runner said
the last collected step was (`last_step`, the runner's StepShape: a launched step's, or the
runner's `shape` after run), when its tokens reached the host (`last_step_at`, perf_counter) and
how many times the loop has waited idle (`idle_waits`); an on_step hook reads them.

Structured output. A sequence with a grammar (Sequence.matcher) is constrained by the runner: it
masks the grammar rows' logits before sampling and feeds their matchers the sampled tokens before
the engine sees them (services.worker.executor.token_mask; a step launched from one in flight
samples once that step is collected). The engine only ends such a sequence: as at EOS once its
grammar is complete (grammar_done), ERROR when its matcher refused its token (grammar_error: a
sampler fault; the token is dropped).
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from services.common.errors import InvalidArgument, Unavailable
from services.worker.engine.detokenizer import Detokenizer
from services.worker.engine.scheduler import Scheduled, Scheduler
from services.worker.engine.sequence import Sequence, Stop
from services.worker.engine.step_profile import StepShape

log = logging.getLogger(__name__)
_NO_STOP = Stop.NONE      # bound once: an enum member lookup costs ~0.1 µs, paid per row per step


@dataclass(slots=True)
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
    # with Sampling.logprobs >= 0: per token, (its logprob, ((id, logprob), ...) the top ones)
    logprobs: list | None = None
    # on the first token's event, with Sampling.prompt_logprobs >= 0: per prompt token from
    # the second, (token, its logprob, ((id, logprob), ...))
    prompt_logprobs: list | None = None


Sink = Callable[[TokenEvent], None]
# what a step gives back: the rows that sampled (in sample order), their new token ids, and
# their logprobs when some row asked (else None)
Sampled = tuple[list[Scheduled], list[int], list | None]


class Launched(Protocol):
    """A step a runner launched and has not collected yet."""
    batch: list[Scheduled]              # its rows that sample, in sample order
    shape: StepShape | None             # what the step was (None: the runner does not say)


class Runner(Protocol):
    """The device side of a step, as the engine drives it."""
    shape: StepShape | None             # what the step its last run() computed was

    def run(self, batch: list[Scheduled]) -> Sampled:
        """Compute one step and wait for its tokens."""

    def launch(self, batch: list[Scheduled], prev: Launched | None = None) -> Launched | None:
        """Start a step without waiting for it (prev: a step in flight whose sampled tokens
        are this one's inputs); None when this step cannot be launched ahead (run it)."""

    def collect(self, pending: Launched) -> Sampled:
        """Wait for a launched step's tokens."""


class Engine:
    def __init__(self, runner: Runner, scheduler: Scheduler, tokenizer,
                 eos_token_ids: tuple[int, ...], max_model_len: int, overlap: bool = True):
        self.runner, self.scheduler, self.tokenizer = runner, scheduler, tokenizer
        self.detok = Detokenizer(tokenizer)
        # launch steps ahead of their post-processing when the runner can (see module doc)
        self.overlap = overlap
        self._pending: Launched | None = None          # a launched step not yet collected
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, tuple[Sequence, Sink]] = {}
        self._timed: dict[str, Sequence] = {}        # the live requests with a time limit
        self._wake = threading.Event()
        self.steps = 0
        self.tokens_generated = 0
        # the step profile's inputs (see module doc)
        self.last_step: StepShape | None = None
        self.last_step_at = 0.0
        self.idle_waits = 0
        self.flush: Callable[[], None] | None = None   # called after each step (run)
        # called with the engine after each step (run): the metrics' hook (gauges.py)
        self.on_step: Callable[["Engine"], None] | None = None
        # called once, on the engine thread, when a step raised (see module doc)
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.failed = ""                               # the fatal error, once there is one

    # --- thread-safe entry points -------------------------------------------------------
    def submit(self, seq: Sequence, sink: Sink) -> None:
        """Queue a sequence; raises InvalidArgument if it can never fit, Unavailable once the
        engine has failed."""
        if self.failed:
            raise Unavailable(f"worker engine failed ({self.failed}); the worker is stopping")
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
        """Step until stop is set (then call wake()); idle, wait for a submit or an abort.
        After each step, flush() (when set) hands the step's events on in one go. A step that
        raises is fatal (_fatal); from then on requests that still arrive are failed."""
        while not stop.is_set():
            if self.failed:
                self._drain_inbox()
                busy = False
            else:
                try:
                    busy = self.step()
                except Exception as exc:  # noqa: BLE001 - fatal: every request is told
                    self._fatal(exc)
                    busy = True
            if self.flush is not None:
                self.flush()
            if self.on_step is not None:
                self.on_step(self)
            if not busy:
                self.idle_waits += 1
                self._wake.wait()
                self._wake.clear()

    def wake(self) -> None:
        """Wake an idle run() (e.g. to see its stop event)."""
        self._wake.set()

    def step(self) -> bool:
        """One step: schedule, launch, post-process; False when there was nothing to do."""
        self._arrivals()
        done, self._pending = self._pending, None          # the step in flight, if any
        batch = self._schedule(done)
        if done is None and not batch:
            return False
        ran = self._launch(batch, done) if batch else None     # None: launched (or none)
        if done is not None:
            self._post(self.runner.collect(done), done.shape)
        self._post(ran, self.runner.shape)
        return True

    def _arrivals(self) -> None:
        """Take the inbox's submits and aborts; end the requests past their time limit."""
        self._drain_inbox()
        if self._timed:
            self._expire()

    def _schedule(self, done: Launched | None) -> list[Scheduled] | None:
        """The next step's rows: with a step in flight (done), the decode step that continues
        it, when nothing new is queued and the scheduler has nothing else to do
        (Scheduler.continuation; None: done is collected first, the scheduler decides on the
        next call), else the scheduler's."""
        if done is None:
            return self.scheduler.schedule()
        if not self._inbox.empty():
            return None
        return self.scheduler.continuation(done.batch)

    def _launch(self, batch: list[Scheduled], done: Launched | None) -> Sampled | None:
        """Launch the step (from done, the step in flight, when it continues one) when the runner
        can, else run it, and count its tokens computed (Scheduler.advance); what it sampled when
        it ran. Raises: fatal (run)."""
        if done is not None:
            self._pending = self.runner.launch(batch, prev=done)
            if self._pending is not None:
                self.scheduler.advance_decode(batch)
            return None
        now = time.monotonic()              # when this step's new sequences were scheduled
        self._pending = self.runner.launch(batch) if self.overlap else None
        ran = self.runner.run(batch) if self._pending is None else None
        self.scheduler.advance(batch, now)
        return ran

    def _post(self, out: Sampled | None, shape: StepShape | None) -> None:
        """A step's sampled tokens to their sequences and requests (_append); None: none.
        shape: what the step was (kept with the time, for the step profile)."""
        if out is None:
            return
        self.last_step, self.last_step_at = shape, time.perf_counter()
        sampled, tokens, lps = out
        self.steps += 1
        self.tokens_generated += len(tokens)
        append = self._append
        if lps is None:
            for b, tok in zip(sampled, tokens):
                append(b, tok)
        else:
            for b, tok, lp in zip(sampled, tokens, lps):
                append(b, tok, lp)

    def _fatal(self, exc: Exception) -> None:
        """A step raised: end every request with the error, refuse new ones, tell on_fatal."""
        self.failed = f"{type(exc).__name__}: {exc}"
        self._pending = None
        log.critical("a forward pass failed; failing all %d requests and stopping the worker",
                     len(self._sinks), exc_info=exc)
        now = time.monotonic()
        for seq, _ in list(self._sinks.values()):
            if seq.first_scheduled is None:
                seq.first_scheduled = now
            try:
                self._finish(seq, Stop.ERROR, error=self.failed)
            except Exception:  # noqa: BLE001 - the engine's state may be broken: just tell it
                entry = self._sinks.pop(seq.request_id, None)
                if entry is not None:
                    entry[1](TokenEvent([], "", Stop.ERROR, error=self.failed))
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _drain_inbox(self) -> None:
        inbox = self._inbox
        while not inbox.empty():            # only this thread takes from the inbox
            kind, item, sink = inbox.get_nowait()
            if kind == "add" and self.failed:
                sink(TokenEvent([], "", Stop.ERROR, error=self.failed))
            elif kind == "add" and item.request_id in self._sinks:
                sink(TokenEvent([], "", Stop.ERROR, error=f"request_id {item.request_id!r} "
                                                          "is already running"))
            elif kind == "add":
                self._sinks[item.request_id] = (item, sink)
                if item.stopping.time_limit_s:
                    self._timed[item.request_id] = item
                self.scheduler.add(item)
            elif item in self._sinks:
                self._finish(self._sinks[item][0], Stop.CANCELLED)

    def _expire(self) -> None:
        """Finish the requests past their time limit (only those with one are looked at)."""
        now = time.monotonic()
        for seq in list(self._timed.values()):
            limit = seq.stopping.time_limit_s
            if seq.first_scheduled and now - seq.first_scheduled >= limit:
                self._finish(seq, Stop.TIME_LIMIT)

    def _append(self, b: Scheduled, token: int, lp: tuple | None = None) -> None:
        """A sampled token: add it to its sequence, then send its text or finish the request.
        Runs for every row of every step, so it is kept flat: attribute reads, one tokenizer
        call (_decode_new), and no stop-sequence work for sequences without stop sequences."""
        seq = b.seq
        entry = self._sinks.get(seq.request_id)
        if entry is None:
            return                                   # finished or cancelled meanwhile
        tokens, stopping = seq.tokens, seq.stopping
        tokens.append(token)
        if seq.first_token is None:
            seq.first_token = time.monotonic()
        if seq.grammar_done:               # the grammar is complete: as at EOS; or its matcher
            if seq.grammar_error:          # refused the token (a sampler fault): dropped, ERROR
                tokens.pop()
                self._finish(seq, Stop.ERROR, error=seq.grammar_error)
                return
            stop = Stop.EOS_TOKEN
        elif token in self.eos and not stopping.ignore_eos and seq.num_output >= \
                seq.sampling.min_tokens:
            stop = Stop.EOS_TOKEN
        elif len(tokens) - len(seq.prompt) >= stopping.max_new_tokens:     # seq.num_output
            stop = Stop.MAX_TOKENS
        else:
            stop = _NO_STOP
        if stopping.stops or len(seq.text) != len(seq.decoded):
            delta, matched = self.detok.detokenize(seq, final=stop is not _NO_STOP)
            if matched is not _NO_STOP:
                stop = matched
        else:              # no stop sequences: nothing is held back, all decoded text is sent
            delta = self.detok.decode_new(seq, final=stop is not _NO_STOP)
            if delta is None:
                delta = ""                           # a partial UTF-8 character: wait
            else:
                seq.text = seq.decoded
        lps = None if lp is None else [lp]
        prompt_lps, seq.prompt_lps = seq.prompt_lps, None       # with the first token only
        if prompt_lps is not None:                  # the first prompt token has no logprob
            prompt_lps.insert(0, (seq.prompt[0], math.nan, ()))
        if stop is _NO_STOP:
            entry[1](TokenEvent([token], delta, logprobs=lps, prompt_logprobs=prompt_lps))
        else:
            self._finish(seq, stop, last=([token], delta, lps), prompt_lps=prompt_lps)

    def _finish(self, seq: Sequence, stop: Stop, last=None, error: str = "",
                prompt_lps: list | None = None) -> None:
        """End a request: free its row and blocks, send the final event (with any text held
        back for stop sequences)."""
        entry = self._sinks.pop(seq.request_id, None)
        self._timed.pop(seq.request_id, None)
        self.scheduler.remove(seq)
        seq.stop = stop
        if entry is None:
            return
        if last is None:
            last = ([], self.detok.detokenize(seq, final=True)[0] if seq.num_output else "",
                    None)
        now = time.monotonic()
        start = seq.first_scheduled or now
        entry[1](TokenEvent(
            last[0], last[1], stop, prompt_tokens=len(seq.prompt),
            generated_tokens=seq.num_output, queue_s=start - seq.arrival,
            ttft_s=(seq.first_token or now) - seq.arrival, total_s=now - seq.arrival,
            error=error, logprobs=last[2], prompt_logprobs=prompt_lps))
