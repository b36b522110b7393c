"""Before a worker says SERVING: run each kind of eager step it can meet once.

Decode steps, and mixed steps of up to --graph-mixed-tokens tokens, replay CUDA graphs captured at
start (services.worker.executor.graph_runner), whose kernels the capture compiled. The other steps
(larger prefill steps, adapters above the graphs' rank tiles, penalties, prompt logprobs; while the
warm-up runs, every step with prompt tokens: the eager path must be ready for any of them) run
eagerly,
and an eager step whose shapes a Triton kernel has not seen needs a new specialization of it:
seconds of compiling on a cold kernel cache, milliseconds of loading on a warm one, either way
a stall of every row of that step. Triton specializes an integer argument by whether it is 1
and whether it divides by 16, and the kernels pick launch configurations by size; so the
warm-up runs prompts of 1, 2-15, 16, 17 ... up to --max-batch-tokens tokens at each power of two
and either side of it, alone and beside decode rows (8 and 16 sequences in the step; beside
decode rows a step takes at most --max-prefill-with-decode prompt tokens, so the lengths up to
that and one prompt of the whole budget, which the scheduler takes in chunks), for the
base model and for zero adapters of each rank tile (with and without LoRA columns, several in
one step), with the sampling variants (greedy, temperature, top-k, top-p, repetition penalty).
Then one LoRA call of each class a step can make (services.worker.startup.kernel_warmup): the
LoRA kernels' specializations depend on a step's rows, segments and rank tile together, which
its engine steps reach only in part (their many-adapter steps run at the smallest tile).

It drives the real engine (scheduler, runner, graphs) on this thread before the engine thread
starts, with the model cut to its first layer for eager steps (the other layers run the same
kernels on the same shapes: a 7B warm-up is ~30x cheaper); the adapters are zeros placed in
the pool and removed after, and every sequence ends, so the pool and the KV cache are as they
were. kernels.compile_watch counts what it compiled.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from kernels.sgmv_choice import rank_tile
from kernels.sgmv_space import rank_tiles, size_classes, witnesses
from services.worker.adapters.device_pool import PoolFull
from services.worker.adapters.layout import staged_from_tensors
from services.worker.engine.loop import Engine
from services.worker.engine.sequence import Sampling, Sequence, Status, Stopping
from services.common.families import PARENT
from services.worker.model.spec import ModelSpec
from services.worker.startup import kernel_warmup

log = logging.getLogger(__name__)
SAMPLINGS = (Sampling(), Sampling(0.8, 0, 0.9, 7, 1.0), Sampling(1.0, 20, 1.0, 8, 1.1),
             Sampling(0.7, 50, 0.95, 9, 1.0),
             # OpenAI's penalties, a logit bias, min_tokens and logprobs with alternatives
             Sampling(0.9, 0, 1.0, 10, 1.0, 0.5, 0.5, ((5, 1.0),), 2, 5))


def token_counts(max_tokens: int) -> list[int]:
    """1, 2, 3, 7, 8, 15, 16, 17 and each power of two from 32 with its neighbours, up to
    max_tokens (and max_tokens itself): kernels.sgmv_space.size_classes."""
    return size_classes(max_tokens)


def zero_adapter(spec: ModelSpec, rank: int, modules=None, layers=(0,)):
    """A PEFT adapter of zeros (its output is the base model's) on `modules` (default: every
    target of the model's family) of these layers: the first only by default, the one the
    warm-up's eager steps run (a 7B model's adapters of every layer were ~1.4 GB of zeros to
    make, stage and place for nothing)."""
    tensors = {}
    modules = tuple(modules or spec.lora_targets)
    for layer in layers:
        for m in modules:
            k, n = spec.in_out(m)
            stem = f"base_model.model.model.layers.{layer}.{PARENT[m]}.{m}"
            tensors[f"{stem}.lora_A.weight"] = torch.zeros(rank, k, dtype=torch.bfloat16)
            tensors[f"{stem}.lora_B.weight"] = torch.zeros(n, rank, dtype=torch.bfloat16)
    config = {"r": rank, "lora_alpha": rank, "target_modules": list(modules),
              "peft_type": "LORA", "bias": "none", "layers_to_transform": list(layers)}
    return staged_from_tensors(tensors, config, spec)


@dataclass
class Report:
    steps: int = 0
    sequences: int = 0
    seconds: float = 0.0
    witnesses: int = 0          # LoRA calls of the kernel witnesses (kernel_warmup)


class Warmup:
    def __init__(self, engine: Engine, pool, spec: ModelSpec, max_batch_tokens: int,
                 max_rank: int, max_running: int, decode_rows: tuple[int, ...] = (7, 15),
                 prefill_with_decode: int = 0, part: int = 0, parts: int = 1):
        """part, parts: run every parts-th adapter set from the part-th (a share of the work,
        services.worker.startup.precompile), else all."""
        self.engine, self.pool, self.spec = engine, pool, spec
        self.part, self.parts = part, parts
        self.tokens = token_counts(max_batch_tokens)
        # beside decode rows a step has at most `cap` prompt tokens (the scheduler's
        # max_prefill_with_decode): those lengths, and the whole budget (taken in chunks of
        # `cap` over a growing context)
        cap = min(prefill_with_decode or max_batch_tokens, max_batch_tokens)
        self.mixed_tokens = [n for n in self.tokens if n <= cap or n == max_batch_tokens]
        self.cap = cap
        # prompt lengths beside the decode rows of many adapters: each side of the sizes where
        # the SGMV implementation and its tiles change, and the whole token budget
        self.segment_tokens = [n for n in (1, 16, 17, 64, 65, 256, 257, 1024, 1025, 2048, 2049)
                               if n < max_batch_tokens and n <= cap] + [max_batch_tokens]
        self.max_running = max_running
        self.max_distinct = min(pool.max_slots, max_running + 1)
        self._rank1_staged = None
        self.max_rank, self.decode_rows = max_rank, decode_rows
        self._ids = itertools.count()
        self.report = Report()

    def adapter_sets(self) -> list[tuple[str, list[tuple[str, object, bool]]]]:
        """(label, [(key, staged, columns)]): the base model; each rank tile alone; a rank-16
        adapter kept out of the columns; attention-only and MLP-only adapters; several
        adapters in one step (at the smallest rank tile: the LoRA calls of many adapters at
        the other tiles are kernel witnesses, _witnesses)."""
        spec = self.spec
        sets: list[tuple[str, list]] = [("base", [])]
        for t in rank_tiles(self.max_rank):
            sets.append((f"rank {t}", [(f"warmup-r{t}", zero_adapter(spec, t), True)]))
        sets.append(("rank 16 without columns",
                     [("warmup-r16-split", zero_adapter(spec, 16), False)]))
        attn = tuple(m for m in spec.lora_targets if PARENT[m] == "self_attn")
        sets.append(("rank 8, attention only",
                     [("warmup-r8-attn", zero_adapter(spec, 8, attn), True)]))
        mlp = tuple(m for m in spec.lora_targets if PARENT[m] == "mlp")
        sets.append(("rank 8, MLP only", [("warmup-r8-mlp", zero_adapter(spec, 8, mlp), True)]))
        # several adapters a step: with column LoRA (q/k/v in the GEMM while every adapter of
        # the step has column blocks; past their count q/k/v go through SGMV), and, up to that
        # count, without (q/k/v through SGMV: a step with an adapter that got no blocks)
        sets.append(("many adapters", [(f"warmup-many-{i}", None, True)
                                        for i in range(self.max_distinct)]))
        cols = getattr(self.pool, "columns", None)
        if cols is not None and cols.n_cols:
            few = min(self.max_distinct, cols.n_cols + 2)
            sets.append(("many adapters without columns",
                         [(f"warmup-many-nc-{i}", None, False) for i in range(few)]))
        sets.append(("ranks 8, 16, 64 together",
                     [("warmup-mix-8", zero_adapter(spec, 8), True),
                      ("warmup-mix-16", zero_adapter(spec, 16), False),
                      ("warmup-mix-64", zero_adapter(spec, min(64, rank_tile(self.max_rank))),
                       True)]))
        return sets

    def run(self) -> Report:
        """Every set's shapes, through the first layer only (the kernels of one layer are those
        of all; decode steps still replay their full-model graphs)."""
        runner = self.engine.runner
        # the eager path's shapes: mixed steps run eagerly meanwhile (their graphs' kernels
        # were compiled at capture)
        eager = getattr(runner, "eager_mixed", contextlib.nullcontext)
        model = runner.model
        model.layer_limit = 1
        try:
            with eager():
                return self._run()
        finally:
            model.layer_limit = None

    def _run(self) -> Report:
        start = time.monotonic()
        sets = self.adapter_sets()[self.part::self.parts]
        for i, (label, adapters) in enumerate(sets, 1):
            t0, steps0 = time.monotonic(), self.report.steps
            placed, many = [], label.startswith("many adapters")
            try:
                for key, staged, columns in adapters:
                    staged = staged or self._rank1()
                    placed.append((key, self.pool.place(key, staged, columns)))
            except PoolFull:
                if not many:
                    log.info("warm-up: %s: skipped (the pool cannot hold it)", label)
                    for key, _ in placed:
                        self.pool.remove(key)
                    continue              # (a step never has more adapters than the pool)
            try:
                if many:
                    self._segments([slot for _, slot in placed])
                else:
                    self._shapes([slot for _, slot in placed] or [-1])
            finally:
                for key, _ in placed:
                    self.pool.remove(key)
            log.info("warm-up: %s: %d steps in %.1fs (%d of %d)", label,
                     self.report.steps - steps0, time.monotonic() - t0, i, len(sets))
        self._witnesses()
        self.report.seconds = time.monotonic() - start
        return self.report

    def _witnesses(self) -> None:
        """One LoRA call of each class a step can make (its share of them: part, parts)."""
        runner = self.engine.runner
        runner = getattr(runner, "runner", runner)           # the eager one under the graphs'
        space = kernel_warmup.space_of(runner.model, self.pool, self.tokens[-1],
                                       min(self.max_running, runner.buffers.max_seqs),
                                       self.max_rank)
        if space is None:
            return
        t0 = time.monotonic()
        found = witnesses(space)[self.part::self.parts]
        kernel_warmup.launch(runner.model, self.pool.tables, runner.buffers, found)
        self.report.witnesses = len(found)
        log.info("warm-up: %d LoRA kernel witnesses in %.2fs", len(found),
                 time.monotonic() - t0)

    def _shapes(self, slots: list[int]) -> None:
        """Each prompt length alone, then beside each count of decode rows."""
        for n in self.tokens:
            self._drain(self._prompts(n, slots[0], 0))
        for rows in self.decode_rows:
            # (a prompt that one step could not take beside the rows is left out)
            lengths = [n for n in self.mixed_tokens
                       if not (n <= self.cap and n + rows > self.tokens[-1])]
            self._beside([slots[j % len(slots)] for j in range(rows)],
                         [self._prompts(n, slots[(rows + 1) % len(slots)], rows)
                          for n in lengths])

    def _rank1(self):
        if self._rank1_staged is None:          # rank 1: the rank-16 tile's kernels, 1/16 the bytes
            self._rank1_staged = zero_adapter(self.spec, 1)
        return self._rank1_staged

    def _segments(self, slots: list[int]) -> None:
        """Steps of k decode rows on k distinct adapters beside a prompt on one more, for k of
        each specialization class of the kernels' segment count (up to the adapters the pool
        holds and the rows a step may have): segment tables are sized by powers of two."""
        most = min(len(slots) - 1, self.max_running - 1)
        for k in [k for k in token_counts(most) if k <= most]:
            lengths = sorted({min(n, self.tokens[-1] - k) for n in self.segment_tokens} - {0})
            self._beside(slots[:k], [self._prompts(n, slots[k], k) for n in lengths if n > 0])

    def _beside(self, row_slots: list[int], prompt_sets: list[list[Sequence]]) -> None:
        """Each set of prompts prefilled beside decode rows on these slots, one set after
        another: the rows' own prefill first, then steps of a set's chunks beside one decode
        token a row; then the rows are aborted."""
        chunks = sum(-(-sum(len(p.prompt) for p in prompts) // self.cap)
                     for prompts in prompt_sets)
        # tokens enough for every chunk, and for a decode-only step between two sets (an
        # overlapped engine may launch one before the next set arrives)
        new = 2 + chunks + 2 * len(prompt_sets)
        decoding = [self._seq(3, slot, new, j) for j, slot in enumerate(row_slots)]
        self._drain(decoding, stop_after=1)          # their prefill: now they decode
        for prompts in prompt_sets:
            self._submit(prompts)
            while any(p.status is not Status.FINISHED for p in prompts) and self.engine.step():
                self.report.steps += 1
        for seq in decoding:                 # done with them: no decode-only steps to the end
            if seq.status is not Status.FINISHED:
                self.engine.abort(seq.request_id)
        self._drain([])

    def _prompts(self, n: int, slot: int, j: int) -> list[Sequence]:
        """Prompts of n tokens in all, each short enough for the model (a step of more tokens
        than one prompt may hold is several prompts)."""
        most = self.engine.max_model_len - 4
        return [self._seq(min(most, n - i), slot, 1, j) for i in range(0, n, most)]

    def _seq(self, n: int, slot: int, new: int, j: int) -> Sequence:
        vocab = self.spec.vocab_size
        return Sequence(f"warmup#{next(self._ids)}", [(3 + 7 * i) % vocab for i in range(n)],
                        slot=slot, sampling=SAMPLINGS[j % len(SAMPLINGS)],
                        stopping=Stopping(new, (), 0.0, True))

    def _submit(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.engine.submit(seq, _discard)
        self.report.sequences += len(seqs)

    def _drain(self, seqs: list[Sequence], stop_after: int = 0) -> None:
        """Submit seqs and step until nothing is left (or for stop_after steps)."""
        self._submit(seqs)
        steps = 0
        while self.engine.step():
            steps += 1
            self.report.steps += 1
            if stop_after and steps >= stop_after:
                return


def _discard(_event) -> None:
    pass
