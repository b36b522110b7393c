"""Batched sampling against transformers' logits processors and its own distribution."""
from __future__ import annotations

import torch
from transformers import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from services.worker.executor.sampling import (SamplingBatch, apply_repetition_penalty,
                                               counter_uniform, sample)


def batch(rows, temperature=1.0, top_k=0, top_p=1.0, seed=None, counter=0, penalty=None,
          history=None) -> SamplingBatch:
    full = lambda v, dt: torch.full((rows,), v, dtype=dt)  # noqa: E731
    return SamplingBatch(
        temperature=full(temperature, torch.float32), top_k=full(top_k, torch.int64),
        top_p=full(top_p, torch.float32),
        seed=torch.arange(rows, dtype=torch.int64) if seed is None else full(seed, torch.int64),
        counter=full(counter, torch.int64), penalty=penalty, history=history,
        all_greedy=temperature <= 0)


def test_repetition_penalty_matches_hf_with_padding():
    """Rows of different history lengths (padded with -1), token 0 seen in a short row."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 3
    hists = [[0, 7, 7], [3, 4, 5, 6, 7, 8, 9, 0], [49]]
    penalty = torch.tensor([1.5, 1.2, 0.8])
    history = torch.full((3, 8), -1, dtype=torch.int64)
    for i, h in enumerate(hists):
        history[i, :len(h)] = torch.tensor(h)
    got = apply_repetition_penalty(logits, penalty, history)
    for i, h in enumerate(hists):
        ref = RepetitionPenaltyLogitsProcessor(float(penalty[i]))(torch.tensor([h]),
                                                                 logits[i:i + 1].clone())
        torch.testing.assert_close(got[i], ref[0])


def hf_probs(logits, temperature, top_k, top_p) -> torch.Tensor:
    scores = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)[0]


def test_distribution_matches_hf_warpers():
    """20k rows with one logit vector and different seeds: token frequencies follow what
    transformers' temperature/top-k/top-p warpers leave, and nothing outside it is drawn."""
    logits = torch.randn(24, generator=torch.Generator().manual_seed(1)) * 2
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                      (0.9, 10, 0.6)]:
        rows = 20_000
        b = batch(rows, temperature, top_k, top_p)
        tokens = sample(logits.expand(rows, -1).contiguous(), b)
        freq = torch.bincount(tokens, minlength=24).double() / rows
        ref = hf_probs(logits, temperature, top_k, top_p).double()
        assert (freq[ref == 0] == 0).all(), (temperature, top_k, top_p)
        assert (freq - ref).abs().max() < 0.015, (temperature, top_k, top_p)


def test_same_seed_and_counter_same_token_whatever_the_batch():
    g = torch.Generator().manual_seed(2)
    target = torch.randn(1, 64, generator=g)
    alone = sample(target, batch(1, 0.8, 0, 1.0, seed=99, counter=5))
    others = torch.randn(7, 64, generator=g)
    mixed = batch(8, 0.8, 0, 1.0, counter=5)
    mixed.seed[3] = 99
    got = sample(torch.cat([others[:3], target, others[3:]]), mixed)
    assert got[3] == alone[0]
    draws = {int(sample(target, batch(1, 2.0, 0, 1.0, seed=99, counter=n))) for n in range(40)}
    assert len(draws) > 5                      # the counter moves the stream on


def test_greedy_rows_beside_sampled_rows():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(3))
    b = batch(6, 1.5)
    b.temperature[::2] = 0.0
    b.all_greedy = False
    got = sample(logits, b)
    assert torch.equal(got[::2], logits[::2].argmax(-1))


def test_counter_uniform_is_uniform_and_distinct():
    seeds = torch.arange(50_000, dtype=torch.int64)
    u = counter_uniform(seeds, torch.zeros_like(seeds))
    assert 0 <= u.min() and u.max() < 1
    hist = torch.histc(u.float(), bins=10, min=0, max=1) / len(u)
    assert (hist - 0.1).abs().max() < 0.01
    assert len(set(u.tolist())) == len(u)
    v = counter_uniform(seeds, torch.ones_like(seeds))
    assert abs(torch.corrcoef(torch.stack([u, v]))[0, 1]) < 0.02


def test_bf16_logits_sample_as_their_fp32_copies():
    """The engine hands sample() logits in the model's dtype: a greedy batch takes their argmax
    as they are (ties included: the first maximum), every other batch the tokens of their
    fp32 copies (sampled rows, greedy rows beside them, a penalty)."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(8, 300, generator=g) * 4).to(torch.bfloat16)
    logits[3, 17] = logits[3, 250] = logits[3].max() + 1          # a tie: the first wins
    wide = logits.float()
    greedy = batch(8, 0.0)
    assert sample(logits, greedy).dtype == torch.int64
    assert torch.equal(sample(logits, greedy), wide.argmax(-1))
    assert int(sample(logits, greedy)[3]) == 17
    mixed = batch(8, 0.8, top_k=40, top_p=0.9, seed=7, counter=3)
    mixed.temperature[::3] = 0.0
    assert torch.equal(sample(logits, mixed), sample(wide, mixed))
    history = torch.randint(0, 300, (8, 5), generator=g)
    pen = batch(8, 0.0, penalty=torch.full((8,), 1.3), history=history)
    assert torch.equal(sample(logits, pen), sample(wide, pen))
