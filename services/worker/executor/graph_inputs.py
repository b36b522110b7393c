"""The static inputs that captured CUDA graphs read (services.worker.executor.graph_runner), and a
step launched from one (`PendingStep`: `start_sampling` samples its rows and starts their copy to
the host, `collect` waits for them).

`StaticInputs` owns two packed device buffers (int64 rows: input ids, positions, KV slots, the
gather index of a step launched from one in flight, a mixed step's sample rows, each row's
dynamic-RoPE length; int32: q_seq and
q_pos per row, the LoRA segments and block tables per sequence) and two sets of pinned host staging
buffers used in turn: with overlap, step N+1 is filled while step N's copies may still be queued
behind step N-1. A step is written by the step-input builder
(services.worker.executor.step_inputs.StepBuilder.fill) into the next host set, then two
host-to-device copies.

Structured output (services.worker.executor.token_mask). A step with grammar rows builds their
token masks before it samples; `collect` feeds a step's tokens to its grammar rows' matchers as
soon as they reach the host. A step with grammar rows launched from one still in flight cannot
sample yet (its masks need the tokens in flight): it is left deferred, and `collect` of the step
it was launched from samples it (`finish_sampling`) right after advancing the matchers, so its
masks are computed while the device runs its forward pass.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.worker.engine.scheduler import Scheduled
from services.worker.engine.step_profile import StepShape
from services.worker.executor.sampling import pack_logprobs, sample, unpack_logprobs
from services.worker.executor.step_inputs import HostViews, StepBuilder, StepPlan, sampling_batch


@dataclass
class PendingStep:
    """A launched step: its sampling rows in sample order and their tokens on the way."""
    batch: list[Scheduled]
    tokens: torch.Tensor | None          # int64 [n] on the device (None while deferred)
    host: torch.Tensor                   # int64 [n], pinned: the copy's destination
    done: torch.cuda.Event | None        # recorded after the copy (None on CPU)
    logprobs: torch.Tensor | None = None  # pack_logprobs' rows, host (pinned): when asked
    masks: object = None                 # with grammar rows: the runner's TokenMasks
    # not sampled yet (grammar rows, launched from a step in flight): finish_sampling samples
    # the logits with these parameters once the matchers have seen that step's tokens
    deferred: bool = False
    logits: torch.Tensor | None = None
    params: object = None
    then: "PendingStep | None" = None    # a deferred step launched from this one (collect)
    shape: StepShape | None = None       # what the step was (the runner's; the step profile)


def size32(rows: int, seqs: int, mb: int) -> int:
    return 2 * rows + 2 * seqs + 1 + seqs * mb


def split32(buf: torch.Tensor, rows: int, seqs: int, mb: int):
    """Views of the int32 buffer: q_seq [rows], q_pos [rows], seg_start [seqs+1],
    seg_slot [seqs], block tables [seqs, mb]."""
    q_seq, q_pos = buf[:rows], buf[rows:2 * rows]
    at = 2 * rows
    seg_start, seg_slot = buf[at:at + seqs + 1], buf[at + seqs + 1:at + 2 * seqs + 1]
    return q_seq, q_pos, seg_start, seg_slot, buf[at + 2 * seqs + 1:].view(seqs, mb)


class _HostSet:
    """One set of pinned staging buffers (host64 [6, rows], host32 as split32), the sampled
    tokens' copy target; the step builder's views of them."""

    def __init__(self, rows: int, seqs: int, mb: int, pin: bool):
        self.host64 = torch.zeros(6, rows, dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(size32(rows, seqs, mb), dtype=torch.int32, pin_memory=pin)
        self.tokens = torch.zeros(seqs, dtype=torch.int64, pin_memory=pin)
        h = self.host64.numpy()
        q_seq, q_pos, seg_start, seg_slot, tables = (
            t.numpy() for t in split32(self.host32, rows, seqs, mb))
        self.views = HostViews(h[0], h[1], h[2], q_seq, seg_start, seg_slot, tables,
                               q_pos=q_pos, src=h[3], rope_len=h[5])
        self.sample_rows = h[4]


class StaticInputs:
    """Buffers for steps of up to `rows` rows over up to `seqs` sequences (block tables of mb
    blocks), and their fill."""

    def __init__(self, steps: StepBuilder, rows: int, seqs: int, mb: int, dev: torch.device):
        self.steps = steps
        self.dev64 = torch.zeros(6, rows, dtype=torch.int64, device=dev)
        self.dev32 = torch.zeros(size32(rows, seqs, mb), dtype=torch.int32, device=dev)
        self._sets = [_HostSet(rows, seqs, mb, dev.type == "cuda") for _ in range(2)]
        self._flip = 0
        self.filled = self._sets[0]              # the set the last fill wrote
        self.ids, self.pos, self.slots = self.dev64[0], self.dev64[1], self.dev64[2]
        self.sample_rows, self.rope_len = self.dev64[4], self.dev64[5]
        self.q_seq, self.q_pos, self.seg_start, self.seg_slot, self.tables = split32(
            self.dev32, rows, seqs, mb)

    def fill(self, plan: StepPlan, b: int, src: np.ndarray | None = None,
             lens: np.ndarray | None = None, seqs: int | None = None,
             sample_rows: np.ndarray | None = None) -> int:
        """Write a step's inputs for b rows into the next host set (the step builder: padding
        rows inert), then two host-to-device copies. src: for a decode step launched from one
        in flight, where each row's input token is in that step's sampled tokens (the ids are
        then gathered on the device). A mixed step: lens, each sequence's rows; seqs, the
        sequences its graph holds; sample_rows, the rows that sample (the rest of the seqs
        entries read row 0). Returns the step's LoRA segments (StepBuilder.fill's G)."""
        hs = self.filled = self._sets[self._flip]
        self._flip ^= 1
        segments = self.steps.fill(plan, hs.views, lens, pad=b, src=src, pad_seqs=seqs)[2]
        if sample_rows is not None:
            hs.sample_rows[:len(sample_rows)] = sample_rows
            hs.sample_rows[len(sample_rows):seqs] = 0
        self.dev64.copy_(hs.host64, non_blocking=True)
        self.dev32.copy_(hs.host32, non_blocking=True)
        return segments


def start_sampling(batch: list[Scheduled], logits: torch.Tensor, prev: PendingStep | None,
                   eos: tuple[int, ...], host_tokens: torch.Tensor,
                   masks=None) -> PendingStep:
    """Sample a launched step's rows (batch, in logits' row order; prev: the step in flight it
    was launched from, if any) and start the copy of their tokens (into host_tokens, pinned) and
    logprobs, when asked, to the host. masks: the runner's TokenMasks (structured output); a
    step with grammar rows launched from prev is returned deferred, sampled by collect(prev)."""
    if not batch:         # prompt chunks only: nothing sampled, but an event all the same
        done = torch.cuda.Event() if logits.is_cuda else None  # (collect waits: the
        if done is not None:                  # staging set is not refilled under a copy)
            done.record()
        return PendingStep([], logits.new_empty(0, dtype=torch.int64),
                           torch.empty(0, dtype=torch.int64), done)
    params = sampling_batch(batch, logits.device, ahead=int(prev is not None), eos=eos)
    step = PendingStep(batch, None, host_tokens[:len(batch)], None, logits=logits,
                       params=params)
    if params.constrained and masks is not None:
        step.masks = masks
        if prev is not None:         # the matchers wait for the tokens in flight
            step.deferred, prev.then = True, step
            return step
    return finish_sampling(step)


def finish_sampling(step: PendingStep) -> PendingStep:
    """Sample a step's rows (with its grammar rows' masks, built now: on the host while the
    device runs the forward pass) and start the copy of their tokens and logprobs, when asked,
    to the host."""
    logits, params = step.logits, step.params
    if step.masks is not None:
        params.allowed = step.masks.build(step.batch)
    step.deferred = False
    tokens = step.tokens = sample(logits, params)
    step.host.copy_(tokens, non_blocking=True)
    if params.logprobs >= 0:         # asked for: their copy rides the same event
        packed = pack_logprobs(logits, tokens, params.logprobs)
        step.logprobs = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=tokens.is_cuda)
        step.logprobs.copy_(packed, non_blocking=True)
    if tokens.is_cuda:
        step.done = torch.cuda.Event()
        step.done.record()
    step.logits = step.params = None
    return step


def collect(pending: PendingStep) -> tuple[list[Scheduled], list[int], list | None]:
    """Wait for a launched step's tokens: (its rows, their new token ids, their logprobs
    or None, as ModelRunner.run). Its grammar rows' matchers are fed the tokens, then a
    deferred step launched from it is sampled (see the module doc)."""
    if pending.done is not None:
        pending.done.synchronize()
    tokens = pending.host.tolist()
    lps = None
    if pending.logprobs is not None:
        lps = unpack_logprobs(pending.logprobs.tolist(),
                              [b.seq.sampling.logprobs for b in pending.batch])
    if pending.masks is not None:
        pending.masks.advance(pending.batch, tokens)
    if pending.then is not None:
        finish_sampling(pending.then)
        pending.then = None
    return pending.batch, tokens, lps
