"""Decode steps replayed from CUDA graphs (GPU only).

A decode step (every scheduled row one token, no repetition penalty) of n sequences is padded to
the nearest captured batch size B and replayed from the graph captured for B; any other step
(prefill, mixed prefill + decode, or larger than the biggest graph) runs eagerly. The graphs read
their inputs from static buffers that a step only fills: padding rows get slot -1 (no KV write),
q_seq -1 (no attention) and a base-only LoRA segment.

A graph holds LoRA launches only for the projection groups that the step's adapters target
(services.worker.model_spec.GROUP_BIT): a base-only step replays a graph with none, a batch of
q/k/v/o adapters one without the MLP's. A graph also bakes in the SGMV rank tile (LoraMeta.rank: the
kernels' RANK_BLOCK and launch shape) and whether q/k/v run as column LoRA (LoraMeta.columns), so
graphs are keyed by (batch, mask, tile, columns); the step-input builder makes these choices
(services.worker.lora_meta.choose), and a step replays the graph for the largest rank among its own
adapters, not the pool's: rank-16 adapters run rank-16 kernels even while a rank-64 adapter is
resident (on the H200, batch 64 with 32 rank-16 adapters spends 38 us a layer in LoRA with the 16
tile against 83 with the 64 one).

Every graph is captured at start, before the worker serves: for each batch size, none (base only),
all groups at each start tile (16 and the largest, capture's max_rank), and at tile 16 q/k/v/o (the
common attention-only adapters), the tile-16 ones also with column LoRA. Nothing is captured while
serving (a capture stalls every row in flight): a step whose (mask, tile) has no graph of its own
replays the captured graph of its batch size with the fewest groups that include its groups and the
smallest tile that holds its rank (correct for any mask: a group no adapter in the step targets has
no offsets, so adds nothing; a column-LoRA graph only for a step whose q/k/v adapters all have
blocks), and a step with no such graph (an adapter above max_rank's tile) runs eagerly. Capture
never touches the pool's tables, which the adapter manager updates from its own thread. The static
buffers are filled by the same step-input builder as eager steps
(services.worker.step_inputs.StepBuilder.fill).

Overlap. `launch` starts a decode step and returns at once (the sampled tokens come back through
a pinned buffer and an event); `collect` waits for them. A step may be launched from one still in
flight (`prev`): its rows' input tokens are then gathered on the device from prev's sampled tokens,
so the engine can queue step N+1 before it has read step N's tokens, and the GPU does not idle
while the host post-processes step N (services.worker.engine).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from kernels.sgmv_ref import rank_tile
from services.worker import metrics
from services.worker.lora_meta import LoraMeta
from services.worker.model import StepContext
from services.worker.model_spec import ALL_GROUPS, GROUP_BIT
from services.worker.runner import ModelRunner
from services.worker.sampling import pack_logprobs, sample, unpack_logprobs
from services.worker.scheduler import Scheduled
from services.worker.step_inputs import HostViews, StepPlan, sampling_batch

log = logging.getLogger(__name__)
DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448,
                 512)
ATTENTION = GROUP_BIT["qkv"] | GROUP_BIT["o"]          # q/k/v/o adapters: a start graph too


class _HostSet:
    """Pinned staging buffers for one step: host64 [4, top] (ids, positions, slots, gather
    index), host32 (q_seq, q_pos, seg_start, seg_slot, block tables), the sampled tokens' copy
    target; the step builder's views of them (services.worker.step_inputs.HostViews)."""

    def __init__(self, top: int, mb: int, pin: bool):
        self.host64 = torch.zeros(4, top, dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(4 * top + 1 + top * mb, dtype=torch.int32, pin_memory=pin)
        self.tokens = torch.zeros(top, dtype=torch.int64, pin_memory=pin)
        h = self.host64.numpy()
        q_seq, q_pos, seg_start, seg_slot, tables = (
            t.numpy() for t in GraphRunner._split32(self.host32, top, mb))
        self.views = HostViews(h[0], h[1], h[2], q_seq, seg_start, seg_slot, tables,
                               q_pos=q_pos, src=h[3])


@dataclass
class PendingStep:
    """A launched decode step: its rows in replay order and its sampled tokens on the way."""
    batch: list[Scheduled]
    tokens: torch.Tensor                 # int64 [n] on the device
    host: torch.Tensor                   # int64 [n], pinned: the copy's destination
    done: torch.cuda.Event | None        # recorded after the copy (None on CPU)
    logprobs: torch.Tensor | None = None  # pack_logprobs' rows, host (pinned): when asked


class GraphRunner:
    def __init__(self, runner: ModelRunner, sizes=DEFAULT_SIZES):
        self.runner = runner
        self.model = runner.model
        self.steps = runner.steps                 # the step-input builder, eager steps' too
        self.eos = runner.steps.eos
        dev = self.model.device
        # the sizes up to the engine's row limit, and the limit itself (else a full batch of,
        # say, 100 rows would find no graph between 96 and 128 and run eagerly)
        cap = runner.buffers.max_seqs
        self.sizes = sorted({s for s in sizes if s < cap} | {min(cap, max(sizes))})
        top = self.sizes[-1]
        self.max_blocks = runner.buffers.max_blocks
        self.block_size = runner.block_size
        mb = self.max_blocks
        # two packed buffers (int64 rows, int32 metadata) -> two host-to-device copies a step
        # rows: input ids, positions, KV slots, and for a step launched from one in flight the
        # index of each row's token in that step's sampled tokens
        self.dev64 = torch.zeros(4, top, dtype=torch.int64, device=dev)
        self.dev32 = torch.zeros(4 * top + 1 + top * mb, dtype=torch.int32, device=dev)
        # two sets of pinned staging buffers, used in turn: with overlap, step N+1 is filled
        # while step N's copies may still be queued behind step N-1
        self._sets = [_HostSet(top, mb, dev.type == "cuda") for _ in range(2)]
        self._flip = 0
        self._filled = self._sets[0]              # the set the last _fill wrote
        self.ids, self.pos, self.slots = self.dev64[0], self.dev64[1], self.dev64[2]
        self.q_seq, self.q_pos, self.seg_start, self.seg_slot, self.tables = self._split32(
            self.dev32, top, mb)
        # (batch, LoRA mask, rank tile (0 without LoRA), column LoRA) -> graph
        self.graphs: dict[tuple[int, int, int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int, int, bool], torch.Tensor] = {}
        self.pool = None                                                 # graphs share one
        self.captured: set[int] = set()          # batch sizes captured at start
        self._choice: dict[tuple, tuple[int, int, int, bool] | None] = {}
        self.replays = 0
        self.rank = 0                            # capture's max_rank (its tile: the largest)
        self.start_tiles: tuple[int, ...] = ()   # tiles captured at start for all groups
        self.timings: list | None = None     # set to a list to record (batch, start, end) events

    def _ctx(self, b: int, mask: int, tile: int = 0, columns: bool = False) -> StepContext:
        """The static buffers' context for batch b, with a graph's LoRA choices."""
        lora = LoraMeta(self.seg_start[:b + 1], self.seg_slot[:b], mask, tile or self.rank,
                        columns, self.steps.tables)
        return StepContext(positions=self.pos[:b], slot_mapping=self.slots[:b],
                           block_tables=self.tables[:b], q_seq=self.q_seq[:b],
                           q_pos=self.q_pos[:b], sample_rows=None,   # every row samples
                           max_context=self.max_blocks * self.block_size, lora=lora)

    def capture(self, max_rank: int = 64) -> None:
        """Capture every decode graph (see the module docstring), largest batch first, sharing
        one memory pool; progress in the log.

        The SGMV kernel's rank tile is baked into a graph: graphs serve steps whose adapters have
        ranks up to rank_tile(max_rank); a step with a larger adapter runs eagerly.
        """
        start = time.monotonic()
        keys = self._plan(max_rank)
        for i, (mask, tile, columns) in enumerate(keys):
            t = time.monotonic()
            for b in reversed(self.sizes):
                self._capture_one(b, mask, tile, columns)
            log.info("captured LoRA groups %s, rank tile %d%s for %d batch sizes in %.1fs "
                     "(%d of %d)", bin(mask), tile, ", column LoRA" if columns else "",
                     len(self.sizes), time.monotonic() - t, i + 1, len(keys))
        self.captured = set(self.sizes)
        from kernels.sgmv_split import barrier_timeouts
        if barrier_timeouts(self.model.device):
            log.error("an SGMV grid barrier timed out while capturing: LoRA output is wrong")
        log.info("captured %d decode graphs (batch %s, rank tiles %s) in %.1fs",
                 len(self.graphs), ",".join(map(str, self.sizes)),
                 ",".join(map(str, self.start_tiles)) or "-", time.monotonic() - start)

    def _plan(self, max_rank: int) -> list[tuple[int, int, bool]]:
        self.rank = max_rank
        self.start_tiles = tuple(sorted({rank_tile(min(16, max_rank)), rank_tile(max_rank)}))
        return self.start_keys()

    def warm_forwards(self, max_rank: int, part: int = 0, parts: int = 1) -> int:
        """The warm-up forwards of every parts-th graph that capture() would make, from the
        part-th, without capturing (services.worker.precompile); how many."""
        items = [(b, *key) for key in self._plan(max_rank) for b in reversed(self.sizes)]
        for item in items[part::parts]:
            self._warm(*item)
        torch.cuda.synchronize()
        return len(items[part::parts])

    def start_keys(self) -> list[tuple[int, int, bool]]:
        """The (LoRA mask, rank tile, column LoRA) triples captured for every batch size."""
        if self.steps.tables is None:
            return [(0, 0, False)]
        keys = [(ALL_GROUPS, t, False) for t in reversed(self.start_tiles)]
        small = self.start_tiles[0]
        keys.append((ATTENTION, small, False))
        cols = self.steps.columns
        if cols is not None and cols.n_cols and small <= 16:
            keys += [(ALL_GROUPS, small, True), (ATTENTION, small, True)]
        return keys + [(0, 0, False)]

    def _capture_one(self, b: int, mask: int, tile: int = 0, columns: bool = False) -> None:
        """Capture the decode graph for batch size b and these LoRA choices (inputs: whatever
        the static buffers hold; the warm-up passes rewrite the same KV slots with the same
        values)."""
        key = (b, mask, tile, columns)
        kv = self.runner.kv_cache
        ctx = self._warm(*key)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the adapter manager's loader threads may copy while a capture runs
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.outputs[key] = self.model.forward(self.ids[:b], ctx, kv)
        self.pool = graph.pool()
        self.graphs[key] = graph
        metrics.count_capture()
        torch.cuda.synchronize()

    def _warm(self, b: int, mask: int, tile: int, columns: bool) -> StepContext:
        """A graph's warm-up forwards (Triton compiles, autotunes, lazy cuBLAS state) on the
        first layer only: every layer runs the same kernels on the same shapes (as in
        services.worker.warmup). Returns the graph's step context."""
        ctx = self._ctx(b, mask, tile, columns)
        self.model.layer_limit = 1
        try:
            for _ in range(2):
                self.model.forward(self.ids[:b], ctx, self.runner.kv_cache)
        finally:
            self.model.layer_limit = None
        return ctx

    def _bucket(self, n: int) -> int | None:
        for b in self.sizes:
            if b >= n:
                return b
        return None

    def run(self, batch: list[Scheduled]) -> tuple[list[Scheduled], list[int], list | None]:
        """One step, waited for: from a graph when it is a decode step that has one, else
        eagerly; returns the rows that sampled, their tokens and logprobs (ModelRunner.run)."""
        pending = self.launch(batch)
        if pending is None:
            return self.runner.run(batch)
        return self.collect(pending)

    def launch(self, batch: list[Scheduled], prev: PendingStep | None = None
               ) -> PendingStep | None:
        """Start a decode step from its graph and return without waiting; None (nothing
        launched) when the step cannot run from a graph.

        With prev (a step still in flight), every row continues a sequence of prev: its input
        token is the one prev sampled for it, still only on the device, and its output counter
        is one ahead of seq.tokens."""
        b = self._bucket(len(batch))
        decode = all(x.num_tokens == 1 for x in batch) and (
            prev is not None or all(x.samples for x in batch))
        # a penalty reads the tokens so far, the one in flight included: such steps run eagerly
        penalized = any(x.seq.sampling.history for x in batch)
        if b is None or not decode or penalized or b not in self.captured:
            return None
        plan = self.steps.plan(batch, graph=True)
        key = None if plan.rank > rank_tile(self.rank) else self._graph_key(
            b, plan.mask, plan.rank, plan.columns)
        if key is None:
            return None                  # an adapter above the graphs' ranks, or no graph
        batch = plan.batch
        src = None
        if prev is not None:
            where = {id(x.seq): i for i, x in enumerate(prev.batch)}
            src = np.fromiter((where[id(x.seq)] for x in batch), np.int64, len(batch))
        self._fill(plan, b, src)
        if src is not None:
            n = len(batch)
            torch.index_select(prev.tokens, 0, self.dev64[3, :n], out=self.ids[:n])
        if self.timings is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.graphs[key].replay()
            end.record()
            self.timings.append((b, start, end))
        else:
            self.graphs[key].replay()
        self.replays += 1
        logits = self.outputs[key][:len(batch)]
        params = sampling_batch(batch, self.model.device, ahead=0 if prev is None else 1,
                                eos=self.eos)
        tokens = sample(logits, params)
        host = self._filled.tokens[:len(batch)]
        host.copy_(tokens, non_blocking=True)
        lp = None
        if params.logprobs >= 0:         # asked for: their copy rides the same event
            packed = pack_logprobs(logits, tokens, params.logprobs)
            lp = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=tokens.is_cuda)
            lp.copy_(packed, non_blocking=True)
        done = None
        if tokens.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return PendingStep(batch, tokens, host, done, lp)

    def _graph_key(self, b: int, mask: int, tile: int, columns: bool = False
                   ) -> tuple[int, int, int, bool] | None:
        """The graph a decode step replays (see the module docstring): its own key, else the
        captured one of batch b with the fewest groups that cover mask's and the smallest tile
        >= tile (a column-LoRA one only for a step with column LoRA, and preferred then); None:
        no graph serves it (the step runs eagerly). Memoised."""
        key = (b, mask, tile, columns)
        if key in self.graphs:
            return key
        if key not in self._choice:
            fits = [(bin(m).count("1"), t, not c, (bb, m, t, c))
                    for bb, m, t, c in self.graphs if bb == b and t >= tile and m & mask == mask
                    and (columns or not c)]
            self._choice[key] = min(fits)[3] if fits else None
        return self._choice[key]

    @staticmethod
    def collect(pending: PendingStep) -> tuple[list[Scheduled], list[int], list | None]:
        """Wait for a launched step's tokens: (its rows, their new token ids, their logprobs
        or None, as ModelRunner.run)."""
        if pending.done is not None:
            pending.done.synchronize()
        lps = None
        if pending.logprobs is not None:
            lps = unpack_logprobs(pending.logprobs.tolist(),
                                  [b.seq.sampling.logprobs for b in pending.batch])
        return pending.batch, pending.host.tolist(), lps

    @staticmethod
    def _split32(buf: torch.Tensor, top: int, mb: int):
        """Views of the int32 buffer: q_seq [top], q_pos [top], seg_start [top+1],
        seg_slot [top], block tables [top, mb]."""
        q_seq, q_pos = buf[:top], buf[top:2 * top]
        seg_start, seg_slot = buf[2 * top:3 * top + 1], buf[3 * top + 1:4 * top + 1]
        return q_seq, q_pos, seg_start, seg_slot, buf[4 * top + 1:].view(top, mb)

    def _fill(self, plan: StepPlan, b: int, src: np.ndarray | None = None) -> None:
        """Write a decode step's inputs for batch size b into the next set of pinned buffers
        (the step builder: padding rows inert), then two host-to-device copies. src: for a step
        launched from one in flight, where each row's input token is in that step's sampled
        tokens (the ids are then gathered on the device)."""
        hs = self._filled = self._sets[self._flip]
        self._flip ^= 1
        self.steps.fill(plan, hs.views, pad=b, src=src)
        self.dev64.copy_(hs.host64, non_blocking=True)
        self.dev32.copy_(hs.host32, non_blocking=True)
