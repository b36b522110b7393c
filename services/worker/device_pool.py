"""The adapter pool on the compute device: one flat buffer, rank-exact blobs, slot tables.

Mechanism only: which adapter to evict is decided by the adapter manager's policy. Placing an
adapter is one copy of its blob (async on a copy stream on CUDA) plus a table update.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from services.worker.adapter_layout import OFFSET_ALIGN, AdapterLayout
from services.worker.lora_columns import GROUP as COLUMN_GROUP, LoraColumns
from services.worker.model import LoraTables
from services.worker.model_spec import GROUP_BIT, GROUPS, ModelSpec
from services.worker.range_alloc import ALIGN as BLOB_ALIGN, RangeAllocator

assert BLOB_ALIGN % OFFSET_ALIGN == 0   # blob starts keep the layout's offsets aligned


class PoolFull(Exception):
    """No slot or no contiguous range: the caller evicts and tries again."""


class DevicePool:
    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                 capacity_bytes: int, max_slots: int, columns: LoraColumns | None = None,
                 norm_fold: dict[str, torch.Tensor] | None = None):
        """columns: the model's column LoRA (services.worker.lora_columns), whose blocks the
        pool assigns and frees with its slots; None: no column LoRA. norm_fold: group -> [L, K]
        norm weights the model folded into that group's GEMM (LlamaModel.norm_fold); the pool
        folds them into the group's LoRA A as it places an adapter, since the model feeds
        those LoRAs the residual, not the normed rows."""
        elem = torch.tensor([], dtype=dtype).element_size()
        self.device, self.dtype, self.elem = device, dtype, elem
        self.alloc = RangeAllocator(capacity_bytes // elem)
        self.max_slots = max_slots
        L = spec.num_layers
        def table():
            return {g: torch.full((L, len(m), max_slots), -1, dtype=torch.int64, device=device)
                    for g, m in GROUPS.items()}
        self.tables = LoraTables(
            pool=torch.zeros(self.alloc.capacity, dtype=dtype, device=device),
            a_off=table(), b_off=table(),
            ranks=torch.zeros(max_slots, dtype=torch.int32, device=device),
            scales=torch.zeros(max_slots, dtype=torch.float32, device=device), max_rank=1,
            align=OFFSET_ALIGN,
            slot_groups=np.zeros(max_slots, dtype=np.int64),
            a_off_host={g: np.full((L, len(m), max_slots), -1, dtype=np.int64)
                        for g, m in GROUPS.items()},
            b_off_host={g: np.full((L, len(m), max_slots), -1, dtype=np.int64)
                        for g, m in GROUPS.items()},
            ranks_host=np.zeros(max_slots, dtype=np.int64),
            scales_host=np.zeros(max_slots, dtype=np.float32))
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self._placed: dict[str, tuple[int, int, int, int]] = {}   # key -> slot, start, n, rank
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.columns = columns
        self.norm_fold = norm_fold
        if columns is not None:
            columns.bind(max_slots)

    @property
    def capacity_bytes(self) -> int:
        return self.alloc.capacity * self.elem

    @property
    def free_bytes(self) -> int:
        return self.alloc.free * self.elem

    def slot_of(self, key: str) -> int | None:
        placed = self._placed.get(key)
        return None if placed is None else placed[0]

    def fits(self, layout: AdapterLayout) -> bool:
        return bool(self._free_slots) and self.alloc.largest_hole >= self.alloc.rounded(
            layout.blob.numel())

    def place(self, key: str, layout: AdapterLayout) -> int:
        """Copy the blob in and fill its slot's table entries; returns the slot.

        The range and slot are reserved first; the key becomes visible (`slot_of`) only once
        its blob and tables are written, so a concurrent lookup never gets a half-placed slot
        (one did: a second request for an adapter whose first load was still copying ran with
        the slot's old contents)."""
        if any((offs[offs >= 0] % OFFSET_ALIGN).any() for offs in layout.offsets.values()):
            # the kernels take every offset as a multiple of tables.align: a wrong one would
            # read the wrong weights, silently
            raise ValueError(f"adapter {key}: layout offsets are not multiples of "
                             f"{OFFSET_ALIGN} elements")
        n = layout.blob.numel()
        with self._lock:
            start = self.alloc.alloc(n) if self._free_slots else None
            if start is None:
                raise PoolFull(key)
            slot = self._free_slots.pop()
        try:
            self._copy(start, layout, slot)
        except BaseException:
            with self._lock:
                self._clear_slot(slot)
                self.alloc.release(start, n)
                self._free_slots.append(slot)
            raise
        with self._lock:
            self._placed[key] = (slot, start, n, layout.rank)
            self.tables.max_rank = max(r for _, _, _, r in self._placed.values())
        return slot

    def _copy(self, start: int, layout: AdapterLayout, slot: int) -> None:
        t = self.tables
        dst = t.pool[start:start + layout.blob.numel()]
        if self._stream is None:
            dst.copy_(layout.blob)
            self._fold_norms(dst, layout)
            self._write_tables(t, start, layout, slot)
            return
        with torch.cuda.stream(self._stream):
            dst.copy_(layout.blob, non_blocking=True)
            self._fold_norms(dst, layout)
            self._write_tables(t, start, layout, slot)
        self._stream.synchronize()   # the copy thread waits; the compute stream never does

    def _fold_norms(self, dst: torch.Tensor, layout: AdapterLayout) -> None:
        """A [r, K] *= g (over K) for each A of a group whose norm the model folded: the
        model's LoRA on that group reads h, so (h * factor * g) @ A.T = factor * (h @ (A *
        g).T) needs A * g. One multiply an A matrix (a q/k/v + gate/up adapter of a 32-layer
        model: 160), on the copy stream, in the pool's dtype."""
        if self.norm_fold is None:
            return
        for group, norms in self.norm_fold.items():
            offs = layout.offsets.get(group)
            if offs is None:
                continue
            k = norms.shape[1]
            for layer, j in zip(*np.nonzero(offs[:, :, 0] >= 0)):
                a = int(offs[layer, j, 0])
                dst[a:a + layout.rank * k].view(layout.rank, k).mul_(norms[layer])

    def _write_tables(self, t: LoraTables, start: int, layout: AdapterLayout, slot: int) -> None:
        for g, offs in layout.offsets.items():
            o = torch.from_numpy(offs)
            o = torch.where(o >= 0, o + start, o)
            t.a_off[g][:, :, slot].copy_(o[..., 0], non_blocking=True)
            t.b_off[g][:, :, slot].copy_(o[..., 1], non_blocking=True)
            t.a_off_host[g][:, :, slot] = o[..., 0].numpy()
            t.b_off_host[g][:, :, slot] = o[..., 1].numpy()
        t.ranks[slot] = layout.rank
        t.scales[slot] = layout.scale
        t.ranks_host[slot] = layout.rank
        t.scales_host[slot] = layout.scale
        t.slot_groups[slot] = sum(GROUP_BIT[g] for g, offs in layout.offsets.items()
                                  if (offs >= 0).any())
        if self.columns is not None and COLUMN_GROUP in layout.offsets:
            self.columns.assign(slot, t.pool, t.a_off_host[COLUMN_GROUP], layout.rank)

    def remove(self, key: str) -> None:
        """Free the adapter's range and slot (the caller guarantees no row uses it)."""
        with self._lock:
            slot, start, n, _ = self._placed.pop(key)
            self._clear_slot(slot)
            self.alloc.release(start, n)
            self._free_slots.append(slot)
            self.tables.max_rank = max((r for _, _, _, r in self._placed.values()), default=1)

    def _clear_slot(self, slot: int) -> None:
        t = self.tables
        if self.columns is not None:
            self.columns.release(slot)
        for g in GROUPS:
            t.a_off[g][:, :, slot] = -1
            t.b_off[g][:, :, slot] = -1
            t.a_off_host[g][:, :, slot] = -1
            t.b_off_host[g][:, :, slot] = -1
        t.slot_groups[slot] = 0
