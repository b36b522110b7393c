"""The device pool (services.worker.adapters.device_pool) on the tiny model, with the demo adapters:
an adapter's slot becomes visible only once its weights and tables are written, a failed copy gives
its range and slot back, every matrix lands where the tables say, transposed and folded
as the kernels expect. The device work here is the pool's own, held at an event so that the
window between reserving a slot and finishing the copy can be looked into."""
from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from services.common.errors import InvalidArgument
from services.worker.adapters.layout import (OFFSET_ALIGN, staged_from_peft_dir,
                                             staged_from_tensors)
from services.worker.adapters.device_pool import DevicePool
from services.worker.model.spec import GROUPS, MODULE_GROUP, load_spec
from tests.support import DEMO_ADAPTERS, MODEL_DIR


class HeldPool(DevicePool):
    """A DevicePool whose copies wait at `release` once `started` is set (or fail, with
    `fail`)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.started, self.release, self.fail = threading.Event(), threading.Event(), False

    def _write(self, staged, segs, values, timing=None):
        self.started.set()
        assert self.release.wait(30)
        if self.fail:
            raise RuntimeError("copy failed")
        super()._write(staged, segs, values, timing)


@pytest.fixture
def pool_and_layout():
    spec = load_spec(MODEL_DIR)
    name = sorted(p.name for p in DEMO_ADAPTERS.iterdir())[0]
    layout = staged_from_peft_dir(DEMO_ADAPTERS / name, spec)
    return HeldPool(spec, torch.device("cpu"), torch.float32, 1 << 22, 4), layout


def test_a_slot_is_visible_only_once_placed(pool_and_layout):
    pool, layout = pool_and_layout
    out = {}
    placing = threading.Thread(target=lambda: out.setdefault("slot", pool.place("a", layout)))
    placing.start()
    assert pool.started.wait(30)
    assert pool.slot_of("a") is None                 # reserved, being copied: not handed out
    pool.release.set()
    placing.join(30)
    slot = out["slot"]
    assert pool.slot_of("a") == slot
    group = next(g for g, offs in layout.plan.offsets.items() if (offs >= 0).any())
    assert (pool.tables.a_off_host[group][..., slot] >= 0).any()
    assert pool.tables.ranks_host[slot] == layout.plan.rank
    assert int(pool.tables.ranks[slot]) == layout.plan.rank
    assert float(pool.tables.scales[slot]) == pytest.approx(layout.plan.scale)


def test_a_placement_times_its_wait_for_the_copy_path(pool_and_layout):
    """fill's timing: the seconds it waited for the copy path while another placement held it
    ("copy_wait"), and none for the device on a CPU pool, which copies inline."""
    _, layout = pool_and_layout
    plain = DevicePool(load_spec(MODEL_DIR), torch.device("cpu"), torch.float32, 1 << 22, 4)
    timing = {}
    plain.fill("quick", layout, plain.reserve("quick", layout), timing=timing)
    assert timing["device"] == 0.0 and 0 <= timing["copy_wait"] < 0.05
    held = threading.Event()

    def hold():
        with plain._copy.lock:
            held.set()
            time.sleep(0.3)
    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    plain.fill("waited", layout, plain.reserve("waited", layout), timing=timing)
    holder.join()
    assert timing["copy_wait"] >= 0.2 and plain.slot_of("waited") is not None


def test_a_failed_copy_gives_back_its_range_and_slot(pool_and_layout):
    pool, layout = pool_and_layout
    free = pool.free_bytes
    pool.fail = True
    pool.release.set()
    with pytest.raises(RuntimeError, match="copy failed"):
        pool.place("a", layout)
    assert pool.slot_of("a") is None and pool.free_bytes == free
    assert all((t == -1).all() for t in pool.tables.a_off_host.values())
    pool.fail = False
    assert pool.place("a", layout) in range(4)        # the slot and range are usable again
    assert np.count_nonzero(pool.tables.slot_groups) == 1


def _odd_adapter(spec, r: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for mod in ("q_proj", "k_proj", "o_proj", "down_proj"):
            k, n = spec.in_out(mod)
            part = "mlp" if mod == "down_proj" else "self_attn"
            pre = f"base_model.model.model.layers.{layer}.{part}.{mod}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(r, k, generator=gen).to(dtype)
            tensors[f"{pre}.lora_B.weight"] = torch.randn(n, r, generator=gen).to(dtype)
    return tensors


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_every_matrix_lands_at_an_aligned_offset_as_the_kernels_read_it(src_dtype):
    """The SGMV kernels take every pool offset as a multiple of tables.align (so that they may
    load adapter weights in 16-byte vectors): each A and Bt starts at a multiple of
    OFFSET_ALIGN elements even where r x K is odd, A reads back as it was, B transposed, in
    the pool's dtype, and the device tables (offsets, rank, scale) match the host's."""
    spec = dataclasses.replace(load_spec(MODEL_DIR), hidden_size=36, num_heads=3, head_dim=12,
                               num_kv_heads=1, intermediate_size=20)
    r = 3
    tensors = _odd_adapter(spec, r, src_dtype)
    staged = staged_from_tensors(tensors, {"r": r, "lora_alpha": 6}, spec)
    pool = DevicePool(spec, torch.device("cpu"), torch.float32, 1 << 20, 2)
    assert pool.tables.align == OFFSET_ALIGN
    pool.place("first", staged_from_tensors(_odd_adapter(spec, 5, seed=1), {"r": 5}, spec))
    slot = pool.place("odd", staged)
    t = pool.tables
    for name, w in tensors.items():
        layer, mod, ab = int(name.split(".")[4]), name.split(".")[6], name.split(".")[7]
        group, j = MODULE_GROUP[mod]
        table, dev = (t.a_off_host, t.a_off) if ab == "lora_A" else (t.b_off_host, t.b_off)
        off = int(table[group][layer, j, slot])
        assert off % OFFSET_ALIGN == 0, (name, off)
        assert int(dev[group][layer, j, slot]) == off
        want = (w if ab == "lora_A" else w.t()).float()
        got = t.pool[off:off + want.numel()].view(want.shape)
        assert torch.equal(got, want), name
    assert (t.a_off["gate_up"][..., slot] == -1).all()          # untargeted: absent
    assert int(t.ranks[slot]) == r and float(t.scales[slot]) == 2.0


def test_adapters_the_model_cannot_take_are_refused_with_the_tensor_named():
    """Planning checks the file's own header against the model: a shape that does not match,
    a lone A, a tensor of an unknown module, two dtypes in one file."""
    spec = load_spec(MODEL_DIR)
    good = _odd_adapter(spec, 4)
    name = next(iter(good))
    cases = {
        "do not match": {**good, name: torch.zeros(4, 7)},
        "needs both": {k: v for k, v in good.items() if "layers.0.self_attn.q_proj.lora_B" not in k},
        "not a supported target": {**good, name.replace("q_proj", "lm_proj"): good[name].clone()},
        "several dtypes": {**good, name: good[name].half()},
    }
    for message, tensors in cases.items():
        with pytest.raises(InvalidArgument, match=message):
            staged_from_tensors(tensors, {"r": 4}, spec)


def test_the_pool_folds_norm_weights_into_the_a_of_folded_groups():
    """With norm_fold (the model folded in-layer RMSNorm weights into q/k/v and gate/up), the
    pool holds g * A for those groups' A and leaves B and the other groups' A as they were."""
    spec = load_spec(MODEL_DIR)
    g = torch.Generator().manual_seed(3)
    fold = {"qkv": 1 + 0.2 * torch.randn(spec.num_layers, spec.hidden_size, generator=g),
            "gate_up": 1 + 0.2 * torch.randn(spec.num_layers, spec.hidden_size, generator=g)}
    staged = staged_from_peft_dir(DEMO_ADAPTERS / "pirate", spec)     # every group
    plain = DevicePool(spec, torch.device("cpu"), torch.float32, 1 << 22, 2)
    folded = DevicePool(spec, torch.device("cpu"), torch.float32, 1 << 22, 2, norm_fold=fold)
    s0, s1 = plain.place("a", staged), folded.place("a", staged)
    seen = set()
    for group, offs in staged.plan.offsets.items():
        for layer, j in zip(*np.nonzero(offs[:, :, 0] >= 0)):
            r = staged.plan.rank
            kk = spec.in_out(next(m for m, gj in MODULE_GROUP.items() if gj == (group, j)))[0]
            a0 = plain.tables.pool[plain.tables.a_off_host[group][layer, j, s0]:][:r * kk]
            a1 = folded.tables.pool[folded.tables.a_off_host[group][layer, j, s1]:][:r * kk]
            want = a0.view(r, kk) * fold[group][layer] if group in fold else a0.view(r, kk)
            torch.testing.assert_close(a1.view(r, kk), want)
            seen.add(group)
    assert seen == set(GROUPS)


@pytest.mark.parametrize("kn", [False, True])
def test_column_blocks_hold_each_adapters_a_rows_in_either_weight_layout(kn):
    """Column LoRA (services.worker.model.lora_columns): the extended q/k/v weight keeps the base
    weight's values and memory layout (a CUDA model stores it column-major), the model's
    weight becomes a view of its first rows, and placing an adapter writes its q/k/v A rows
    into a free block (zeros past its rank and for untargeted slices); one block for two
    adapters: the second gets none, and takes the first's once that is removed."""
    from services.worker.model.lora_columns import RANK_TILE, LoraColumns
    spec = load_spec(MODEL_DIR)
    starts = spec.slice_starts("qkv")
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(starts[-1], spec.hidden_size, generator=g) for _ in range(spec.num_layers)]
    layers = [{"qkv": (w.t().contiguous().t() if kn else w.clone())} for w in base]
    cols = LoraColumns({"layers": layers}, len(starts) - 1, 1, torch.device("cpu"))
    x = torch.randn(3, spec.hidden_size, generator=g)
    for w, layer in zip(base, layers):
        assert torch.equal(layer["qkv"], w) and layer["qkv_ext"].stride(0) == (1 if kn else
                                                                             spec.hidden_size)
        assert torch.allclose(torch.nn.functional.linear(x, layer["qkv_ext"])[:, :starts[-1]],
                              x @ w.t(), atol=1e-5)
    pool = DevicePool(spec, torch.device("cpu"), torch.float32, 1 << 22, 4, columns=cols)
    names = sorted(p.name for p in DEMO_ADAPTERS.iterdir())
    first = pool.place(names[0], staged_from_peft_dir(DEMO_ADAPTERS / names[0], spec))
    second = pool.place(names[1], staged_from_peft_dir(DEMO_ADAPTERS / names[1], spec))
    assert cols.col_host[first] == 0 and cols.col_host[second] == -1
    t = pool.tables
    n, k, r = starts[-1], spec.hidden_size, int(t.ranks_host[first])
    for layer, ext in enumerate(cols.ext):
        for j in range(len(starts) - 1):
            block = ext[n + j * RANK_TILE:n + (j + 1) * RANK_TILE]
            a_o = int(t.a_off_host["qkv"][layer, j, first])
            want = torch.zeros(RANK_TILE, k)
            if a_o >= 0:
                want[:r] = t.pool[a_o:a_o + r * k].view(r, k)
            assert torch.equal(block, want), (layer, j)
    assert int(cols.col_slot[first]) == 0 and int(cols.col_slot[second]) == -1
    assert (t.a_off_host["qkv"][:, :, first] < 0).any()      # some slice untargeted: zeros
    pool.remove(names[0])
    assert cols.col_host[first] == -1                        # the block is free again
    third = pool.place("again", staged_from_peft_dir(DEMO_ADAPTERS / names[1], spec))
    assert cols.col_host[third] == 0 and int(cols.col_slot[third]) == 0


@pytest.mark.parametrize("kn", [False, True])
def test_row_blocks_hold_each_adapters_o_bt_rows_in_either_weight_layout(kn):
    """Row LoRA (LoraColumns rows=True): the extended o weight [N, K + n_cols * 16] keeps the
    base o weight's values and memory layout, the model's o weight becomes a view of its first
    K columns, and placing an adapter writes its o Bt rows (B's columns) into its block's
    columns (zeros past its rank and in the layers it leaves o out of); a block written for
    one adapter and then another holds only the second's. An adapter that targets o and not
    q/k/v gets a block only with rows."""
    from services.worker.model.lora_columns import RANK_TILE, LoraColumns
    spec = load_spec(MODEL_DIR)
    starts, k = spec.slice_starts("qkv"), spec.q_size
    g = torch.Generator().manual_seed(1)
    base = [{"qkv": torch.randn(starts[-1], spec.hidden_size, generator=g),
             "o": torch.randn(spec.hidden_size, k, generator=g)} for _ in range(spec.num_layers)]
    layers = [{n: (w.t().contiguous().t() if kn else w.clone()) for n, w in ws.items()}
              for ws in base]
    cols = LoraColumns({"layers": layers}, len(starts) - 1, 1, torch.device("cpu"), rows=True)
    x = torch.randn(3, k + RANK_TILE, generator=g)
    for ws, layer in zip(base, layers):
        assert torch.equal(layer["o"], ws["o"]) and layer["o_ext"].shape == (
            spec.hidden_size, k + RANK_TILE)
        assert layer["o_ext"].stride(0) == (1 if kn else k + RANK_TILE)
        assert torch.equal(layer["o_ext"][:, k:], torch.zeros(spec.hidden_size, RANK_TILE))
        torch.testing.assert_close(torch.nn.functional.linear(x[:, :k], layer["o"]),
                                   x[:, :k] @ ws["o"].t())
    pool = DevicePool(spec, torch.device("cpu"), torch.float32, 1 << 22, 4, columns=cols)
    names = sorted(p.name for p in DEMO_ADAPTERS.iterdir())
    t, with_o = pool.tables, 0
    for name in names:                                  # each in turn takes the one block
        slot = pool.place(name, staged_from_peft_dir(DEMO_ADAPTERS / name, spec))
        assert cols.col_host[slot] == 0
        r = int(t.ranks_host[slot])
        for layer, ext in enumerate(cols.o_ext):
            want = torch.zeros(spec.hidden_size, RANK_TILE)
            b_o = int(t.b_off_host["o"][layer, 0, slot])
            if b_o >= 0:
                want[:, :r] = t.pool[b_o:b_o + r * spec.hidden_size].view(r, -1).t()
                with_o += 1
            assert torch.equal(ext[:, k:], want), (name, layer)
        pool.remove(name)
    assert 0 < with_o < len(names) * spec.num_layers   # some layers with o rows, some without
    assert cols.assign(3, 8, targets_qkv=False, targets_o=True) == 0
    cols.release(3)
    plain = LoraColumns({"layers": [dict(ws) for ws in base]}, len(starts) - 1, 1,
                        torch.device("cpu"))
    plain.bind(4)
    assert plain.assign(3, 8, targets_qkv=False, targets_o=True) == -1
    assert plain.assign(3, 8, targets_qkv=True) == 0


def test_column_blocks_default_on_cuda_only():
    """LORAFLEET_LORA_COLUMNS unset: a CUDA model keeps CUDA_COLUMNS blocks, a CPU model none;
    set, it wins on both; a value that is not a count is an error."""
    from services.worker.perf_config import CUDA_COLUMNS, CUDA_ROW_PARTS, PerfConfig
    unset = PerfConfig.from_env({})
    assert CUDA_COLUMNS > 0
    assert unset.columns_for(cuda=True) == CUDA_COLUMNS and unset.columns_for(cuda=False) == 0
    assert PerfConfig.from_env({"LORAFLEET_LORA_COLUMNS": "0"}).columns_for(cuda=True) == 0
    assert PerfConfig.from_env({"LORAFLEET_LORA_COLUMNS": "5"}).columns_for(cuda=False) == 5
    for bad in ("-1", "x"):
        with pytest.raises(ValueError, match="LORAFLEET_LORA_COLUMNS"):
            PerfConfig.from_env({"LORAFLEET_LORA_COLUMNS": bad})
    with pytest.raises(ValueError, match="LORAFLEET_LORA_COLUMNS"):
        PerfConfig(lora_columns=-1)
    assert unset.rows_for(cuda=True) == CUDA_ROW_PARTS > 0 and unset.rows_for(cuda=False) == 0
    assert PerfConfig.from_env({"LORAFLEET_LORA_ROWS": "0"}).rows_for(cuda=True) == 0
    assert PerfConfig.from_env({"LORAFLEET_LORA_ROWS": "16"}).rows_for(cuda=False) == 16
    for bad in ("3", "on", "-1"):
        with pytest.raises(ValueError, match="LORAFLEET_LORA_ROWS"):
            PerfConfig.from_env({"LORAFLEET_LORA_ROWS": bad})
    with pytest.raises(ValueError, match="LORAFLEET_LORA_ROWS"):
        PerfConfig(lora_rows=32)


def test_split_attention_is_off_unless_asked_and_reaches_the_model(tmp_path):
    """LORAFLEET_SPLIT_ATTENTION: 0 by default, 1 turns it on, anything else is an error
    naming it; the engine's model takes the value its options carry."""
    from services.worker.config import EngineOptions
    from services.worker.perf_config import PerfConfig
    from services.worker.startup.factory import build_engine
    assert not PerfConfig.from_env({}).split_attention
    assert PerfConfig.from_env({"LORAFLEET_SPLIT_ATTENTION": "1"}).split_attention
    with pytest.raises(ValueError, match="LORAFLEET_SPLIT_ATTENTION"):
        PerfConfig.from_env({"LORAFLEET_SPLIT_ATTENTION": "yes"})
    built = build_engine(MODEL_DIR, EngineOptions(perf=PerfConfig(split_attention=True)))
    assert built.engine.runner.model.split_attention


def test_a_placement_runs_with_a_short_switch_interval_and_restores_it(monkeypatch):
    """A placement's device calls each give the GIL up; the interval a waiter waits before the
    engine thread must drop it is cut for the placement only (services.worker.adapters.gil), and
    concurrent users keep it cut until the last one leaves."""
    import sys
    from kernels import adapter_scatter
    from services.worker.adapters import gil
    spec = load_spec(MODEL_DIR)
    staged = staged_from_peft_dir(DEMO_ADAPTERS / "pirate", spec)
    pool = DevicePool(spec, torch.device("cpu"), torch.float32, 1 << 22, 4)
    seen, scatter = [], adapter_scatter.adapter_scatter_ref     # what a CPU pool launches
    monkeypatch.setattr(adapter_scatter, "adapter_scatter_ref",
                        lambda *a, **k: (seen.append(sys.getswitchinterval()), scatter(*a, **k)))
    before = sys.getswitchinterval()
    pool.place("a", staged)
    assert seen == [pytest.approx(min(before, gil.FAST_SWITCH_S))]
    assert sys.getswitchinterval() == before
    gil.enter()                         # a load in flight on the event loop's side
    pool.place("b", staged)             # the placement's own enter and leave nest inside it
    assert sys.getswitchinterval() == pytest.approx(min(before, gil.FAST_SWITCH_S))
    gil.leave()
    assert sys.getswitchinterval() == before
