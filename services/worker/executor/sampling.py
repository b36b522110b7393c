"""Batched sampling: greedy, temperature, top-k, top-p, the repetition penalty, OpenAI's
presence and frequency penalties, logit biases, min_tokens, grammar masks, per-request seeds;
and the tokens' log-probabilities (`pack_logprobs`).

The logits go through, in order: logit biases, the EOS ban of rows short of min_tokens, the
repetition penalty, the presence and frequency penalties, the grammar's token mask
(structured output: services.worker.executor.token_mask), then temperature, top-k and top-p.
Log-probabilities are the model's own (log-softmax of the raw logits), as vLLM reports them
by default.

Randomness is counter-based: row i draws u = hash(seed_i, n_i) where n_i is the index of the
token being sampled, so a request with a seed gets the same tokens whatever else is in the
batch, and after a preemption and recompute. No per-row Python, no host sync.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_M1 = -0x61C8864680B583EB     # 0x9E3779B97F4A7C15 as a signed int64
_M2 = -0x40A7B892E31B1A47     # 0xBF58476D1CE4E5B9
_M3 = -0x6B2FB644ECCEEE15     # 0x94D049BB133111EB


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 (wrapping multiply; logical shifts via masking)."""
    mask = lambda s: (1 << (64 - s)) - 1  # noqa: E731 - keeps a logical right shift readable
    z = (z ^ ((z >> 30) & mask(30))) * _M2
    z = (z ^ ((z >> 27) & mask(27))) * _M3
    return z ^ ((z >> 31) & mask(31))


def counter_uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """A float64 uniform in [0, 1) per row from (seed, counter), both int64 [R]."""
    z = _mix(seed * _M1 + _mix(counter + 1))
    return ((z >> 11) & ((1 << 53) - 1)).double() / float(1 << 53)


@dataclass
class SamplingBatch:
    """Per-row parameters as tensors on the logits' device. R rows."""
    temperature: torch.Tensor | None   # float32 [R]; 0 = greedy (None: every row greedy)
    top_k: torch.Tensor            # int64 [R]; 0 = off
    top_p: torch.Tensor            # float32 [R]; 1 = off
    seed: torch.Tensor             # int64 [R]
    counter: torch.Tensor          # int64 [R] index of the token being sampled
    penalty: torch.Tensor | None   # float32 [R] repetition penalty, None when all rows are 1
    history: torch.Tensor | None   # int64 [R, L] prompt + output ids, padded with -1
    all_greedy: bool
    presence: torch.Tensor | None = None    # float32 [R] (None: every row 0, and frequency)
    frequency: torch.Tensor | None = None   # float32 [R]
    output: torch.Tensor | None = None      # int64 [R, L] output ids so far, padded with -1
    bias_ids: torch.Tensor | None = None    # int64 [R, B] logit-bias tokens (padding: 0 ...
    bias: torch.Tensor | None = None        # float32 [R, B] ... with bias 0)
    eos_ban: torch.Tensor | None = None     # bool [R] rows short of min_tokens
    eos_ids: torch.Tensor | None = None     # int64 [E] the model's end tokens
    logprobs: int = -1                      # the most alternatives a row asks for; -1: none
    constrained: bool = False               # some row has a grammar (its mask: allowed)
    allowed: torch.Tensor | None = None     # int32 [R, ceil(V/32)] token bitmask (1: allowed)

    @property
    def processed(self) -> bool:
        """Whether any logits processor runs (else greedy rows take the raw argmax)."""
        return (self.penalty is not None or self.presence is not None
                or self.bias_ids is not None or self.eos_ban is not None
                or self.allowed is not None)


def apply_repetition_penalty(logits: torch.Tensor, penalty: torch.Tensor,
                             history: torch.Tensor) -> torch.Tensor:
    """CTRL penalty on tokens already seen: positive logits / p, negative logits * p.

    Padding (-1) points at the row's first token, so every write to a column carries the same
    value (scatter with differing duplicates would keep an arbitrary one).
    """
    idx = torch.where(history >= 0, history, history[:, :1].clamp(min=0))
    seen = logits.gather(1, idx)
    p = penalty[:, None]
    adjusted = torch.where(seen > 0, seen / p, seen * p)
    return logits.scatter(1, idx, adjusted)


def apply_openai_penalties(logits: torch.Tensor, presence: torch.Tensor,
                           frequency: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """logits - frequency * count - presence * (count > 0), count = each token's occurrences
    in the row's output so far (padding -1 counts nowhere)."""
    counts = torch.zeros_like(logits).scatter_add_(
        1, output.clamp(min=0), (output >= 0).to(logits.dtype))
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def process(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """The processed fp32 logits (the module docstring's order)."""
    logits = logits.float()
    if b.bias_ids is not None:
        logits = logits.scatter_add(1, b.bias_ids, b.bias)
    if b.eos_ban is not None:
        cols = logits.index_select(1, b.eos_ids)
        logits = logits.index_copy(1, b.eos_ids,
                                   cols.masked_fill(b.eos_ban[:, None], float("-inf")))
    if b.penalty is not None:
        logits = apply_repetition_penalty(logits, b.penalty, b.history)
    if b.presence is not None:
        logits = apply_openai_penalties(logits, b.presence, b.frequency, b.output)
    if b.allowed is not None:
        logits = apply_bitmask(logits, b.allowed)
    return logits


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Semantics: out[r, v] = -inf if (bitmask[r, v // 32] >> (v % 32)) & 1 == 0 else
    logits[r, v]. logits float [R, V], bitmask int32 [R, ceil(V/32)] (an unconstrained row is
    all ones, so untouched). One batched op over the rows (a few elementwise launches), on the
    logits' device, never a host sync."""
    shifts = _SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _SHIFTS[logits.device] = torch.arange(32, dtype=torch.int32,
                                                       device=logits.device)
    r, v = logits.shape
    bits = (bitmask[:, :, None] >> shifts) & 1                       # [R, W, 32]
    allowed = bits.view(r, -1)[:, :v].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def pack_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """Per row: [token, its logprob, k top ids, their logprobs] as float64 [R, 2 + 2k] (one
    tensor, so one copy to the host; ids are exact in float64). Logprobs of the raw logits."""
    lp = logits.float().log_softmax(dim=-1)
    parts = [tokens[:, None].double(), lp.gather(1, tokens[:, None]).double()]
    if k > 0:
        top = lp.topk(k, dim=-1)
        parts += [top.indices.double(), top.values.double()]
    return torch.cat(parts, dim=1)


def unpack_logprobs(rows: list[list[float]], asked: list[int]) -> list[tuple]:
    """pack_logprobs' rows (as lists) -> per row (logprob, ((id, logprob), ...) its first
    asked[i] alternatives), or None for a row that asked for none (asked -1)."""
    out = []
    for r, k in zip(rows, asked):
        if k < 0:
            out.append(None)
            continue
        width = (len(r) - 2) // 2
        out.append((r[1], tuple((int(r[2 + j]), r[2 + width + j]) for j in range(k))))
    return out


def sample(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """logits [R, V] (any float dtype) -> token ids int64 [R]. An all-greedy batch with no
    logits processor takes the argmax of the logits as they are (bf16 values order as their
    fp32 copies); everything else computes on fp32 copies."""
    if b.all_greedy and not b.processed:
        return logits.argmax(dim=-1)
    logits = process(logits, b)
    greedy = logits.argmax(dim=-1)
    if b.all_greedy:
        return greedy
    temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
    sorted_logits, order = (logits / temp[:, None]).sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(logits.shape[1], device=logits.device)[None, :]
    k = torch.where(b.top_k > 0, b.top_k, torch.full_like(b.top_k, logits.shape[1]))
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs          # mass strictly before each token
    probs = probs.masked_fill((before >= b.top_p[:, None]) & (rank > 0), 0.0)
    cdf = probs.double().cumsum(dim=-1)
    u = counter_uniform(b.seed, b.counter) * cdf[:, -1]
    pick = torch.searchsorted(cdf, u[:, None], right=True).clamp(max=logits.shape[1] - 1)
    sampled = order.gather(1, pick).squeeze(1)
    return torch.where(b.temperature > 0, sampled, greedy)
