"""Batched sampling: greedy, temperature, top-k, top-p, repetition penalty, per-request seeds.

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


def sample(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """logits [R, V] (any float dtype) -> token ids int64 [R]. An all-greedy batch without a
    penalty takes the argmax of the logits as they are (bf16 values order as their fp32
    copies); everything else computes on fp32 copies."""
    if b.all_greedy and b.penalty is None:
        return logits.argmax(dim=-1)
    logits = logits.float()
    if b.penalty is not None:
        logits = apply_repetition_penalty(logits, b.penalty, b.history)
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
