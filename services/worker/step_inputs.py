"""Build one step's model inputs in one place: token ids, positions, KV slots, block tables,
LoRA segments and sampling parameters, copied into buffers allocated once.

Rows are ordered by adapter slot, so rows sharing an adapter form one contiguous segment for
the SGMV kernel; a sequence's rows stay together and in order.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from kernels.sgmv import only_live_segment
from services.worker.model import StepContext
from services.worker.sampling import SamplingBatch
from services.worker.scheduler import Scheduled


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    ctx: StepContext
    sampling: SamplingBatch
    sampled: list[Scheduled]          # the entries that produce a token, in sample-row order


class InputBuffers:
    """Host (pinned on CUDA) and device buffers sized for the largest step."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        pin = device.type == "cuda"
        def pair(shape, dtype):
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return host, torch.zeros(shape, dtype=dtype, device=device)
        self.device = device
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        # rows: ids, positions, slots, q_seq ; seqs: sample rows ; segments: start/slot
        self.rows = pair((4, max_tokens), torch.int64)
        self.tables = pair((max_seqs, max_blocks), torch.int32)
        self.segs = pair((2, max_seqs + 1), torch.int32)
        self.sample_rows = pair((max_seqs,), torch.int64)
        # numpy views of the host halves, written by build()
        self.host_rows, self.host_tables = self.rows[0].numpy(), self.tables[0].numpy()
        self.host_segs, self.host_sample_rows = self.segs[0].numpy(), self.sample_rows[0].numpy()


def _order(batch: list[Scheduled]) -> list[Scheduled]:
    """Group rows by adapter slot (base rows last), keeping arrival order within a slot."""
    return sorted(batch, key=lambda b: (b.seq.slot < 0, b.seq.slot, b.seq.arrival))


def build(batch: list[Scheduled], buf: InputBuffers, block_size: int) -> StepInputs:
    """Fill the host buffers for this step's rows (grouped by adapter) and copy them over."""
    batch = _order(batch)
    n_seq = len(batch)
    lens = np.fromiter((b.num_tokens for b in batch), dtype=np.int64, count=n_seq)
    first = np.fromiter((b.seq.num_computed for b in batch), dtype=np.int64, count=n_seq)
    ends = np.cumsum(lens)
    t_rows = int(ends[-1]) if n_seq else 0
    rows, tables = buf.host_rows[:, :t_rows], buf.host_tables
    max_blocks = 1
    for i, b in enumerate(batch):          # per sequence: its new token ids and block table
        seq, lo, table = b.seq, int(first[i]), b.seq.block_table
        rows[0, ends[i] - lens[i]:ends[i]] = seq.tokens[lo:lo + b.num_tokens]
        tables[i, :len(table)] = table
        max_blocks = max(max_blocks, len(table))
    q_seq = np.repeat(np.arange(n_seq), lens)
    pos = np.arange(t_rows) - (ends - lens)[q_seq] + first[q_seq]
    rows[1], rows[3] = pos, q_seq
    rows[2] = tables[q_seq, pos // block_size].astype(np.int64) * block_size + pos % block_size
    samples = np.fromiter((b.samples for b in batch), dtype=bool, count=n_seq)
    sampled = [b for b, x in zip(batch, samples) if x]
    slots = np.fromiter((b.seq.slot for b in batch), dtype=np.int64, count=n_seq)
    g = _segments(buf, slots, ends)
    sample_rows = ends[samples] - 1
    buf.host_sample_rows[:len(sample_rows)] = sample_rows
    max_ctx = int((first + lens).max()) if n_seq else 1
    return _to_device(buf, t_rows, n_seq, max_blocks, max_ctx, g, len(sample_rows),
                      bool((slots >= 0).any()), sampled)


def _segments(buf: InputBuffers, slots: np.ndarray, ends: np.ndarray) -> int:
    """Runs of equal adapter slot over the (sorted) sequences -> segment starts/slots; count."""
    change = np.flatnonzero(slots[1:] != slots[:-1]) + 1
    first_seq = np.concatenate(([0], change)) if len(slots) else np.zeros(0, dtype=np.int64)
    g = len(first_seq)
    segs = buf.host_segs
    segs[0, 0] = 0
    segs[0, 1:g + 1] = ends[np.concatenate((change - 1, [len(slots) - 1]))] if g else []
    segs[1, :g] = slots[first_seq]
    return g


def _to_device(buf, t_rows, n_seq, max_blocks, max_ctx, g, n_sample, has_lora,
               sampled) -> StepInputs:
    nb = buf.device.type == "cuda"
    rows = buf.rows[1][:, :t_rows]
    rows.copy_(buf.rows[0][:, :t_rows], non_blocking=nb)
    tables = buf.tables[1][:n_seq, :max_blocks]
    tables.copy_(buf.tables[0][:n_seq, :max_blocks], non_blocking=nb)
    segs = buf.segs[1][:, :g + 1]
    segs.copy_(buf.segs[0][:, :g + 1], non_blocking=nb)
    srows = buf.sample_rows[1][:n_sample]
    srows.copy_(buf.sample_rows[0][:n_sample], non_blocking=nb)
    ctx = StepContext(
        positions=rows[1], slot_mapping=rows[2], block_tables=tables,
        q_seq=rows[3].to(torch.int32), q_pos=rows[1].to(torch.int32), sample_rows=srows,
        seg_start=segs[0], seg_slot=segs[1][:g], max_context=max_ctx, has_lora=has_lora,
        host_single=only_live_segment(buf.host_segs[0, :g + 1], buf.host_segs[1, :g])
        if has_lora else None)
    return StepInputs(rows[0], ctx, sampling_batch(sampled, buf.device), sampled)


def sampling_batch(sampled: list[Scheduled], device: torch.device,
                   ahead: int = 0) -> SamplingBatch:
    """The rows' sampling parameters as tensors on device; none when every row is greedy.
    ahead: output tokens each row has beyond seq.tokens (sampled in a step still in flight),
    so that the counter of the token drawn is its index in the output all the same.

    The parameters go over in two packed copies (float32 and int64 rows), from pinned memory
    and without waiting on CUDA: a graph decode step builds them while its graph runs."""
    for b in sampled:                       # one pass, for the usual all-greedy batch
        p = b.seq.sampling
        if not p.temperature <= 0.0 or p.repetition_penalty not in (0.0, 1.0):
            break                           # sampled (not p.greedy) or penalized
    else:                                   # argmax needs no parameters
        return SamplingBatch(None, None, None, None, None, None, None, all_greedy=True)
    params = [b.seq.sampling for b in sampled]
    penalized = any(p.repetition_penalty not in (0.0, 1.0) for p in params)
    all_greedy = all(p.greedy for p in params)
    floats = np.array([[p.temperature for p in params],
                       [p.top_p if 0 < p.top_p < 1 else 1.0 for p in params],
                       [p.repetition_penalty or 1.0 for p in params]], dtype=np.float32)
    ints = np.array([[p.top_k for p in params], [p.seed for p in params],
                     [b.seq.num_output + ahead for b in sampled]], dtype=np.int64)
    history = None
    if penalized:
        history = _host_to_device(_history(sampled), device)
    f32, i64 = _host_to_device(floats, device), _host_to_device(ints, device)
    return SamplingBatch(temperature=f32[0], top_k=i64[0], top_p=f32[1], seed=i64[1],
                         counter=i64[2], penalty=f32[2] if penalized else None, history=history,
                         all_greedy=all_greedy)


def _history(sampled: list[Scheduled]) -> np.ndarray:
    """Prompt + output ids of each row, padded with -1 to the longest: int64 [R, L]."""
    lens = np.fromiter((len(b.seq.tokens) for b in sampled), dtype=np.int64, count=len(sampled))
    hist = np.full((len(sampled), int(lens.max())), -1, dtype=np.int64)
    hist[np.arange(hist.shape[1]) < lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(b.seq.tokens for b in sampled), dtype=np.int64,
        count=int(lens.sum()))
    return hist


def _host_to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on device: on CUDA through pinned memory, without a host sync."""
    t = torch.from_numpy(a)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
