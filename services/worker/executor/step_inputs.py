"""Build one step's model inputs in one place, `StepBuilder`: row order, token ids, positions, KV
slots, block tables, the LoRA segments and the step's LoRA metadata
(services.worker.model.step_context), for eager steps into the runner's own buffers (`eager`) and
for decode and mixed steps replayed from CUDA graphs into the graph runner's static, padded ones
(`fill`, called by services.worker.executor.graph_inputs); and the sampling parameters
(`sampling_batch`).
Rows are ordered by adapter slot, so rows sharing an adapter form one contiguous segment for
the SGMV kernel; a sequence's rows stay together and in order. Per row the builder only reads
attributes (into np.fromiter or list comprehensions; a prefill step copies each sequence's new
token ids); the arithmetic is vectorized, and a row's block table is rewritten only when it
changed since that buffer set's last fill (`_sync_tables`). Padding rows are inert: slot -1 (no
KV write), q_seq -1 (no attention), and the segments past the live ones empty and base-only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.sgmv_choice import only_live_segment
from services.worker.engine.scheduler import Scheduled
from services.worker.engine.step_profile import StepShape
from services.worker.executor.lora_choice import choose
from services.worker.executor.sampling import SamplingBatch
from services.worker.executor.sampling_inputs import sampling_batch
from services.worker.model.lora_columns import LoraColumns
from services.worker.model.lora_tables import LoraTables
from services.worker.model.step_context import LoraMeta, StepContext


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    ctx: StepContext
    sampling: SamplingBatch
    sampled: list[Scheduled]          # the entries that produce a token, in sample-row order
    # prompt logprobs: the first E logits rows are prompt rows; (sequence, rows) in order and
    # the prompt token each of those rows predicts
    prompt_rows: list[tuple] | None = None
    prompt_targets: np.ndarray | None = None
    shape: StepShape | None = None    # what the step was (step_shape), for the step profile


class HostViews:
    """numpy views of one set of host buffers that StepBuilder.fill writes (row arrays [T],
    segment arrays [S+1] and [S], block tables [S, MB]; q_pos None: the owner derives it from
    pos, src None: no gather index), and which block-table list (and how much of it) each row
    of `tables` holds (see StepBuilder._sync_tables)."""

    def __init__(self, ids, pos, slots, q_seq, seg_start, seg_slot, tables, q_pos=None,
                 src=None, rope_len=None):
        self.ids, self.pos, self.slots, self.q_seq, self.q_pos = ids, pos, slots, q_seq, q_pos
        self.rope_len = rope_len         # [T] max(position + 1, prompt length): dynamic RoPE
        self.seg_start, self.seg_slot, self.tables, self.src = seg_start, seg_slot, tables, src
        self.held = ([None] * len(tables), [0] * len(tables))


class InputBuffers:
    """An eager step's host (pinned on CUDA) and device buffers, sized for the largest step."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        pin = device.type == "cuda"
        def pair(shape, dtype):
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return host, torch.zeros(shape, dtype=dtype, device=device)
        self.device = device
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        # rows: ids, positions, slots, q_seq, rope_len ; seqs: sample rows ; segments
        self.rows = pair((5, max_tokens), torch.int64)
        self.tables = pair((max_seqs, max_blocks), torch.int32)
        self.segs = pair((2, max_seqs + 1), torch.int32)
        # the rows whose logits a step needs: prompt rows of sequences that asked for their
        # prompt's logprobs (at most every row), then one a sampling sequence
        self.sample_rows = pair((max_tokens + max_seqs,), torch.int64)
        rows, segs = self.rows[0].numpy(), self.segs[0].numpy()
        self.host_sample_rows = self.sample_rows[0].numpy()
        self.views = HostViews(rows[0], rows[1], rows[2], rows[3], segs[0], segs[1],
                               self.tables[0].numpy(), rope_len=rows[4])


@dataclass
class StepPlan:
    """A step's rows in order and its LoRA choices (lora_choice.choose), before any buffer is
    written: the graph runner picks its graph from them."""
    batch: list[Scheduled]
    seqs: list
    slots: np.ndarray                # int64 [n] adapter slot per sequence, -1 = base only
    mask: int
    rank: int
    columns: bool


class StepBuilder:
    """One step's inputs from the scheduled rows; the adapter pool's tables (and the column
    blocks) it reads for the LoRA choices and hands to the model in the step's LoraMeta."""

    def __init__(self, block_size: int, tables: LoraTables | None = None,
                 columns: LoraColumns | None = None, eos: tuple[int, ...] = ()):
        """eos: the model's end tokens (rows short of their min_tokens may not sample them)."""
        self.block_size, self.tables, self.columns = block_size, tables, columns
        self.eos = eos

    def plan(self, batch: list[Scheduled], graph: bool) -> StepPlan:
        """Rows grouped by adapter slot (base rows last), in arrival order within a slot, and
        the LoRA choices for them (graph: a captured graph's rank tile, see lora_choice.choose)."""
        batch = sorted(batch, key=lambda b: (b.seq.slot < 0, b.seq.slot, b.seq.arrival))
        seqs = [b.seq for b in batch]
        slots = np.fromiter((q.slot for q in seqs), dtype=np.int64, count=len(seqs))
        return StepPlan(batch, seqs, slots, *choose(self.tables, self.columns, slots, graph))

    def fill(self, plan: StepPlan, v: HostViews, lens: np.ndarray | None = None,
             pad: int = 0, src: np.ndarray | None = None, pad_seqs: int | None = None
             ) -> tuple[int, np.ndarray | None, int]:
        """Write the plan's rows and segments into v; returns (rows T, the row end of each sequence
        (None when each has one row), segments G). lens: each sequence's rows this step (None: one,
        a decode step); pad: rows to pad to with inert ones, and sequences (block-table rows) and
        segments to pad_seqs (default: pad); src: for a step launched from one in flight, where
        each row's input token is in that step's sampled tokens (the ids are then gathered on the
        device, not written here)."""
        seqs, n, bs = plan.seqs, len(plan.seqs), self.block_size
        pad_seqs = pad if pad_seqs is None else pad_seqs
        first = [q.num_computed for q in seqs]
        if lens is None:                          # one row a sequence, at its next position
            t, ends, q_seq = n, None, np.arange(n)
            if src is None:
                v.ids[:n] = [q.tokens[p] for q, p in zip(seqs, first)]
            else:
                v.src[:n] = src
            pos = v.pos[:n]
            pos[:] = first
        else:
            ends = np.cumsum(lens)
            t = int(ends[-1]) if n else 0
            for i, q in enumerate(seqs):          # per sequence: its new token ids
                lo, hi = ends[i] - lens[i], ends[i]
                v.ids[lo:hi] = q.tokens[first[i]:first[i] + hi - lo]
            q_seq = np.repeat(np.arange(n), lens)
            pos = np.arange(t) - (ends - lens)[q_seq] + np.asarray(first)[q_seq]
            v.pos[:t] = pos
        self._sync_tables(seqs, max(n, pad_seqs), v)
        v.slots[:t] = v.tables[q_seq, pos // bs].astype(np.int64) * bs + pos % bs
        v.q_seq[:t] = q_seq
        if v.q_pos is not None:
            v.q_pos[:t] = pos
        if v.rope_len is not None:
            prompt = np.fromiter((len(q.prompt) for q in seqs), dtype=np.int64, count=n)
            np.maximum(pos + 1, prompt[q_seq], out=v.rope_len[:t])
        if pad > t:                   # padding rows: token 0, no KV write, no attention
            v.ids[t:pad], v.pos[t:pad], v.slots[t:pad], v.q_seq[t:pad] = 0, 0, -1, -1
            if v.q_pos is not None:
                v.q_pos[t:pad] = 0
        return t, ends, self._segments(plan.slots, ends, t, v, pad_seqs)

    def eager(self, batch: list[Scheduled], buf: InputBuffers) -> StepInputs:
        """An eager step: fill the runner's host buffers, copy them over, the StepInputs."""
        plan = self.plan(batch, graph=False)
        n = len(plan.batch)
        lens = np.fromiter((b.num_tokens for b in plan.batch), dtype=np.int64, count=n)
        decode = bool(n) and bool((lens == 1).all())          # the one-row-a-sequence form
        t, ends, g = self.fill(plan, buf.views, None if decode else lens)
        shape = step_shape("eager", plan, g, None if decode else lens)
        samples = np.fromiter((b.samples for b in plan.batch), dtype=bool, count=n)
        sampled = [b for b, x in zip(plan.batch, samples) if x]
        sample_rows = (np.arange(1, n + 1) if ends is None else ends)[samples] - 1
        echo = _prompt_rows(plan, lens, ends) if any(
            b.seq.prompt_lps is not None for b in plan.batch) else None
        if echo is not None:
            sample_rows = np.concatenate((echo[1], sample_rows))
        buf.host_sample_rows[:len(sample_rows)] = sample_rows
        max_ctx = int(buf.views.pos[:t].max()) + 1 if t else 1      # positions + 1
        max_blocks = max(1, max(buf.views.held[1][:n], default=0))
        inputs = _to_device(buf, plan, self.tables, t, max_blocks, max_ctx, g,
                            len(sample_rows), sampled)
        inputs.sampling = sampling_batch(sampled, buf.device, eos=self.eos)
        inputs.shape = shape
        if echo is not None:
            inputs.prompt_rows, inputs.prompt_targets = echo[0], echo[2]
        return inputs

    @staticmethod
    def _segments(slots: np.ndarray, ends: np.ndarray | None, t: int, v: HostViews,
                  pad: int = 0) -> int:
        """Runs of equal adapter slot over the (sorted) sequences -> segment starts (in rows;
        ends: each sequence's row end, None: one row each) and slots; the segments past them
        up to pad are empty (start = t) and base-only. Returns the count of runs."""
        n = len(slots)
        change = np.flatnonzero(slots[1:] != slots[:-1])
        change += 1
        g = len(change) + 1 if n else 0
        v.seg_start[0] = 0
        if g:
            v.seg_start[1:g] = change if ends is None else ends[change - 1]
            v.seg_start[g] = t
            v.seg_slot[0] = slots[0]
            v.seg_slot[1:g] = slots[change]
        if pad > g:
            v.seg_start[g + 1:pad + 1] = t
            v.seg_slot[g:pad] = -1
        return g

    @staticmethod
    def _sync_tables(seqs: list, b: int, v: HostViews) -> None:
        """Rows 0..b-1 of the host block tables: row i holds seqs[i]'s table then zeros, rows
        past the sequences hold zeros.

        Each buffer set keeps what its last fill wrote, and which list (and how much of it)
        each row holds; a row is rewritten only when its sequence's table is another list or has
        grown. That is exact because BlockManager only appends to a table and, on freeing, gives
        the sequence a new list: the same list at the same length holds the same blocks."""
        tables = v.tables
        lists, lens = v.held
        for i, q in enumerate(seqs):
            t = q.block_table
            k, old = len(t), lens[i]
            if t is lists[i]:
                if k == old:
                    continue
                if k > old:                           # grown: write the new blocks only
                    tables[i, old:k] = t[old:]
                    lens[i] = k
                    continue
            tables[i, :k] = t
            if old > k:
                tables[i, k:old] = 0
            lists[i], lens[i] = t, k
        for i in range(len(seqs), b):                 # padding rows
            if lens[i]:
                tables[i, :lens[i]] = 0
            lists[i], lens[i] = None, 0


def step_shape(kind: str, plan: StepPlan, segments: int, lens: np.ndarray | None) -> StepShape:
    """What a step was, for the step profile (services.worker.engine.step_profile), from what
    its fill already has: its sequences, its LoRA segments (fill's G: runs of one adapter slot,
    the base rows' run last) and each sequence's rows this step (lens; None: one each)."""
    n = len(plan.seqs)
    base = 1 if n and plan.slots[-1] < 0 else 0
    prompt = 0 if lens is None else int(lens[lens > 1].sum())
    return StepShape(kind, n, prompt, segments - base)


def _prompt_rows(plan: StepPlan, lens: np.ndarray, ends: np.ndarray | None):
    """For sequences that asked for their prompt's logprobs: each one's rows this step whose
    next token is a prompt token, and those tokens. ((seq, count) per sequence, row indices,
    target ids); None when this step has none."""
    per, rows, targets = [], [], []
    for i, b in enumerate(plan.batch):
        seq = b.seq
        if seq.prompt_lps is None:
            continue
        first = seq.num_computed
        k = min(int(lens[i]), len(seq.prompt) - 1 - first)        # rows predicting a prompt token
        if k <= 0:
            continue
        lo = (int(ends[i]) if ends is not None else i + 1) - int(lens[i])
        per.append((seq, k))
        rows.append(np.arange(lo, lo + k))
        targets.append(seq.prompt[first + 1:first + 1 + k])
    if not per:
        return None
    return per, np.concatenate(rows), np.concatenate([np.asarray(t, np.int64) for t in targets])


def device_segments(buf: InputBuffers, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The device segment tables an eager step of g segments hands the kernels: seg_start
    [g + 1] and seg_slot [g], views of the rows of one [2, max_seqs + 1] buffer (the kernels'
    specializations see seg_slot's alignment: the warm-up's witnesses use these views too)."""
    segs = buf.segs[1]
    return segs[0, :g + 1], segs[1, :g]


def _to_device(buf: InputBuffers, plan: StepPlan, tables: LoraTables | None, t_rows: int,
               max_blocks: int, max_ctx: int, g: int, n_sample: int,
               sampled: list[Scheduled]) -> StepInputs:
    """Copy the used part of the eager buffers over (without waiting on CUDA); the inputs."""
    nb = buf.device.type == "cuda"
    n_seq = len(plan.seqs)
    rows = buf.rows[1][:, :t_rows]
    rows.copy_(buf.rows[0][:, :t_rows], non_blocking=nb)
    block_tables = buf.tables[1][:n_seq, :max_blocks]
    block_tables.copy_(buf.tables[0][:n_seq, :max_blocks], non_blocking=nb)
    buf.segs[1][:, :g + 1].copy_(buf.segs[0][:, :g + 1], non_blocking=nb)
    srows = buf.sample_rows[1][:n_sample]
    srows.copy_(buf.sample_rows[0][:n_sample], non_blocking=nb)
    v = buf.views
    single = only_live_segment(v.seg_start[:g + 1], v.seg_slot[:g]) if plan.mask else None
    lora = LoraMeta(*device_segments(buf, g), plan.mask, plan.rank, plan.columns, tables, single)
    ctx = StepContext(
        positions=rows[1], slot_mapping=rows[2], block_tables=block_tables,
        q_seq=rows[3].to(torch.int32), q_pos=rows[1].to(torch.int32), sample_rows=srows,
        max_context=max_ctx, lora=lora, rope_len=rows[4])
    return StepInputs(rows[0], ctx, None, sampled)
