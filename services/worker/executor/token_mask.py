"""Structured output, the step side: each constrained row's token mask, computed on CPU threads
while the device runs the step's forward pass, then applied to the logits on the device in one
batched op before sampling (services.worker.executor.sampling.apply_bitmask).

A row's matcher (services.worker.api.grammar) is advanced with each token its sequence samples
(`advance`, by the runner, right after the step's tokens reach the host, before the engine
post-processes them), and then gives the mask of the tokens that keep the output a prefix of the
grammar's language (`build`: one bit a token, int32 words [R, ceil(V/32)], unconstrained rows all
ones). llguidance's executor computes the rows' masks on its own threads (`mask_threads`, the
GIL dropped), into one of two pinned host buffers used in turn, whose rows go to the device in
one copy that does not wait. A sequence whose grammar is complete is marked (grammar_done: the
engine ends it as at EOS); one whose matcher refuses its token (a sampler fault) is marked with
the error too (grammar_error: the engine ends it ERROR, the token dropped).

When the step was launched from one still in flight (services.worker.executor.graph_inputs),
its rows' matchers have not yet seen the tokens of the step before: its sampling waits
(`PendingStep.deferred`) until the runner has collected those tokens and advanced the matchers,
and the mask is computed then, while the device runs the forward pass. A step without
constrained rows computes and copies nothing, and its rows' logits are untouched.
"""
from __future__ import annotations

import logging
import time

import llguidance
import torch

from services.worker.engine.scheduler import Scheduled

log = logging.getLogger(__name__)
PARALLEL_ROWS = 8          # a step's constrained rows from which the executor's threads help
# (The matchers and the executor write into the host buffer through their own pointer calls:
# llguidance.torch's helpers wrap the same calls but its import pulls in torch.compile's
# machinery, ~5 s of every worker's start.)


def mask_threads(threads: int, device: torch.device) -> int:
    """--grammar-mask-threads: 0 = auto, 1 on a CPU worker (its own threads would compete
    with torch's for the cores), 4 on a GPU worker."""
    return threads or (1 if device.type == "cpu" else 4)


class TokenMasks:
    """Masks for steps of up to `rows` sampling rows over a vocabulary of `vocab` tokens (the
    logits' width)."""

    def __init__(self, vocab: int, rows: int, device: torch.device, threads: int):
        self.vocab, self.device = vocab, device
        self.words = (vocab + 31) // 32
        self.threads = threads
        self.executor = llguidance.LLExecutor(threads) if threads > 1 else None
        pin = device.type == "cuda"
        self._host = [torch.full((rows, self.words), -1, dtype=torch.int32, pin_memory=pin)
                      for _ in range(2)]
        self._flip = 0
        self.mask_seconds = 0.0            # host time computing masks (benchmarks read it)
        self.masks = 0                     # steps that built a mask
        self.advance_seconds = 0.0         # host time feeding sampled tokens to matchers

    def advance(self, sampled: list[Scheduled], tokens: list[int]) -> None:
        """Feed each constrained row's sampled token to its matcher; marks sequences whose
        grammar is complete (seq.grammar_done) and those whose matcher refused the token (a
        sampler fault: the mask did not allow it; seq.grammar_error as well)."""
        start = time.perf_counter()
        for b, tok in zip(sampled, tokens):
            seq = b.seq
            m = seq.matcher                    # (a sequence ended meanwhile: its token is
            if m is None or seq.grammar_done or seq.stop:                     # dropped)
                continue
            if not m.consume_token(tok):
                error = m.get_error() or "token refused"
                log.error("request %s: its grammar refused a sampled token: %s",
                          seq.request_id, error)
                seq.grammar_error, seq.grammar_done = f"structured output: {error}", True
            elif m.is_stopped():
                seq.grammar_done = True
        self.advance_seconds += time.perf_counter() - start

    def build(self, sampled: list[Scheduled]) -> torch.Tensor | None:
        """The bitmask of these rows (in sampling order) on the device, int32 [R, words];
        None when no row is constrained."""
        rows = [(b.seq.matcher, i) for i, b in enumerate(sampled)
                if b.seq.matcher is not None]
        if not rows:
            return None
        start = time.perf_counter()
        host = self._host[self._flip][:len(sampled)]
        self._flip ^= 1
        host.fill_(-1)
        row_bytes = self.words * 4
        if self.executor is not None and len(rows) >= PARALLEL_ROWS:
            self.executor.unsafe_compute_mask_ptr(rows, host.data_ptr(), row_bytes, len(sampled))
        else:
            for m, i in rows:
                m.unsafe_compute_mask_ptr(host[i].data_ptr(), row_bytes)
        self.mask_seconds += time.perf_counter() - start
        self.masks += 1
        return host.to(self.device, non_blocking=True)
