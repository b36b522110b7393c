"""The device pool (services.worker.device_pool) on the tiny model, with the demo adapters: an
adapter's slot becomes visible only once its blob and tables are written, and a failed copy
gives its range and slot back. The copy here is the pool's own, held at an event so that the
window between reserving a slot and finishing the copy can be looked into."""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from services.worker.adapter_layout import OFFSET_ALIGN, build_layout, layout_from_peft_dir
from services.worker.device_pool import DevicePool
from services.worker.model_spec import MODULE_GROUP, load_spec
from tests.support import DEMO_ADAPTERS, MODEL_DIR


class HeldPool(DevicePool):
    """A DevicePool whose copies wait at `release` once `started` is set (or fail, with
    `fail`)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.started, self.release, self.fail = threading.Event(), threading.Event(), False

    def _copy(self, start, layout, slot):
        self.started.set()
        assert self.release.wait(30)
        if self.fail:
            raise RuntimeError("copy failed")
        super()._copy(start, layout, slot)


@pytest.fixture
def pool_and_layout():
    spec = load_spec(MODEL_DIR)
    name = sorted(p.name for p in DEMO_ADAPTERS.iterdir())[0]
    layout = layout_from_peft_dir(DEMO_ADAPTERS / name, spec, torch.float32)
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
    group = next(g for g, offs in layout.offsets.items() if (offs >= 0).any())
    assert (pool.tables.a_off_host[group][..., slot] >= 0).any()
    assert pool.tables.ranks_host[slot] == layout.rank


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


def test_every_matrix_starts_at_an_aligned_offset_whatever_the_shapes():
    """The SGMV kernels take every pool offset as a multiple of tables.align (so that they may
    load adapter weights in 16-byte vectors): the layout pads each A and Bt to OFFSET_ALIGN
    elements even where r x K is odd, and the matrices read back at their offsets unchanged."""
    spec = dataclasses.replace(load_spec(MODEL_DIR), hidden_size=36, num_heads=3, head_dim=12,
                               num_kv_heads=1, intermediate_size=20)
    r, gen = 3, torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(spec.num_layers):
        for mod in ("q_proj", "k_proj", "o_proj", "down_proj"):
            k, n = spec.in_out(mod)
            part = "mlp" if mod == "down_proj" else "self_attn"
            pre = f"base_model.model.model.layers.{layer}.{part}.{mod}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(r, k, generator=gen)
            tensors[f"{pre}.lora_B.weight"] = torch.randn(n, r, generator=gen)
    layout = build_layout(tensors, {"r": r, "lora_alpha": 6}, spec, torch.float32)
    pool = DevicePool(spec, torch.device("cpu"), torch.float32, 1 << 20, 2)
    assert pool.tables.align == OFFSET_ALIGN
    slot = pool.place("odd", layout)
    t = pool.tables
    for name, w in tensors.items():
        layer, mod, ab = int(name.split(".")[4]), name.split(".")[6], name.split(".")[7]
        group, j = MODULE_GROUP[mod]
        table = t.a_off_host if ab == "lora_A" else t.b_off_host
        off = int(table[group][layer, j, slot])
        assert off % OFFSET_ALIGN == 0, (name, off)
        want = w if ab == "lora_A" else w.t()
        got = t.pool[off:off + want.numel()].view(want.shape)
        assert torch.equal(got, want), name


def test_a_layout_with_unaligned_offsets_is_refused(pool_and_layout):
    """A blob whose offsets break the alignment the kernels assume never reaches the tables."""
    pool, layout = pool_and_layout
    group = next(g for g, offs in layout.offsets.items() if (offs >= 0).any())
    offs = layout.offsets[group].copy()
    offs[offs >= 0] += 1
    bad = dataclasses.replace(layout, offsets=dict(layout.offsets, **{group: offs}))
    free = pool.free_bytes
    with pytest.raises(ValueError, match="multiples of"):
        pool.place("bad", bad)
    assert not pool.started.is_set()                  # refused before any copy
    assert pool.slot_of("bad") is None and pool.free_bytes == free
    assert all((tab == -1).all() for tab in pool.tables.a_off_host.values())


@pytest.mark.parametrize("kn", [False, True])
def test_column_blocks_hold_each_adapters_a_rows_in_either_weight_layout(kn):
    """Column LoRA (services.worker.lora_columns): the extended q/k/v weight keeps the base
    weight's values and memory layout (a CUDA model stores it column-major), the model's
    weight becomes a view of its first rows, and placing an adapter writes its q/k/v A rows
    into a free block (zeros past its rank and for untargeted slices); one block for two
    adapters: the second gets none, and takes the first's once that is removed."""
    from services.worker.lora_columns import RANK_TILE, LoraColumns
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
    first = pool.place(names[0], layout_from_peft_dir(DEMO_ADAPTERS / names[0], spec,
                                                      torch.float32))
    second = pool.place(names[1], layout_from_peft_dir(DEMO_ADAPTERS / names[1], spec,
                                                       torch.float32))
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
    assert (t.a_off_host["qkv"][:, :, first] < 0).any()      # some slice untargeted: zeros
    pool.remove(names[0])
    assert cols.col_host[first] == -1 and int(cols.col_slot[first]) == -1
    third = pool.place("again", layout_from_peft_dir(DEMO_ADAPTERS / names[1], spec,
                                                     torch.float32))
    assert cols.col_host[third] == 0 and int(cols.col_slot[third]) == 0


def test_column_blocks_default_on_cuda_only(monkeypatch):
    """LORAFLEET_LORA_COLUMNS unset: a CUDA model keeps CUDA_DEFAULT blocks, a CPU model none;
    set, it wins on both; a value that is not a count is an error."""
    from services.worker.lora_columns import CUDA_DEFAULT, column_slots
    monkeypatch.delenv("LORAFLEET_LORA_COLUMNS", raising=False)
    assert CUDA_DEFAULT > 0
    assert column_slots(torch.device("cuda")) == CUDA_DEFAULT
    assert column_slots(torch.device("cpu")) == 0
    monkeypatch.setenv("LORAFLEET_LORA_COLUMNS", "0")
    assert column_slots(torch.device("cuda")) == 0
    monkeypatch.setenv("LORAFLEET_LORA_COLUMNS", "5")
    assert column_slots(torch.device("cpu")) == 5
    monkeypatch.setenv("LORAFLEET_LORA_COLUMNS", "-1")
    with pytest.raises(ValueError, match="LORAFLEET_LORA_COLUMNS"):
        column_slots(torch.device("cuda"))
