"""The device pool (services.worker.device_pool) on the tiny model, with the demo adapters: an
adapter's slot becomes visible only once its blob and tables are written, and a failed copy
gives its range and slot back. The copy here is the pool's own, held at an event so that the
window between reserving a slot and finishing the copy can be looked into."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from services.worker.adapter_layout import layout_from_peft_dir
from services.worker.device_pool import DevicePool
from services.worker.model_spec import load_spec
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
