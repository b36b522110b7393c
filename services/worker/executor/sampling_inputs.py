"""A step's sampling parameters as tensors (`sampling_batch`), built from its rows' Sampling.

The usual all-greedy batch with nothing else asked takes no tensors at all (one pass over the
rows' `Sampling.plain`). Otherwise the parameters go over in two packed copies (float32 and
int64 rows) from pinned memory without waiting on CUDA, so a graph decode step builds them
while its graph runs; the token histories (penalties), logit biases and the EOS ban
(min_tokens) only when some row asks for them.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from services.worker.engine.scheduler import Scheduled
from services.worker.executor.sampling import SamplingBatch

GREEDY = SamplingBatch(None, None, None, None, None, None, None, all_greedy=True)


def sampling_batch(sampled: list[Scheduled], device: torch.device, ahead: int = 0,
                   eos: tuple[int, ...] = ()) -> SamplingBatch:
    """The rows' sampling parameters on device. ahead: output tokens each row has beyond
    seq.tokens (sampled in a step still in flight), so that the counter of the token drawn
    (and min_tokens) count the output all the same; eos: the model's end tokens, which rows
    short of their min_tokens may not sample."""
    for b in sampled:                       # one pass, for the usual all-greedy batch
        if not b.seq.sampling.plain:
            break
    else:                                   # argmax needs no parameters
        return GREEDY
    params = [b.seq.sampling for b in sampled]
    outputs = np.fromiter((b.seq.num_output + ahead for b in sampled), np.int64, len(sampled))
    floats = np.array([[p.temperature for p in params],
                       [p.top_p if 0 < p.top_p < 1 else 1.0 for p in params],
                       [p.repetition_penalty or 1.0 for p in params],
                       [p.presence_penalty for p in params],
                       [p.frequency_penalty for p in params]], dtype=np.float32)
    ints = np.array([[p.top_k for p in params], [p.seed for p in params], outputs],
                    dtype=np.int64)
    f32, i64 = _host_to_device(floats, device), _host_to_device(ints, device)
    repetition = any(p.repetition_penalty not in (0.0, 1.0) for p in params)
    openai = any(p.presence_penalty or p.frequency_penalty for p in params)
    batch = SamplingBatch(
        temperature=f32[0], top_k=i64[0], top_p=f32[1], seed=i64[1], counter=i64[2],
        penalty=f32[2] if repetition else None,
        history=_host_to_device(_history(sampled, False), device) if repetition else None,
        all_greedy=all(p.greedy for p in params),
        presence=f32[3] if openai else None, frequency=f32[4] if openai else None,
        output=_host_to_device(_history(sampled, True), device) if openai else None,
        logprobs=max(p.logprobs for p in params),
        constrained=any(p.constrained for p in params))
    if any(p.logit_bias for p in params):
        batch.bias_ids, batch.bias = (_host_to_device(a, device) for a in _biases(params))
    mins = np.fromiter((p.min_tokens for p in params), np.int64, len(params))
    if eos and (mins > outputs).any():
        batch.eos_ban = _host_to_device(mins > outputs, device)
        batch.eos_ids = _host_to_device(np.array(eos, dtype=np.int64), device)
    return batch


def _history(sampled: list[Scheduled], output_only: bool) -> np.ndarray:
    """Prompt + output ids (or the output only) of each row, padded with -1: int64 [R, L]."""
    start = [len(b.seq.prompt) if output_only else 0 for b in sampled]
    lens = np.fromiter((len(b.seq.tokens) - s for b, s in zip(sampled, start)), np.int64,
                       len(sampled))
    hist = np.full((len(sampled), max(1, int(lens.max()))), -1, dtype=np.int64)
    hist[np.arange(hist.shape[1]) < lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(b.seq.tokens[s:] for b, s in zip(sampled, start)),
        dtype=np.int64, count=int(lens.sum()))
    return hist


def _biases(params) -> tuple[np.ndarray, np.ndarray]:
    """Each row's logit biases, padded (token 0, bias 0): int64 ids and float32 [R, B]."""
    width = max(len(p.logit_bias) for p in params)
    ids = np.zeros((len(params), width), dtype=np.int64)
    vals = np.zeros((len(params), width), dtype=np.float32)
    for i, p in enumerate(params):            # rows with biases only: a request's option
        if p.logit_bias:
            ids[i, :len(p.logit_bias)], vals[i, :len(p.logit_bias)] = zip(*p.logit_bias)
    return ids, vals


def _host_to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on device: on CUDA through pinned memory, without a host sync."""
    t = torch.from_numpy(a)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
