"""The adapter pool on the compute device: one flat buffer, rank-exact blobs, slot tables.

Mechanism only: which adapter to evict is decided by the adapter manager's policy. Placing a
staged adapter (services.worker.adapter_layout) is a handful of device operations, whatever its
tensor count, on a copy stream of its own: its safetensors bytes copied as they are, one
kernels.adapter_scatter launch that lays every tensor out (B transposed, norms folded into A,
column LoRA blocks written), and one write of each slot table. The slot tables live in two flat
buffers (int64 offsets of every group, int32 ranks / column blocks / scales), with the slot the
innermost dimension, so a slot's entries are every n_slots-th element: one index_copy each.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time

import numpy as np
import torch

from kernels import adapter_scatter as sc
from services.worker.adapter_layout import OFFSET_ALIGN, SRC_ALIGN, StagedAdapter
from services.worker.lora_columns import LoraColumns
from services.worker.lora_tables import LoraTables
from services.worker.model_spec import GROUPS, ModelSpec
from services.worker.range_alloc import ALIGN as BLOB_ALIGN, RangeAllocator

assert BLOB_ALIGN % OFFSET_ALIGN == 0   # blob starts keep the layout's offsets aligned
GROUP_BITS = np.array([1 << i for i in range(len(GROUPS))], dtype=np.int64)


class PoolFull(Exception):
    """No slot or no contiguous range: the caller evicts and tries again."""


class DevicePool:
    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                 capacity_bytes: int, max_slots: int, columns: LoraColumns | None = None,
                 norm_fold: dict[str, torch.Tensor] | None = None):
        """columns: the column LoRA blocks (services.worker.lora_columns; the factory gives the
        same object to the model), which the pool assigns, writes and frees with its slots;
        None: no column LoRA. norm_fold: group -> [L, K] norm weights folded into that group's
        GEMM (services.worker.weight_transforms.apply returns them); the pool
        folds them into the group's LoRA A as it places an adapter, since the model feeds
        those LoRAs the residual, not the normed rows."""
        elem = torch.tensor([], dtype=dtype).element_size()
        self.device, self.dtype, self.elem = device, dtype, elem
        self.alloc = RangeAllocator(capacity_bytes // elem)
        self.max_slots = max_slots
        self.columns = columns
        self.tables = self._tables(spec, max_slots)
        self._fold, self._fold_base = _fold_table(norm_fold, spec.num_layers)
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self._placed: dict[str, tuple[int, int, int, int]] = {}   # key -> slot, start, n, rank
        self._lock = threading.Lock()           # slots, ranges, _placed
        self._copy = _CopyPath(device, self)    # one placement's device work at a time
        if columns is not None:
            columns.bind(max_slots, self._meta32[1])

    def _tables(self, spec: ModelSpec, slots: int) -> LoraTables:
        dev, L = self.device, spec.num_layers
        sizes = [L * len(m) * slots for m in GROUPS.values()]
        self._off64 = torch.full((2 * sum(sizes),), -1, dtype=torch.int64, device=dev)
        # ranks, column blocks, scales (as int32 bits)
        self._meta32 = torch.zeros(3, slots, dtype=torch.int32, device=dev)
        self._meta32[1] = -1
        views, at = [], 0
        for (g, mods), n in zip(GROUPS.items(), sizes):
            for _ in "ab":
                views.append(self._off64[at:at + n].view(L, len(mods), slots))
                at += n
        # slot s's entries in _off64: s, s + slots, s + 2 * slots, ... (slot is innermost)
        self._slot_pos = np.arange(at // slots, dtype=np.int64) * slots
        host = {g: np.full((L, len(m), slots), -1, dtype=np.int64) for g, m in GROUPS.items()}
        return LoraTables(
            pool=torch.zeros(self.alloc.capacity, dtype=self.dtype, device=dev),
            a_off=dict(zip(GROUPS, views[0::2])), b_off=dict(zip(GROUPS, views[1::2])),
            ranks=self._meta32[0], scales=self._meta32[2].view(torch.float32), max_rank=1,
            align=OFFSET_ALIGN, slot_groups=np.zeros(slots, dtype=np.int64),
            a_off_host=host, b_off_host={g: h.copy() for g, h in host.items()},
            ranks_host=np.zeros(slots, dtype=np.int64),
            scales_host=np.zeros(slots, dtype=np.float32))

    @property
    def capacity_bytes(self) -> int:
        return self.alloc.capacity * self.elem

    @property
    def free_bytes(self) -> int:
        return self.alloc.free * self.elem

    def slot_of(self, key: str) -> int | None:
        placed = self._placed.get(key)
        return None if placed is None else placed[0]

    def place(self, key: str, staged: StagedAdapter, columns: bool = True) -> int:
        """Lay the adapter out in a free range and slot; returns the slot (PoolFull if none).
        columns=False keeps it out of the LoRA columns (the warm-up's adapter that must take
        the split q/k/v path)."""
        return self.fill(key, staged, self.reserve(key, staged), columns)

    def reserve(self, key: str, staged: StagedAdapter) -> tuple[int, int]:
        """A free slot and range for the adapter, (slot, start); PoolFull if there is none.
        Fill it (`fill`) or give it back (`unreserve`)."""
        with self._lock:
            start = self.alloc.alloc(staged.plan.numel) if self._free_slots else None
            if start is None:
                raise PoolFull(key)
            return self._free_slots.pop(), start

    def unreserve(self, staged: StagedAdapter, reserved: tuple[int, int]) -> None:
        with self._lock:
            self._release(reserved[0], reserved[1], staged.plan.numel)

    def fill(self, key: str, staged: StagedAdapter, reserved: tuple[int, int],
             columns: bool = True, timing: dict | None = None) -> int:
        """Write the adapter into its reserved slot and range; returns the slot. timing: gets
        "copy_wait" and "device" seconds (see _CopyPath.run).

        The key becomes visible (`slot_of`) only once its weights and tables are written, so a
        concurrent lookup never gets a half-placed slot (one did: a second request for an
        adapter whose first load was still copying ran with the slot's old contents). A
        failure gives the reservation back."""
        plan, (slot, start) = staged.plan, reserved
        block = -1
        try:
            if self.columns is not None and columns:
                block = self.columns.assign(slot, plan.rank, bool((plan.qkv_a >= 0).any()))
            self._write(staged, self._segments(plan, start, block),
                        self._slot_values(plan, start, slot, block), timing)
        except BaseException:
            self.unreserve(staged, reserved)
            raise
        self._host_tables(plan, start, slot)
        with self._lock:
            self._placed[key] = (slot, start, plan.numel, plan.rank)
            self.tables.max_rank = max(r for _, _, _, r in self._placed.values())
        return slot

    def _write(self, staged: StagedAdapter, segs: np.ndarray, values: np.ndarray,
               timing: dict | None = None) -> None:
        """The device work of one placement (its weights, then its slot's table entries)."""
        self._copy.run(staged, segs, values, timing)

    def _segments(self, plan, start: int, block: int) -> np.ndarray:
        """The plan's segments for this placement: destinations in the pool (and the column
        block), sources in elements of the staged copy, the norm-fold rows of folded A."""
        segs = plan.segs.copy()
        segs[:, sc.DST_OFF] += start
        pad = -plan.data_start % SRC_ALIGN
        segs[:, sc.SRC_OFF] = (segs[:, sc.SRC_OFF] + pad) // plan.src_dtype.itemsize
        group = plan.seg_group
        base = np.where(group >= 0, self._fold_base[np.maximum(group, 0)], -1)
        segs[:, sc.FOLD] = np.where(base >= 0, base + plan.seg_layer, -1)
        if block < 0:
            return segs
        return np.concatenate([segs, self.columns.segments(block, segs, plan.qkv_a,
                                                           plan.rank)])

    def _slot_values(self, plan, start: int, slot: int, block: int) -> np.ndarray:
        """int64 [2, P + 3]: the slot's positions in the flat tables and their new values: every
        group's A and B offsets (absent: -1), then rank, column block and scale (int32 bits)."""
        offs = [np.where(o >= 0, o + start, -1) for g in GROUPS
                for o in _split(plan.offsets[g])]
        scale_bits = int(np.array(plan.scale, dtype=np.float32).view(np.int32))
        pos = np.concatenate([self._slot_pos + slot, np.arange(3) * self.max_slots + slot])
        vals = np.concatenate([*(o.ravel() for o in offs), [plan.rank, block, scale_bits]])
        return np.stack([pos, vals])

    def _host_tables(self, plan, start: int, slot: int) -> None:
        t = self.tables
        for g, offs in plan.offsets.items():
            t.a_off_host[g][:, :, slot] = np.where(offs[..., 0] >= 0, offs[..., 0] + start, -1)
            t.b_off_host[g][:, :, slot] = np.where(offs[..., 1] >= 0, offs[..., 1] + start, -1)
        t.ranks_host[slot] = plan.rank
        t.scales_host[slot] = plan.scale
        t.slot_groups[slot] = plan.groups_mask

    def remove(self, key: str) -> None:
        """Free the adapter's range and slot (the caller guarantees no row uses it). Host
        bookkeeping only: the device tables keep the slot's old entries, which no row reads,
        until the next placement in the slot rewrites every one of them."""
        with self._lock:
            slot, start, n, _ = self._placed.pop(key)
            self._release(slot, start, n)
            self.tables.max_rank = max((r for _, _, _, r in self._placed.values()), default=1)

    def _release(self, slot: int, start: int, n: int) -> None:
        t = self.tables
        if self.columns is not None:
            self.columns.release(slot)
        for g in GROUPS:
            t.a_off_host[g][:, :, slot] = -1
            t.b_off_host[g][:, :, slot] = -1
        t.slot_groups[slot] = 0
        self.alloc.release(start, n)
        self._free_slots.append(slot)

    def warm_up(self) -> None:
        """Compile the scatter kernel for every source dtype an adapter may have (a few
        microseconds of work each), so no placement while serving compiles it."""
        if self.device.type == "cuda":
            self._copy.warm_up(self._fold is not None)


def _split(offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return offsets[..., 0], offsets[..., 1]


def _fold_table(norm_fold, layers: int) -> tuple[torch.Tensor | None, np.ndarray]:
    """The norm weights of the folded groups stacked [n_folded * L, K], and each group's first
    row in it (-1: not folded)."""
    base = np.full(len(GROUPS), -1, dtype=np.int64)
    if not norm_fold:
        return None, base
    rows = []
    for i, g in enumerate(GROUPS):
        if g in norm_fold:
            base[i] = len(rows) * layers
            rows.append(norm_fold[g])
    if len({r.shape[1] for r in rows}) != 1:
        raise ValueError("folded norms of different widths")
    return torch.cat(rows).contiguous(), base


# While a placement runs: every torch call gives the GIL up, and getting it back waits for
# the engine thread to drop it, which it does when the waiter has waited the switch interval;
# a placement makes ~15 such calls (at 0.5 ms each: a 0.6 ms copy took 4-5 ms under load).
PLACEMENT_SWITCH_S = 5e-5


@contextlib.contextmanager
def _gil_first():
    """The interpreter's switch interval at PLACEMENT_SWITCH_S for the duration (one
    placement at a time holds _CopyPath.lock, so the saved value is the process's own)."""
    saved = sys.getswitchinterval()
    sys.setswitchinterval(min(saved, PLACEMENT_SWITCH_S))
    try:
        yield
    finally:
        sys.setswitchinterval(saved)


class _CopyPath:
    """The device side of a placement, one at a time: a staging copy of the adapter's bytes
    (grown to the largest adapter seen), one pinned scratch buffer for the segments and the
    slot values, their device twin, and on CUDA a copy stream and an event."""

    def __init__(self, device: torch.device, pool: DevicePool):
        self.device, self.pool = device, pool
        self.cuda = device.type == "cuda"
        # high priority: under decode load the compute stream's kernels (launched early under
        # PDL) hold every SM, and a default-priority layout kernel waited behind whole steps
        self.stream = torch.cuda.Stream(device, priority=-1) if self.cuda else None
        self.done = torch.cuda.Event() if self.cuda else None
        self.lock = threading.Lock()
        self.staging = torch.empty(0, dtype=torch.uint8, device=device)
        self.host = torch.empty(0, dtype=torch.int64, pin_memory=self.cuda)
        self.dev = torch.empty(0, dtype=torch.int64, device=device)
        self.dst_ptrs: torch.Tensor | None = None

    def _dsts(self) -> list[torch.Tensor]:
        cols = self.pool.columns
        return [self.pool.tables.pool] + (cols.flat if cols is not None else [])

    def _grow(self, staging: int, scratch: int) -> None:
        if self.staging.numel() < staging:
            self.staging = torch.empty(staging, dtype=torch.uint8, device=self.device)
        if self.host.numel() < scratch:
            self.host = torch.empty(2 * scratch, dtype=torch.int64, pin_memory=self.cuda)
            self.dev = torch.empty(2 * scratch, dtype=torch.int64, device=self.device)
        if self.dst_ptrs is None:
            self.dst_ptrs = torch.tensor([d.data_ptr() for d in self._dsts()],
                                         dtype=torch.int64).to(self.device)

    def run(self, staged: StagedAdapter, segs: np.ndarray, values: np.ndarray,
            timing: dict | None = None) -> None:
        """One placement's copies and kernels, waited for. timing (when given) gets the seconds
        spent waiting for the lock ("copy_wait": another placement's turn) and, after the
        launches, for the device ("device")."""
        plan, pool = staged.plan, self.pool
        pad = -plan.data_start % SRC_ALIGN
        n_seg, n_val = segs.size, values.shape[1]
        asked = time.monotonic()
        with self.lock, _gil_first():
            if timing is not None:
                timing["copy_wait"] = time.monotonic() - asked
            with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
                self._grow(pad + staged.nbytes, n_seg + 2 * n_val)
                host = self.host.numpy()
                host[:n_seg] = segs.ravel()
                host[n_seg:n_seg + 2 * n_val] = values.ravel()
                self.staging[pad:pad + staged.nbytes].copy_(staged.blob, non_blocking=True)
                dev = self.dev[:n_seg + 2 * n_val]
                dev.copy_(self.host[:n_seg + 2 * n_val], non_blocking=True)
                itemsize = plan.src_dtype.itemsize
                src = self.staging[:self.staging.numel() // itemsize * itemsize].view(
                    plan.src_dtype)
                sc.adapter_scatter(src, self._dsts(), dev[:n_seg].view(-1, sc.NFIELDS),
                                   pool._fold, max_elems=plan.max_elems, dst_ptrs=self.dst_ptrs)
                upd = dev[n_seg:].view(2, n_val)
                p = n_val - 3
                pool._off64.index_copy_(0, upd[0, :p], upd[1, :p])
                pool._meta32.view(-1).index_copy_(0, upd[0, p:], upd[1, p:].to(torch.int32))
                if self.cuda:
                    self.done.record(self.stream)
            waited = 0.0                    # a CPU pool copies inline: nothing to wait for
            if self.cuda:
                queued = time.monotonic()
                self.done.synchronize()     # this thread waits; the compute stream never does
                waited = time.monotonic() - queued
            if timing is not None:
                timing["device"] = waited

    def warm_up(self, fold: bool) -> None:
        """One tiny launch per source dtype (see DevicePool.warm_up)."""
        pool = self.pool
        with self.lock, torch.cuda.stream(self.stream):
            self._grow(64, sc.NFIELDS)
            # an empty segment (0 rows): it compiles the kernel and writes nothing
            segs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 0 if fold else -1, sc.ZERO]],
                                dtype=torch.int64, device=self.device)
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                sc.adapter_scatter(self.staging[:64].view(dtype), self._dsts(), segs,
                                   pool._fold, max_elems=1, dst_ptrs=self.dst_ptrs)
            self.stream.synchronize()

