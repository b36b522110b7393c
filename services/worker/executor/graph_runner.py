"""Decode steps and mixed steps replayed from CUDA graphs (GPU only).

A decode step (every scheduled row one token, no repetition penalty) of n sequences is padded to
the nearest captured batch size B and replayed from the graph captured for B. A mixed step
(prompt chunks, beside decode rows or not) of T tokens over S sequences is padded to the
smallest captured token count M >= T whose graph holds S sequences (M - M // 8, at most the
largest batch) and replayed from it: an eager step launches ~400 kernels from Python, which on the
H200 took longer than the GPU's work up to ~1,000 tokens (bench/PERF_NOTES.md). Every kernel
here reads its per-step metadata from device buffers (attention finds its runs from q_seq and
q_pos, SGMV its segments from seg_start), so one graph serves any step that fits. Other steps
(larger, penalties, prompt logprobs, more sequences than the largest graph) run eagerly. The
graphs read their inputs from static buffers that a step only fills: padding rows get slot -1
(no KV write), q_seq -1 (no attention) and no LoRA segment; a mixed graph computes the logits of
each sequence's sampling row only (sample_rows).

A graph holds LoRA launches only for the projection groups that the step's adapters target
(services.worker.model.spec.GROUP_BIT): a base-only step replays a graph with none, a batch of
q/k/v/o adapters one without the MLP's. A graph also bakes in the SGMV rank tile (LoraMeta.rank: the
kernels' RANK_BLOCK and launch shape) and whether q/k/v run as column LoRA (LoraMeta.columns), so
graphs are keyed by (batch, mask, tile, columns); the step-input builder makes these choices
(services.worker.executor.lora_choice), and a step replays the graph for the largest rank among its
own adapters, not the pool's: rank-16 adapters run rank-16 kernels even while a rank-64 adapter is
resident (on the H200, batch 64 with 32 rank-16 adapters spends 38 us a layer in LoRA with the 16
tile against 83 with the 64 one).

Every graph is captured at start, before the worker serves: for each batch size (and each mixed
token count), none (base only),
all groups at each start tile (16 and the largest, capture's max_rank), and at tile 16 q/k/v/o (the
common attention-only adapters), the tile-16 ones also with column LoRA. Nothing is captured while
serving (a capture stalls every row in flight): a step whose (mask, tile) has no graph of its own
replays the captured graph of its batch size with the fewest groups that include its groups and the
smallest tile that holds its rank (correct for any mask: a group no adapter in the step targets has
no offsets, so adds nothing; a column-LoRA graph only for a step whose q/k/v adapters all have
blocks), and a step with no such graph (an adapter above max_rank's tile) runs eagerly. Capture
never touches the pool's tables, which the adapter manager updates from its own thread. A step
fills the static buffers with one call, `self.inputs.fill` (services.worker.executor.graph_inputs:
the next pinned host set written by the same step-input builder as eager steps, then two copies).

Overlap. `launch` starts a decode or mixed step and returns at once (the sampled tokens come back
through a pinned buffer and an event); `collect` waits for them. A step may be launched from one
still in flight (`prev`): its rows' input tokens are then gathered on the device from prev's sampled
tokens, so the engine can queue step N+1 before it has read step N's tokens, and the GPU does not
idle while the host post-processes step N (services.worker.engine.loop). Such a step with grammar
rows (structured output) samples when step N is collected: its masks need step N's tokens
(services.worker.executor.graph_inputs). A launched step says what it was (PendingStep.shape:
decode-graph or mixed-graph, its rows, prompt tokens and adapters) for the engine's step profile.
"""
from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch

from kernels.sgmv_choice import rank_tile
from services.worker import metrics
from services.worker.engine.scheduler import Scheduled
from services.worker.engine.step_profile import StepShape
from services.worker.executor.graph_inputs import PendingStep, StaticInputs, collect, start_sampling
from services.worker.executor.model_runner import ModelRunner
from services.worker.executor.step_inputs import StepPlan, step_shape
from services.worker.model.spec import ALL_GROUPS, GROUP_BIT
from services.worker.model.step_context import LoraMeta, StepContext

log = logging.getLogger(__name__)
DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448,
                 512)
ATTENTION = GROUP_BIT["qkv"] | GROUP_BIT["o"]          # q/k/v/o adapters: a start graph too
# mixed steps' token counts with a graph of their own, up to GraphRunner's mixed_tokens: above
# ~1,000 tokens a step's GPU time hides its launches (bench/PERF_NOTES.md, mixed steps)
MIXED_SIZES = (64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)


class GraphRunner:
    def __init__(self, runner: ModelRunner, sizes=DEFAULT_SIZES, mixed_tokens: int = 1024):
        """mixed_tokens: the largest token count of a mixed step replayed from a graph
        (MIXED_SIZES up to it and the engine's token budget; 0: mixed steps run eagerly)."""
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
        limit = min(mixed_tokens, runner.buffers.max_tokens)
        # and the budget itself when it is not one (a full-budget step is the common one
        # under a backlog of prompts)
        self.mixed_sizes = sorted({t for t in MIXED_SIZES if t <= limit}
                                  | ({limit} if 0 < limit <= MIXED_SIZES[-1] else set()))
        self.mixed_on = False              # once captured (off again while the warm-up runs)
        rows = max([top, *self.mixed_sizes])
        self.max_blocks = runner.buffers.max_blocks
        self.block_size = runner.block_size
        self.inputs = StaticInputs(self.steps, rows, top, self.max_blocks, dev)
        inp = self.inputs
        self.ids, self.pos, self.slots, self.sample_rows = inp.ids, inp.pos, inp.slots, \
            inp.sample_rows
        self.q_seq, self.q_pos, self.seg_start, self.seg_slot, self.tables = (
            inp.q_seq, inp.q_pos, inp.seg_start, inp.seg_slot, inp.tables)
        # (batch, LoRA mask, rank tile (0 without LoRA), column LoRA) -> graph; mixed steps'
        # graphs by (token count, mask, tile, columns)
        self.graphs: dict[tuple[int, int, int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int, int, bool], torch.Tensor] = {}
        self.mixed: dict[tuple[int, int, int, bool], torch.cuda.CUDAGraph] = {}
        # (views of one buffer: a mixed graph's logits hold until the next mixed replay)
        self.mixed_outputs: dict[tuple[int, int, int, bool], torch.Tensor] = {}
        self._mixed_logits: torch.Tensor | None = None   # their logits: views of one buffer
        self.pool = None                                                 # graphs share one
        self.captured: set[int] = set()          # batch sizes captured at start
        self._choice: dict[tuple, tuple[int, int, int, bool] | None] = {}
        self._mixed_choice: dict[tuple, tuple[int, int, int, bool] | None] = {}
        self.replays = 0
        self.mixed_replays = 0
        self.rank = 0                            # capture's max_rank (its tile: the largest)
        self.start_tiles: tuple[int, ...] = ()   # tiles captured at start for all groups
        self.timings: list | None = None     # set to a list to record (batch, start, end) events
        self.shape: StepShape | None = None  # what the last run's step was

    def _ctx(self, b: int, mask: int, tile: int = 0, columns: bool = False) -> StepContext:
        """The static buffers' context for batch b, with a graph's LoRA choices."""
        lora = LoraMeta(self.seg_start[:b + 1], self.seg_slot[:b], mask, tile or self.rank,
                        columns, self.steps.tables)
        return StepContext(positions=self.pos[:b], slot_mapping=self.slots[:b],
                           block_tables=self.tables[:b], q_seq=self.q_seq[:b],
                           q_pos=self.q_pos[:b], sample_rows=None,   # every row samples
                           max_context=self.max_blocks * self.block_size, lora=lora,
                           rope_len=self.inputs.rope_len[:b])

    def mixed_seqs(self, t: int) -> int:
        """The sequences a mixed graph of t tokens holds (fewer than t: its attention launch
        is the prefill one, kernels.attention_triton, as an eager mixed step's)."""
        return min(self.sizes[-1], t - t // 8)

    def _ctx_mixed(self, t: int, mask: int, tile: int = 0, columns: bool = False
                   ) -> StepContext:
        """The static buffers' context for a mixed step of t tokens (rows) over mixed_seqs(t)
        sequences, each sampling from the row sample_rows names."""
        s = self.mixed_seqs(t)
        lora = LoraMeta(self.seg_start[:s + 1], self.seg_slot[:s], mask, tile or self.rank,
                        columns, self.steps.tables)
        return StepContext(positions=self.pos[:t], slot_mapping=self.slots[:t],
                           block_tables=self.tables[:s], q_seq=self.q_seq[:t],
                           q_pos=self.q_pos[:t], sample_rows=self.sample_rows[:s],
                           max_context=self.max_blocks * self.block_size, lora=lora,
                           rope_len=self.inputs.rope_len[:t])

    def capture(self, max_rank: int = 64) -> None:
        """Capture every decode and mixed graph (see the module docstring), largest first, sharing
        one memory pool; progress in the log.

        The SGMV kernel's rank tile is baked into a graph: graphs serve steps whose adapters have
        ranks up to rank_tile(max_rank); a step with a larger adapter runs eagerly.
        """
        start = time.monotonic()
        keys = self._plan(max_rank)
        for i, (mask, tile, columns) in enumerate(keys):
            t = time.monotonic()
            for n in reversed(self.mixed_sizes):          # the largest first: pool reuse
                self._capture_one(n, mask, tile, columns, mixed=True)
            for b in reversed(self.sizes):
                self._capture_one(b, mask, tile, columns)
            log.info("captured LoRA groups %s, rank tile %d%s for %d batch sizes and %d mixed "
                     "token counts in %.1fs (%d of %d)", bin(mask), tile,
                     ", column LoRA" if columns else "", len(self.sizes), len(self.mixed_sizes),
                     time.monotonic() - t, i + 1, len(keys))
        self.captured = set(self.sizes)
        self.mixed_on = bool(self.mixed)
        from kernels.sgmv_split import barrier_timeouts
        if barrier_timeouts(self.model.device):
            log.error("an SGMV grid barrier timed out while capturing: LoRA output is wrong")
        log.info("captured %d decode graphs (batch %s, rank tiles %s) and %d mixed-step graphs "
                 "(tokens %s) in %.1fs", len(self.graphs), ",".join(map(str, self.sizes)),
                 ",".join(map(str, self.start_tiles)) or "-", len(self.mixed),
                 ",".join(map(str, self.mixed_sizes)) or "-", time.monotonic() - start)

    def _plan(self, max_rank: int) -> list[tuple[int, int, bool]]:
        self.rank = max_rank
        self.start_tiles = tuple(sorted({rank_tile(min(16, max_rank)), rank_tile(max_rank)}))
        return self.start_keys()

    def warm_forwards(self, max_rank: int, part: int = 0, parts: int = 1) -> int:
        """The warm-up forwards of every parts-th graph that capture() would make, from the
        part-th, without capturing (services.worker.startup.precompile); how many."""
        keys = self._plan(max_rank)
        items = [(b, *key, False) for key in keys for b in reversed(self.sizes)]
        items += [(n, *key, True) for key in keys for n in self.mixed_sizes]
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

    def _capture_one(self, b: int, mask: int, tile: int = 0, columns: bool = False,
                     mixed: bool = False) -> None:
        """Capture the decode graph for batch size b (mixed: the mixed-step graph of b tokens)
        and these LoRA choices (inputs: whatever the static buffers hold; the warm-up passes
        rewrite the same KV slots with the same values)."""
        key = (b, mask, tile, columns)
        kv = self.runner.kv_cache
        ctx = self._warm(*key, mixed=mixed)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        if mixed and self._mixed_logits is None:      # one for all mixed graphs
            w = self.model.w["lm_head"]
            self._mixed_logits = torch.empty(self.sizes[-1], w.shape[0], dtype=w.dtype,
                                             device=w.device)
        # thread_local: the adapter manager's placements (loader threads, the event loop) may copy
        # while a capture runs
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self.model.forward(self.ids[:b], ctx, kv)
            if mixed:
                out = self._mixed_logits[:out.shape[0]].copy_(out)
        self.pool = graph.pool()
        (self.mixed_outputs if mixed else self.outputs)[key] = out
        (self.mixed if mixed else self.graphs)[key] = graph
        metrics.count_capture()
        torch.cuda.synchronize()

    def _warm(self, b: int, mask: int, tile: int, columns: bool, mixed: bool = False
              ) -> StepContext:
        """A graph's warm-up forwards (Triton compiles, autotunes, lazy cuBLAS state) on the
        first layer only: every layer runs the same kernels on the same shapes (as in
        services.worker.startup.warmup). Returns the graph's step context."""
        ctx = (self._ctx_mixed if mixed else self._ctx)(b, mask, tile, columns)
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
        """One step, waited for: from a graph when it is a decode or mixed step that has one, else
        eagerly; returns the rows that sampled, their tokens and logprobs (ModelRunner.run)."""
        pending = self.launch(batch)
        if pending is None:
            out = self.runner.run(batch)
            self.shape = self.runner.shape
            return out
        self.shape = pending.shape
        return self.collect(pending)

    def launch(self, batch: list[Scheduled], prev: PendingStep | None = None
               ) -> PendingStep | None:
        """Start a decode or mixed step from its graph and return without waiting; None (nothing
        launched) when the step cannot run from a graph.

        With prev (a step still in flight), every row continues a sequence of prev: its input
        token is the one prev sampled for it, still only on the device, and its output counter
        is one ahead of seq.tokens."""
        decode = all(x.num_tokens == 1 for x in batch) and (
            prev is not None or all(x.samples for x in batch))
        # a penalty reads the tokens so far, the one in flight included: such steps run eagerly
        if any(x.seq.sampling.history for x in batch):
            return None
        if not decode:
            return self._launch_mixed(batch) if prev is None and self.mixed_on else None
        b = self._bucket(len(batch))
        if b is None or b not in self.captured:
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
        segments = self.inputs.fill(plan, b, src)
        if src is not None:
            n = len(batch)
            torch.index_select(prev.tokens, 0, self.inputs.dev64[3, :n], out=self.ids[:n])
        if self.timings is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.graphs[key].replay()
            end.record()
            self.timings.append((b, start, end))
        else:
            self.graphs[key].replay()
        self.replays += 1
        step = self._sampled(batch, self.outputs[key][:len(batch)], prev)
        step.shape = step_shape("decode-graph", plan, segments, None)
        return step

    def _launch_mixed(self, batch: list[Scheduled]) -> PendingStep | None:
        """Start a mixed step (prompt chunks, with or without decode rows) from the graph of
        the smallest token count that holds it, as launch does a decode step; None when none
        does (too many tokens or sequences, an adapter above the graphs' ranks, prompt
        logprobs asked)."""
        size = self.mixed_size(batch)
        if size is None or any(x.seq.prompt_lps is not None for x in batch):
            return None
        plan = self.steps.plan(batch, graph=True)
        key = None if plan.rank > rank_tile(self.rank) else self._graph_key(
            size, plan.mask, plan.rank, plan.columns, mixed=True)
        if key is None:
            return None
        sampled, shape = self.fill_mixed(plan, size)
        self.mixed[key].replay()
        self.mixed_replays += 1
        step = self._sampled(sampled, self.mixed_outputs[key][:len(sampled)], None)
        step.shape = shape
        return step

    @contextlib.contextmanager
    def eager_mixed(self):
        """Mixed steps run eagerly for the duration (the warm-up: the eager path's shapes)."""
        saved, self.mixed_on = self.mixed_on, False
        try:
            yield
        finally:
            self.mixed_on = saved

    def mixed_size(self, batch: list[Scheduled]) -> int | None:
        """The token count of the mixed graph a step fits (None: none)."""
        t, n = sum(x.num_tokens for x in batch), len(batch)
        return next((m for m in self.mixed_sizes if m >= t and self.mixed_seqs(m) >= n), None)

    def fill_mixed(self, plan: StepPlan, size: int) -> tuple[list[Scheduled], StepShape]:
        """Write a mixed step's inputs for the graph of `size` tokens (StaticInputs.fill, as a
        decode step's); returns the entries that sample, in the order of the graph's logits
        rows, and what the step is (step_shape)."""
        n = len(plan.batch)
        lens = np.fromiter((x.num_tokens for x in plan.batch), dtype=np.int64, count=n)
        samples = np.fromiter((x.samples for x in plan.batch), dtype=bool, count=n)
        rows = np.cumsum(lens)[samples] - 1           # each sampling sequence's last row
        segments = self.inputs.fill(plan, size, lens=lens, seqs=self.mixed_seqs(size),
                                    sample_rows=rows)
        sampled = [x for x, s in zip(plan.batch, samples) if s]
        return sampled, step_shape("mixed-graph", plan, segments, lens)

    def _sampled(self, batch: list[Scheduled], logits: torch.Tensor,
                 prev: PendingStep | None) -> PendingStep:
        """graph_inputs.start_sampling into this step's host set (with the eager runner's
        grammar masks: a step with grammar rows launched from prev samples at collect(prev))."""
        return start_sampling(batch, logits, prev, self.eos, self.inputs.filled.tokens,
                              self.runner.masks)

    collect = staticmethod(collect)

    def _graph_key(self, b: int, mask: int, tile: int, columns: bool = False,
                   mixed: bool = False) -> tuple[int, int, int, bool] | None:
        """The graph a decode step (mixed: a mixed step of b tokens) replays (see the module
        docstring): its own key, else the captured one of size b with the fewest groups that
        cover mask's and the smallest tile >= tile (a column-LoRA one only for a step with
        column LoRA, and preferred then); None: no graph serves it (the step runs eagerly).
        Memoised."""
        graphs, choice = (self.mixed, self._mixed_choice) if mixed else (self.graphs,
                                                                         self._choice)
        key = (b, mask, tile, columns)
        if key in graphs:
            return key
        if key not in choice:
            fits = [(bin(m).count("1"), t, not c, (bb, m, t, c))
                    for bb, m, t, c in graphs if bb == b and t >= tile and m & mask == mask
                    and (columns or not c)]
            choice[key] = min(fits)[3] if fits else None
        return choice[key]
