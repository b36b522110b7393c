"""Decode steps replayed from CUDA graphs (GPU only).

A decode step (every scheduled row one token, no repetition penalty) of n sequences is padded to
the nearest captured batch size B and replayed from the graph captured for B; any other step
(prefill, mixed prefill + decode, or larger than the biggest graph) runs eagerly. The graphs read
their inputs from static buffers that a step only fills: padding rows get slot -1 (no KV write),
q_seq -1 (no attention) and a base-only LoRA segment.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from services.worker.model import StepContext
from services.worker.runner import ModelRunner
from services.worker.sampling import sample
from services.worker.scheduler import Scheduled
from services.worker.step_inputs import sampling_batch

log = logging.getLogger(__name__)
DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


class GraphRunner:
    def __init__(self, runner: ModelRunner, sizes=DEFAULT_SIZES):
        self.runner = runner
        self.model = runner.model
        dev = self.model.device
        self.sizes = sorted(s for s in sizes if s <= runner.buffers.max_seqs)
        top = self.sizes[-1]
        self.max_blocks = runner.buffers.max_blocks
        self.block_size = runner.block_size
        i64 = dict(dtype=torch.int64, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        self.ids = torch.zeros(top, **i64)
        self.pos = torch.zeros(top, **i64)
        self.slots = torch.full((top,), -1, **i64)
        self.q_seq = torch.full((top,), -1, **i32)
        self.q_pos = torch.zeros(top, **i32)
        self.tables = torch.zeros(top, self.max_blocks, **i32)
        self.seg_start = torch.zeros(top + 1, **i32)
        self.seg_slot = torch.full((top,), -1, **i32)
        self.rows = torch.arange(top, **i64)
        self.host = torch.zeros(6, top, dtype=torch.int64, pin_memory=True)
        self.host_tables = torch.zeros(top, self.max_blocks, dtype=torch.int32, pin_memory=True)
        self.host_segs = torch.zeros(2, top + 1, dtype=torch.int32, pin_memory=True)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        self.rank = 0

    def _ctx(self, b: int) -> StepContext:
        return StepContext(positions=self.pos[:b], slot_mapping=self.slots[:b],
                           block_tables=self.tables[:b], q_seq=self.q_seq[:b],
                           q_pos=self.q_pos[:b], sample_rows=self.rows[:b],
                           seg_start=self.seg_start[:b + 1], seg_slot=self.seg_slot[:b],
                           max_context=self.max_blocks * self.block_size, has_lora=True)

    def capture(self, max_rank: int = 64) -> None:
        """Capture one graph per batch size, largest first, sharing one memory pool.

        The SGMV kernel's rank tile is baked into a graph: graphs serve adapters of rank up to
        max_rank; a step with a larger adapter resident runs eagerly.
        """
        start = time.monotonic()
        pool = None
        kv = self.runner.kv_cache
        tables = self.model.lora
        saved, self.rank = tables.max_rank, max_rank
        tables.max_rank = max_rank
        try:
            self._capture_all(kv, pool)
        finally:
            tables.max_rank = saved
        log.info("captured %d decode graphs (batch %s, rank <= %d) in %.1fs", len(self.graphs),
                 ",".join(map(str, self.sizes)), max_rank, time.monotonic() - start)

    def _capture_all(self, kv, pool) -> None:
        for b in reversed(self.sizes):
            ctx = self._ctx(b)
            for _ in range(2):                                 # warm up (Triton autotune etc.)
                self.model.forward(self.ids[:b], ctx, kv)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.model.forward(self.ids[:b], ctx, kv)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def _bucket(self, n: int) -> int | None:
        for b in self.sizes:
            if b >= n:
                return b
        return None

    def run(self, batch: list[Scheduled]) -> tuple[list[Scheduled], list[int]]:
        b = self._bucket(len(batch))
        decode = all(x.num_tokens == 1 and x.samples for x in batch)
        penalized = any(x.seq.sampling.repetition_penalty not in (0.0, 1.0) for x in batch)
        too_big = self.model.lora is not None and self.model.lora.max_rank > self.rank
        if b is None or not decode or penalized or too_big or b not in self.graphs:
            return self.runner.run(batch)
        batch = sorted(batch, key=lambda x: (x.seq.slot < 0, x.seq.slot, x.seq.arrival))
        self._fill(batch, b)
        self.graphs[b].replay()
        self.replays += 1
        logits = self.outputs[b][:len(batch)]
        tokens = sample(logits, sampling_batch(batch, self.model.device))
        return batch, tokens.tolist()

    def _fill(self, batch: list[Scheduled], b: int) -> None:
        n = len(batch)
        h = self.host[:, :b].numpy()
        h[:] = 0
        h[2, :] = -1
        h[3, :] = -1
        slots_of = np.empty(n, dtype=np.int64)
        self.host_tables[:b].zero_()
        ht = self.host_tables.numpy()
        for i, x in enumerate(batch):
            seq = x.seq
            p = seq.num_computed
            blk = seq.block_table[p // self.block_size]
            h[0, i], h[1, i], h[2, i], h[3, i] = seq.tokens[p], p, blk * self.block_size + \
                p % self.block_size, i
            ht[i, :len(seq.block_table)] = seq.block_table
            slots_of[i] = seq.slot
        self._segments(slots_of, b)
        self.ids[:b].copy_(self.host[0, :b], non_blocking=True)
        self.pos[:b].copy_(self.host[1, :b], non_blocking=True)
        self.slots[:b].copy_(self.host[2, :b], non_blocking=True)
        self.q_seq[:b].copy_(self.host[3, :b], non_blocking=True)
        self.q_pos[:b].copy_(self.host[1, :b], non_blocking=True)
        self.tables[:b].copy_(self.host_tables[:b], non_blocking=True)
        self.seg_start[:b + 1].copy_(self.host_segs[0, :b + 1], non_blocking=True)
        self.seg_slot[:b].copy_(self.host_segs[1, :b], non_blocking=True)

    def _segments(self, slots_of: np.ndarray, b: int) -> None:
        """Contiguous runs of equal slots; padded segments are empty (start = n) and base-only."""
        n = len(slots_of)
        change = np.flatnonzero(np.diff(slots_of)) + 1
        starts = np.concatenate(([0], change))
        segs = self.host_segs.numpy()
        segs[0, :] = n
        segs[1, :] = -1
        segs[0, :len(starts)] = starts
        segs[1, :len(starts)] = slots_of[starts]
        segs[0, len(starts)] = n
        # rows n..b-1 (padding) belong to no segment: every segment past the live ones is [n, n)
