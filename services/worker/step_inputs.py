"""Build one step's model inputs in one place: token ids, positions, KV slots, block tables,
LoRA segments and sampling parameters, copied into buffers allocated once.

Rows are ordered by adapter slot, so rows sharing an adapter form one contiguous segment for
the SGMV kernel; a sequence's rows stay together and in order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

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


def _order(batch: list[Scheduled]) -> list[Scheduled]:
    """Group rows by adapter slot (base rows last), keeping arrival order within a slot."""
    return sorted(batch, key=lambda b: (b.seq.slot < 0, b.seq.slot, b.seq.arrival))


def build(batch: list[Scheduled], buf: InputBuffers, block_size: int) -> StepInputs:
    batch = _order(batch)
    t_rows = sum(b.num_tokens for b in batch)
    n_seq = len(batch)
    rows = buf.rows[0][:, :t_rows].numpy()
    seg_start, seg_slot, sample_rows, sampled = [0], [], [], []
    max_ctx, max_blocks, row = 1, 1, 0
    for s_idx, b in enumerate(batch):
        seq, n = b.seq, b.num_tokens
        lo = seq.num_computed
        pos = np.arange(lo, lo + n)
        table = np.asarray(seq.block_table, dtype=np.int64)
        rows[0, row:row + n] = seq.tokens[lo:lo + n]
        rows[1, row:row + n] = pos
        rows[2, row:row + n] = table[pos // block_size] * block_size + pos % block_size
        rows[3, row:row + n] = s_idx
        buf.tables[0][s_idx, :len(table)] = torch.from_numpy(table.astype(np.int32))
        if seg_slot and seg_slot[-1] == seq.slot:
            seg_start[-1] = row + n
        else:
            seg_slot.append(seq.slot)
            seg_start.append(row + n)
        row += n
        max_ctx = max(max_ctx, lo + n)
        max_blocks = max(max_blocks, len(table))
        if b.samples:
            sample_rows.append(row - 1)
            sampled.append(b)
    return _to_device(buf, t_rows, n_seq, max_blocks, max_ctx, seg_start, seg_slot,
                      sample_rows, sampled)


def _to_device(buf, t_rows, n_seq, max_blocks, max_ctx, seg_start, seg_slot, sample_rows,
               sampled) -> StepInputs:
    g = len(seg_slot)
    buf.segs[0][0, :g + 1] = torch.tensor(seg_start, dtype=torch.int32)
    buf.segs[0][1, :g] = torch.tensor(seg_slot, dtype=torch.int32)
    buf.sample_rows[0][:len(sample_rows)] = torch.tensor(sample_rows, dtype=torch.int64)
    nb = non_blocking = buf.device.type == "cuda"
    rows = buf.rows[1][:, :t_rows]
    rows.copy_(buf.rows[0][:, :t_rows], non_blocking=nb)
    tables = buf.tables[1][:n_seq, :max_blocks]
    tables.copy_(buf.tables[0][:n_seq, :max_blocks], non_blocking=non_blocking)
    segs = buf.segs[1][:, :g + 1]
    segs.copy_(buf.segs[0][:, :g + 1], non_blocking=nb)
    srows = buf.sample_rows[1][:len(sample_rows)]
    srows.copy_(buf.sample_rows[0][:len(sample_rows)], non_blocking=nb)
    ctx = StepContext(
        positions=rows[1], slot_mapping=rows[2], block_tables=tables,
        q_seq=rows[3].to(torch.int32), q_pos=rows[1].to(torch.int32), sample_rows=srows,
        seg_start=segs[0], seg_slot=segs[1][:g], max_context=max_ctx,
        has_lora=any(s >= 0 for s in seg_slot))
    return StepInputs(rows[0], ctx, sampling_batch(sampled, buf.device), sampled)


def sampling_batch(sampled: list[Scheduled], device: torch.device) -> SamplingBatch:
    params = [b.seq.sampling for b in sampled]
    f32 = dict(dtype=torch.float32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    penalized = any(p.repetition_penalty not in (0.0, 1.0) for p in params)
    history = penalty = None
    if penalized:
        width = max(len(b.seq.tokens) for b in sampled)
        hist = np.full((len(sampled), width), -1, dtype=np.int64)
        for i, b in enumerate(sampled):
            hist[i, :len(b.seq.tokens)] = b.seq.tokens
        history = torch.from_numpy(hist).to(device)
        penalty = torch.tensor([p.repetition_penalty or 1.0 for p in params], **f32)
    return SamplingBatch(
        temperature=torch.tensor([p.temperature for p in params], **f32),
        top_k=torch.tensor([p.top_k for p in params], **i64),
        top_p=torch.tensor([p.top_p if 0 < p.top_p < 1 else 1.0 for p in params], **f32),
        seed=torch.tensor([p.seed for p in params], **i64),
        counter=torch.tensor([b.seq.num_output for b in sampled], **i64),
        penalty=penalty, history=history, all_greedy=all(p.greedy for p in params))
