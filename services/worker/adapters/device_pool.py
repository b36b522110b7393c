"""The adapter pool on the compute device: one flat buffer, rank-exact blobs, slot tables.

Mechanism only: which adapter to evict is decided by the adapter manager's policy. Placing a
staged adapter (services.worker.adapters.layout) is a handful of device operations, whatever its
tensor count, on a copy stream of its own: its safetensors bytes copied as they are, one
kernels.adapter_scatter launch that lays every tensor out (B transposed, norms folded into A,
column LoRA blocks written) and writes the slot's table entries. The slot tables live in two
flat buffers (int64 offsets of every group, int32 ranks / column blocks / scales), with the slot
the innermost dimension, so a slot's entries are every n_slots-th element.
"""
from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import torch

from kernels import adapter_scatter as sc
from services.worker.adapters import gil
from services.worker.adapters.layout import OFFSET_ALIGN, SRC_ALIGN, StagedAdapter
from services.worker.adapters.range_alloc import ALIGN as BLOB_ALIGN, RangeAllocator
from services.worker.model.lora_columns import LoraColumns
from services.worker.model.lora_tables import LoraTables
from services.worker.model.spec import GROUPS, ModelSpec

assert BLOB_ALIGN % OFFSET_ALIGN == 0   # blob starts keep the layout's offsets aligned
GROUP_BITS = np.array([1 << i for i in range(len(GROUPS))], dtype=np.int64)


class PoolFull(Exception):
    """No slot or no contiguous range: the caller evicts and tries again."""


class DevicePool:
    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                 capacity_bytes: int, max_slots: int, columns: LoraColumns | None = None,
                 norm_fold: dict[str, torch.Tensor] | None = None):
        """columns: the column LoRA blocks (services.worker.model.lora_columns; the factory gives
        the same object to the model), which the pool assigns, writes and frees with its slots;
        None: no column LoRA. norm_fold: group -> [L, K] norm weights folded into that group's
        GEMM (services.worker.model.transforms.apply returns them); the pool
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
        self._meta_pos = np.arange(3, dtype=np.int64) * slots     # rank, column block, scale
        host = {g: np.full((L, len(m), slots), -1, dtype=np.int64) for g, m in GROUPS.items()}
        b_host = {g: h.copy() for g, h in host.items()}
        self._host_order = [h for g in GROUPS for h in (host[g], b_host[g])]
        return LoraTables(
            pool=torch.zeros(self.alloc.capacity, dtype=self.dtype, device=dev),
            a_off=dict(zip(GROUPS, views[0::2])), b_off=dict(zip(GROUPS, views[1::2])),
            ranks=self._meta32[0], scales=self._meta32[2].view(torch.float32), max_rank=1,
            align=OFFSET_ALIGN, slot_groups=np.zeros(slots, dtype=np.int64),
            a_off_host=host, b_off_host=b_host,
            ranks_host=np.zeros(slots, dtype=np.int64),
            scales_host=np.zeros(slots, dtype=np.float32))

    @property
    def capacity_bytes(self) -> int:
        return self.alloc.capacity * self.elem

    @property
    def free_bytes(self) -> int:
        return self.alloc.free * self.elem

    def has_free_slot(self) -> bool:
        return bool(self._free_slots)

    def slot_of(self, key: str) -> int | None:
        placed = self._placed.get(key)
        return None if placed is None else placed[0]

    def place(self, key: str, staged: StagedAdapter, columns: bool = True) -> int:
        """Lay the adapter out in a free range and slot; returns the slot (PoolFull if none).
        columns=False keeps it out of the LoRA columns (the warm-up's adapter that must take
        the split q/k/v path)."""
        return self.fill(key, staged, self.reserve(key, staged), columns)

    def span_of(self, key: str) -> tuple[int, int] | None:
        """(start, elements) of the adapter's range, or None if it is not placed."""
        placed = self._placed.get(key)
        return None if placed is None else (placed[1], self.alloc.rounded(placed[2]))

    def ranges(self) -> list[tuple[int, int, str]]:
        """(start, elements, key) of every placed adapter."""
        with self._lock:
            return [(s, self.alloc.rounded(n), k) for k, (_, s, n, _) in self._placed.items()]

    def reserve(self, key: str, staged: StagedAdapter,
                avoid: tuple[int, int] | None = None) -> tuple[int, int]:
        """A free slot and range for the adapter, (slot, start), the range outside avoid;
        PoolFull if there is none. Fill it (`fill`) or give it back (`unreserve`)."""
        with self._lock:
            start = self.alloc.alloc(staged.plan.numel, avoid) if self._free_slots else None
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
                block = self.columns.assign(slot, plan.rank, bool((plan.qkv_a >= 0).any()),
                                            bool((plan.o_b >= 0).any()))
            offs = np.where(plan.flat_offsets >= 0, plan.flat_offsets + start, -1)
            self._write(staged, self._segments(plan, start, block),
                        self._slot_values(plan, offs, slot, block), timing)
        except BaseException:
            self.unreserve(staged, reserved)
            raise
        self._host_tables(plan, offs, slot)
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
                                                           plan.rank, plan.o_b)])

    def _slot_values(self, plan, offs: np.ndarray, slot: int, block: int) -> np.ndarray:
        """int64 [2, P + 3]: the slot's positions in the flat tables and their new values: every
        group's A and B offsets (offs: LayoutPlan.flat_offsets placed, absent -1), then rank,
        column block and scale (int32 bits)."""
        scale_bits = int(np.array(plan.scale, dtype=np.float32).view(np.int32))
        pos = np.concatenate([self._slot_pos, self._meta_pos]) + slot
        return np.stack([pos, np.concatenate([offs, [plan.rank, block, scale_bits]])])

    def _host_tables(self, plan, offs: np.ndarray, slot: int) -> None:
        t, at = self.tables, 0
        for host in self._host_order:       # the order of offs: each group's A, then its B
            n = host.shape[0] * host.shape[1]
            host[:, :, slot] = offs[at:at + n].reshape(host.shape[:2])
            at += n
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


class _CopyPath:
    """The device side of a placement, one at a time: a staging copy of the adapter's bytes
    (grown to the largest adapter seen), one pinned scratch buffer for the segments and the
    table writes, their device twin, and on CUDA a copy stream.

    A placement is four device calls: the bytes' copy, the scratch's copy, one scatter launch
    that also writes the slot's table entries, and the wait for the copy stream. The views they
    take are kept from one placement to the next (each torch call gives the GIL up, and under
    load getting it back waits behind the engine thread)."""

    def __init__(self, device: torch.device, pool: DevicePool):
        self.device, self.pool = device, pool
        self.cuda = device.type == "cuda"
        self.triton = self.cuda           # the Triton launch (a CPU test sets it, interpreted)
        # high priority: under decode load the compute stream's kernels (launched early under
        # PDL) hold every SM, and a default-priority layout kernel waited behind whole steps
        self.stream = torch.cuda.Stream(device, priority=-1) if self.cuda else None
        self.lock = threading.Lock()
        self.staging = torch.empty(0, dtype=torch.uint8, device=device)
        self.src: dict[torch.dtype, torch.Tensor] = {}       # staging as each source dtype
        self.seg_cap = self.write_cap = 0
        self.host = self.dev = self.host_np = self.writes = None
        self.dst_ptrs: torch.Tensor | None = None
        # the largest column-block segment (a block's zeros can exceed the plan's matrices)
        self.col_elems = pool.columns.max_elems if pool.columns is not None else 0

    def _dsts(self) -> list[torch.Tensor]:
        cols = self.pool.columns
        return [self.pool.tables.pool] + (cols.flat if cols is not None else [])

    def _grow(self, staging: int, n_seg: int, n_val: int) -> None:
        if self.staging.numel() < staging:
            self.staging = torch.empty(staging, dtype=torch.uint8, device=self.device)
            self.src = {}
        if n_seg > self.seg_cap or n_val > self.write_cap:
            # segment rows, then the writes' positions and values (at a multiple of 80 bytes:
            # 16-byte aligned, as the kernel's compile assumed)
            self.seg_cap = max(2 * n_seg, self.seg_cap)
            self.write_cap = max(2 * n_val, self.write_cap)
            n = self.seg_cap * sc.NFIELDS + 2 * self.write_cap
            self.host = torch.empty(n, dtype=torch.int64, pin_memory=self.cuda)
            self.dev = torch.empty(n, dtype=torch.int64, device=self.device)
            self.host_np = self.host.numpy()
            self.writes = self.dev[self.seg_cap * sc.NFIELDS:].view(2, self.write_cap)
        if self.dst_ptrs is None:
            self.dst_ptrs = torch.tensor([d.data_ptr() for d in self._dsts()],
                                         dtype=torch.int64).to(self.device)

    def _src(self, dtype: torch.dtype) -> torch.Tensor:
        view = self.src.get(dtype)
        if view is None:
            n = self.staging.numel() // dtype.itemsize * dtype.itemsize
            view = self.src[dtype] = self.staging[:n].view(dtype)
        return view

    def _stage_scratch(self, segs: np.ndarray, values: np.ndarray) -> None:
        """The segments and the table writes into the pinned scratch (host work only)."""
        host, w0 = self.host_np, self.seg_cap * sc.NFIELDS
        host[:segs.size] = segs.ravel()
        n_val = values.shape[1]
        host[w0:w0 + n_val] = values[0]
        host[w0 + self.write_cap:w0 + self.write_cap + n_val] = values[1]

    def run(self, staged: StagedAdapter, segs: np.ndarray, values: np.ndarray,
            timing: dict | None = None) -> None:
        """One placement's copies and kernel, waited for. values: the slot's table writes
        (DevicePool._slot_values: the int64 offsets, then 3 int32 entries). timing (when
        given) gets the seconds spent waiting for the lock ("copy_wait": another placement's
        turn), launching ("launch") and, after the launches, waiting for the device
        ("device")."""
        plan, pool = staged.plan, self.pool
        pad = -plan.data_start % SRC_ALIGN
        n_seg, n_val = segs.shape[0], values.shape[1]
        asked = time.monotonic()
        with self.lock, gil.first():
            started = time.monotonic()
            with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
                self._grow(pad + staged.nbytes, n_seg, n_val)
                self._stage_scratch(segs, values)
                self.staging[pad:pad + staged.nbytes].copy_(staged.blob, non_blocking=True)
                self.dev.copy_(self.host, non_blocking=True)
                if self.triton:
                    from kernels import adapter_scatter_triton as tri
                    tri.launch(self._src(plan.src_dtype), pool.dtype, self.dst_ptrs, self.dev,
                               n_seg, pool._fold, max(plan.max_elems, self.col_elems),
                               (self.writes, n_val, n_val - 3, pool._off64, pool._meta32))
                else:
                    sc.adapter_scatter_ref(
                        self._src(plan.src_dtype), self._dsts(),
                        self.dev[:n_seg * sc.NFIELDS].view(n_seg, sc.NFIELDS), pool._fold,
                        tables=(self.writes[:, :n_val], n_val - 3, pool._off64, pool._meta32))
            launched = waited = time.monotonic()
            if self.cuda:                   # a CPU pool copies inline: nothing to wait for
                # only this placement's work is on the copy stream (one at a time, the lock):
                # this thread waits for it; the compute stream never does
                self.stream.synchronize()
                waited = time.monotonic()
            if timing is not None:
                timing.update(copy_wait=started - asked, launch=launched - started,
                              device=waited - launched)

    def warm_up(self, fold: bool) -> None:
        """One tiny launch per source dtype (see DevicePool.warm_up)."""
        pool = self.pool
        with self.lock, torch.cuda.stream(self.stream):
            self._grow(64, 1, 3)
            # an empty segment (0 rows) and no table writes: it compiles the kernel as a
            # placement launches it and writes nothing
            segs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 0 if fold else -1, sc.ZERO]],
                                dtype=torch.int64, device=self.device)
            from kernels import adapter_scatter_triton as tri
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                tri.launch(self.staging[:64].view(dtype), pool.dtype, self.dst_ptrs, segs, 1,
                           pool._fold, 1, (self.writes, 0, 0, pool._off64, pool._meta32))
            self.stream.synchronize()

