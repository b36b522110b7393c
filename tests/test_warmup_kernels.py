"""The warm-up meets every specialization of the LoRA kernels that a step of the worker can need
(services.worker.startup.kernel_warmup, kernels.sgmv_space), compared as Triton keys: on CPU the
model runs the torch references, so each LoRA call the model makes is also handed to the Triton
launchers (kernels.sgmv) with their kernels replaced by recorders of what a launch would
specialize on (the constexprs, the launch options, and each specialized argument's class),
with PDL as on an H100 or without it.

The H100 saturation run of issue 42 (140 adapters of ranks 8-64, --max-running 256,
--max-batch-tokens 4096, --warmup-max-rank 64) compiled 14 rank-64 specializations of
`_sgmv_kernel`, `_shrink_kernel` and `_expand_kernel` while serving: the warm-up's engine steps
had not met those (rows, segments) pairs. At that configuration (here, with the tiny model's
shapes and PDL) the engine steps of the warm-up as it was then plus its rank-32/64 many-adapter
steps met 222 of the 273 keys a step can need; the rest were 256 rows in 65+ segments at rank
64, 129 segments (128 pool slots and the base rows) at every tile, and column LoRA past 32
segments."""
from __future__ import annotations

import random

import pytest
import torch

from kernels import pdl, sgmv, sgmv_split, sgmv_triton, shrink_blocks
from kernels.sgmv_choice import choose_kernel, rank_tile
from kernels.sgmv_space import Space, Witness, batch_class, calls, witnesses
from services.worker.config import EngineOptions
from services.worker.model import llama
from services.worker.perf_config import PerfConfig
from services.worker.startup import kernel_warmup
from services.worker.startup.factory import build_engine
from services.worker.startup.warmup import Warmup
from tests.support import MODEL_DIR

KERNELS = ((sgmv_split, "_shrink_kernel"), (sgmv_split, "_expand_kernel"),
           (sgmv_split, "_one_launch_kernel"), (sgmv_triton, "_sgmv_kernel"),
           (shrink_blocks, "_shrink_blocks_kernel"))


def _arg_class(v):
    """What Triton specializes a non-constexpr argument on: a tensor's dtype and 16-byte
    alignment, an integer's being 1 and dividing by 16."""
    if isinstance(v, torch.Tensor):
        return (str(v.dtype), v.data_ptr() % 16 == 0)
    if isinstance(v, int):
        return ("int", v == 1, v % 16 == 0)
    return type(v).__name__


class Recorder:
    """The Triton keys of the LoRA calls the model makes, by phase ("steps": the warm-up's
    engine steps, "witness": its kernel witnesses, or what the test sets)."""

    def __init__(self, monkeypatch, pdl_on: bool):
        self.phase, self.keys, self._launched = "steps", {}, []
        for module, name in KERNELS:
            monkeypatch.setattr(module, name, _Fake(getattr(module, name), self._launched))
        monkeypatch.setattr(pdl, "enabled", lambda device: pdl_on)
        self.real = (llama.lora, llama.lora_expand_columns, llama.lora_shrink_rows)
        monkeypatch.setattr(llama, "lora", self.lora)
        monkeypatch.setattr(llama, "lora_expand_columns", self.expand_columns)
        monkeypatch.setattr(llama, "lora_shrink_rows", self.shrink_rows)
        self.launch = kernel_warmup.launch
        monkeypatch.setattr(kernel_warmup, "launch", self.witnessing)

    def _keep(self, launch) -> None:
        self._launched.clear()
        launch()
        self.keys.setdefault(self.phase, set()).update(self._launched)

    def lora(self, y, x, a, impl="auto"):
        kind = choose_kernel(x.shape[0], a.seg_slot.shape[0], a.max_rank, True, a.host)
        if kind != "cublas":                        # (cuBLAS: no Triton kernel)
            self._keep(lambda: sgmv.lora(y, x, a, "split" if kind == "split" else "triton"))
        return self.real[0](y, x, a, impl)

    def expand_columns(self, y, v_cols, col_slot, a, impl="auto"):
        self._keep(lambda: sgmv.lora_expand_columns(y, v_cols, col_slot, a, "split"))
        return self.real[1](y, v_cols, col_slot, a, impl)

    def shrink_rows(self, out, x, col_slot, a, parts, impl="auto"):
        self._keep(lambda: sgmv.lora_shrink_rows(out, x, col_slot, a, parts, "triton"))
        return self.real[2](out, x, col_slot, a, parts, impl)

    def witnessing(self, model, tables, buffers, found):
        saved, self.phase = self.phase, "witness"
        try:
            return self.launch(model, tables, buffers, found)
        finally:
            self.phase = saved

    def keys_of(self, runner, tables, found: list[Witness], phase: str) -> set:
        """The keys of these calls (made as the warm-up makes its witnesses)."""
        saved, self.phase = self.phase, phase
        try:
            self.launch(runner.model, tables, runner.buffers, found)
        finally:
            self.phase = saved
        return self.keys.get(phase, set())


class _Fake:
    """A @triton.jit kernel's stand-in: kernel[grid](...) records its key."""

    def __init__(self, real, sink: list):
        self.real, self.sink = real, sink

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs):
        params = [p for p in self.real.params if not p.is_constexpr]
        assert len(args) == len(params), (self.real.__name__, len(args), len(params))
        spec = tuple((p.name, _arg_class(v)) for p, v in zip(params, args)
                     if not p.do_not_specialize)
        consts = tuple(sorted((k, v) for k, v in kwargs.items() if k != "launch_pdl"))
        self.sink.append((self.real.__name__, consts, spec))


def describe(keys) -> str:
    """A key a line: the kernel, its batch-dependent constexprs, and its unaligned pointers
    and integer arguments of 1."""
    shown = ("N_SLICES", "SEG_BLOCK", "BLOCK_M", "BLOCK_N", "BLOCK_K", "RANK_BLOCK", "REDUCE",
             "COLS", "USE_PDL")
    lines = []
    for name, consts, spec in keys:
        odd = [a for a, c in spec if c[1:] in ((False,), (True, False))]
        lines.append(f"{name}({', '.join(f'{k}={v}' for k, v in consts if k in shown)})"
                     + (f" unaligned or 1: {odd}" if odd else ""))
    return "\n".join(sorted(lines))


def dense(space: Space) -> dict[tuple, Witness]:
    """The first call of each class among every (T, n) of the space: T from 1 to its token
    budget, n from 1 to its segment bound (at most T), at every rank tile."""
    first = {}
    for path, group, k, s, t, n, r in calls(space, range(1, space.max_tokens + 1),
                                            lambda bound: range(1, bound + 1)):
        key = (path, group, batch_class(path, t, n, r, k, s, space.dtype, space.pdl))
        first.setdefault(key, Witness(path, group, t, n, r))
    return first


def _engine(tokens: int, running: int):
    return build_engine(MODEL_DIR, EngineOptions(
        max_batch_tokens=tokens, max_running=running, pool_bytes=64 << 20, pool_slots=running,
        perf=PerfConfig(lora_columns=4, lora_rows=4)))


@pytest.mark.parametrize("pdl_on", [True, False], ids=["pdl", "no-pdl"])
def test_the_warm_up_meets_every_lora_specialization_a_step_can_need(monkeypatch, pdl_on):
    """Rank 64 among up to 72 adapters a step, up to 300 rows: steps of 256 rows with more than
    64 segments take the fused kernel at SEG_BLOCK 128, which no engine step of the warm-up
    reaches (nor, at 4,096 rows, 33-64 segments of 1,056-2,048 rows: the split kernel's 64-row
    tiles at SEG_BLOCK 64)."""
    built = _engine(300, 72)
    rec = Recorder(monkeypatch, pdl_on)
    report = Warmup(built.engine, built.pool, built.spec, 300, max_rank=64, max_running=72).run()
    model = built.engine.runner.model
    space = kernel_warmup.space_of(model, built.pool, 300, 72, 64)
    assert space.pdl is pdl_on and space.max_segs == 72 and space.columns[0] and space.rows
    reachable = rec.keys_of(built.engine.runner, built.pool.tables, list(dense(space).values()),
                            "reachable")
    steps, witnessed = rec.keys["steps"], rec.keys.get("witness", set())
    # every key the engine steps launched is one the enumeration has (the same calls)
    assert steps <= reachable, describe(steps - reachable)
    missing = reachable - steps - witnessed
    assert not missing, f"{len(missing)} of {len(reachable)} never launched:\n{describe(missing)}"
    assert witnessed <= reachable and report.witnesses == len(witnesses(space))
    assert built.pool.free_bytes == built.pool.capacity_bytes


def test_calls_of_one_class_launch_the_same_specializations(monkeypatch):
    """batch_class against the launchers: sampled calls (every rank, not only the tiles) launch
    what the first call of their class launches."""
    built = _engine(300, 72)
    rec = Recorder(monkeypatch, True)
    model = built.engine.runner.model
    space = kernel_warmup.space_of(model, built.pool, 300, 72, 64)
    first = dense(space)
    groups = {g: (k, s) for g, k, s in space.groups}
    rng = random.Random(42)
    for i in range(300):
        path = rng.choice(("sgmv", "sgmv", "sgmv", "columns", "rows"))
        t = rng.randint(1, space.rows if path == "rows" else space.max_tokens)
        n = rng.randint(1, min(t, space.max_segs))
        group = {"columns": "qkv", "rows": "o"}.get(path) or rng.choice(sorted(groups))
        r = rng.randint(1, 64) if path == "sgmv" else space.columns[1]
        k, s = groups[group] if path == "sgmv" else (0, space.columns[0] if path == "columns"
                                                      else 1)
        cls = batch_class(path, t, n, r, k, s, space.dtype, space.pdl)
        assert cls == batch_class(path, t, n, rank_tile(r), k, s, space.dtype, space.pdl)
        at = rec.keys_of(built.engine.runner, built.pool.tables, [Witness(path, group, t, n, r)],
                         f"call {i}")
        ref = rec.keys_of(built.engine.runner, built.pool.tables, [first[(path, group, cls)]],
                          f"its class {i}")
        assert at == ref, (path, group, t, n, r)


@pytest.mark.parametrize("tokens, segs, rank, pdl_on", [
    (2100, 140, 64, True),           # past SPLIT_MAX_ROWS rows and SEG_BLOCK 256
    (300, 72, 128, False),           # the one-launch form (no PDL), rank tile 128
])
def test_the_witnesses_find_every_class_a_scan_of_every_step_finds(tokens, segs, rank, pdl_on):
    """witnesses() looks at the power-of-two neighbours of T and n only; every (T, n) finds no
    class more (7B shapes, bf16)."""
    space = Space(tokens, segs, rank, (("qkv", 4096, 3),), torch.bfloat16, pdl_on, (3, 16),
                  128)
    found = {(w.path, w.group, batch_class(w.path, w.rows, w.segs, w.rank, 4096, 3,
                                           space.dtype, pdl_on)) for w in witnesses(space)}
    every = dense(space)
    assert found == set(every), sorted(set(every) - found, key=str)[:5]
