"""A staged adapter and its layout plan: where each of its tensors goes in the device pool.

The worker keeps an adapter as the store sends it: the bytes of its adapter_model.safetensors (in
the worker's host tier) and a LayoutPlan made from the file's own header, checked against the served
model. Placing it (services.worker.adapters.device_pool) copies those bytes to the device as they
are, in one copy, and kernels.adapter_scatter moves every tensor to its place in one launch,
following the plan's segments.

Pool layout (kernels.sgmv_ref documents it): per (layer, group, slice) the adapter targets, A
[r, K] then Bt [r, N] (an adapter of a fused projection, Phi-3's qkv_proj or gate_up_proj, is
sliced to the engine's layout here: its A copied to each slice, its B cut into the slices' rows);
each matrix starts at a multiple of OFFSET_ALIGN elements, so that with
the blob's own start aligned the SGMV kernels may load A and Bt in 16-byte vectors whatever r,
K and N are (the gaps are never read: the kernels mask by rank and width). Offsets are relative
to the adapter's start in the pool; the pool adds its position when it places it.
"""
from __future__ import annotations

import functools
import json
import math
import pathlib
import re
from dataclasses import dataclass

import numpy as np
import torch

from kernels import adapter_scatter as sc
from services.common import safetensors_parse as st
from services.common.errors import InvalidArgument
from services.common.text_model import IMAGE, PEFT_PREFIX, split_name
from services.worker.model.spec import FUSED, GROUPS, MODULE_GROUP, ModelSpec

OFFSET_ALIGN = 8     # elements: 16 bytes in bf16 / fp16
SRC_ALIGN = 8        # the device copy of a blob starts so that its data section is 8-aligned
GROUP_INDEX = {g: i for i, g in enumerate(GROUPS)}
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class LayoutPlan:
    """Where an adapter's tensors go. segs: kernels.adapter_scatter rows with DST 0 (the pool),
    DST_OFF relative to the adapter's start, SRC_OFF in bytes from the file's start (the pool
    turns it into elements of src_dtype) and FOLD -1; seg_group / seg_layer: the projection
    group (GROUP_INDEX) and layer of each A segment, -1 for B (the pool folds norms into A);
    qkv_a [L, n_slices]: the segment of each q/k/v A, -1 where absent (column LoRA copies it);
    o_b [L]: the segment of each o B, -1 where absent (row LoRA copies it)."""
    rank: int
    scale: float
    numel: int                          # pool elements the adapter takes (alignment included)
    offsets: dict[str, np.ndarray]      # group -> int64 [L, n_slices, 2] (a, b), -1 = absent
    src_dtype: torch.dtype
    segs: np.ndarray                    # int64 [S, sc.NFIELDS]
    seg_group: np.ndarray               # int64 [S]
    seg_layer: np.ndarray               # int64 [S]
    qkv_a: np.ndarray                   # int64 [L, len(GROUPS["qkv"])]
    o_b: np.ndarray                     # int64 [L]
    max_elems: int                      # max rows * cols over segs
    data_start: int                     # the file's data section starts at this byte

    @functools.cached_property
    def flat_offsets(self) -> np.ndarray:
        """Every group's A offsets then its B offsets ([L, n_slices] each, raveled), in GROUPS
        order: the order of a slot's entries in the pool's tables
        (services.worker.adapters.device_pool)."""
        flat = np.concatenate([self.offsets[g][..., k].ravel() for g in GROUPS for k in (0, 1)])
        flat.setflags(write=False)
        return flat

    @property
    def groups_mask(self) -> int:
        """Bit i set when the adapter targets group i (GROUP_INDEX order)."""
        return sum(1 << GROUP_INDEX[g] for g, o in self.offsets.items() if (o >= 0).any())


@dataclass(frozen=True)
class StagedAdapter:
    """An adapter ready to place: its safetensors bytes in host memory and their plan."""
    blob: torch.Tensor                  # uint8 [nbytes] (pinned host tier memory on CUDA)
    config: dict
    plan: LayoutPlan

    @property
    def nbytes(self) -> int:
        return self.blob.numel()


def lora_scale(config: dict) -> float:
    r = int(config["r"])
    alpha = float(config.get("lora_alpha", r))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


class PlanCache:
    """Plans by (header bytes, size, rank, scale): adapters of one shape (the same tensor names,
    dtypes and shapes give byte-identical headers) share one plan, so a fleet of them is
    planned once. Bounded; thread-safe enough (a race plans twice)."""

    def __init__(self, spec: ModelSpec, capacity: int = 64):
        self.spec, self.capacity = spec, capacity
        self._plans: dict[tuple, LayoutPlan] = {}

    def plan(self, head, size: int, config: dict) -> LayoutPlan:
        n = st.header_length(head, size)
        key = (bytes(head[:8 + n]), size, int(config["r"]), lora_scale(config))
        found = self._plans.get(key)
        if found is None:
            found = plan_layout(*key, self.spec)
            if len(self._plans) >= self.capacity:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = found
        return found


def plan_layout(head: bytes, size: int, r: int, scale: float, spec: ModelSpec) -> LayoutPlan:
    """The plan for a safetensors file of `size` bytes whose first 8 + N bytes are `head`:
    every tensor a LoRA A/B of a supported projection, pairs complete, shapes matching the
    model (INVALID_ARGUMENT naming the tensor otherwise). On a multimodal model the vision
    tower's and the projector's LoRA tensors are left where they are, unplaced: they change
    image inputs only, which the worker does not take."""
    tensors = st.parse_header(head, size)
    if spec.multimodal:
        tensors = [t for t in tensors if split_name(t.name, PEFT_PREFIX)[0] != IMAGE]
    pairs = _pairs(tensors, spec)
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise InvalidArgument(f"adapter tensors have several dtypes ({sorted(dtypes)}); one is "
                              "supported")
    src_dtype = DTYPES[dtypes.pop()]
    data_start = 8 + st.header_length(head, size)
    builder = _Builder(spec, r, src_dtype.itemsize, data_start)
    for (layer, module), ab in sorted(pairs.items()):
        builder.add(layer, module, ab)
    return builder.plan(r, scale, src_dtype, data_start)


def _pairs(tensors: list[st.RawTensor], spec: ModelSpec
           ) -> dict[tuple[int, str], dict[str, st.RawTensor]]:
    pairs: dict[tuple[int, str], dict[str, st.RawTensor]] = {}
    for t in tensors:
        m = KEY.search(t.name)
        if m is None:
            raise InvalidArgument(f"tensor {t.name}: not a LoRA A/B weight of a known projection")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in spec.lora_targets:
            raise InvalidArgument(f"tensor {t.name}: module {module} is not a supported target "
                                  f"of {spec.architecture} ({', '.join(spec.lora_targets)})")
        pairs.setdefault((layer, module), {})[ab] = t
    return pairs


class _Builder:
    """Accumulates the pool layout (A then Bt per pair, aligned) and the scatter segments."""

    def __init__(self, spec: ModelSpec, r: int, itemsize: int, data_start: int):
        self.spec, self.r, self.itemsize, self.data_start = spec, r, itemsize, data_start
        self.offsets = {g: np.full((spec.num_layers, len(m), 2), -1, dtype=np.int64)
                        for g, m in GROUPS.items()}
        self.qkv_a = np.full((spec.num_layers, len(GROUPS["qkv"])), -1, dtype=np.int64)
        self.o_b = np.full(spec.num_layers, -1, dtype=np.int64)
        self.rows: list[list[int]] = []
        self.group: list[int] = []
        self.layer: list[int] = []
        self.cursor = 0

    def _take(self, numel: int) -> int:
        start = self.cursor
        self.cursor += -(-numel // OFFSET_ALIGN) * OFFSET_ALIGN
        return start

    def _src(self, t: st.RawTensor) -> int:
        if (t.offset - self.data_start) % self.itemsize:
            raise InvalidArgument(f"tensor {t.name}: data not aligned to its dtype")
        return t.offset

    def add(self, layer: int, module: str, ab: dict[str, st.RawTensor]) -> None:
        r, spec = self.r, self.spec
        if set(ab) != {"A", "B"} or layer >= spec.num_layers:
            raise InvalidArgument(f"layer {layer} {module}: needs both lora_A and lora_B")
        k, n = spec.in_out(module)
        a, b = ab["A"], ab["B"]
        if a.shape != (r, k) or b.shape != (n, r):
            raise InvalidArgument(f"layer {layer} {module}: shapes {a.shape}, {b.shape} do not "
                                  f"match r={r} and the base model")
        if module in FUSED:                  # each slice: the whole A, its rows of B
            group = FUSED[module]
            starts = spec.slice_starts(group)
            for j in range(len(starts) - 1):
                self._slice(group, j, layer, a, b, starts[j], starts[j + 1])
        else:
            group, j = MODULE_GROUP[module]
            self._slice(group, j, layer, a, b, 0, n)

    def _slice(self, group: str, j: int, layer: int, a: st.RawTensor, b: st.RawTensor,
               lo: int, hi: int) -> None:
        """Slice j of the group: A [r, K] as it is; rows lo..hi of B [N, r], read row by row,
        written as Bt [r, hi - lo]."""
        r, k, n = self.r, a.shape[1], hi - lo
        a_at, b_at = self._take(r * k), self._take(r * n)
        self.offsets[group][layer, j] = (a_at, b_at)
        if group == "qkv":
            self.qkv_a[layer, j] = len(self.rows)
        elif group == "o":
            self.o_b[layer] = len(self.rows) + 1
        self._row(a_at, self._src(a), r, k, k, k, 1, GROUP_INDEX[group], layer)
        self._row(b_at, self._src(b) + lo * r * self.itemsize, n, r, r, 1, n, -1, layer)

    def _row(self, d_off, s_off, rows, cols, s_rs, d_rs, d_cs, group, layer) -> None:
        seg = [0] * sc.NFIELDS
        seg[sc.DST_OFF], seg[sc.SRC_OFF], seg[sc.ROWS], seg[sc.COLS] = d_off, s_off, rows, cols
        seg[sc.SRC_RS], seg[sc.DST_RS], seg[sc.DST_CS], seg[sc.FOLD] = s_rs, d_rs, d_cs, -1
        self.rows.append(seg)
        self.group.append(group)
        self.layer.append(layer)

    def plan(self, r: int, scale: float, src_dtype: torch.dtype, data_start: int) -> LayoutPlan:
        segs = np.array(self.rows, dtype=np.int64).reshape(-1, sc.NFIELDS)
        for arr in (segs, *self.offsets.values(), self.qkv_a, self.o_b):
            arr.setflags(write=False)
        elems = segs[:, sc.ROWS] * segs[:, sc.COLS]
        return LayoutPlan(r, scale, self.cursor, self.offsets, src_dtype, segs,
                          np.array(self.group, dtype=np.int64),
                          np.array(self.layer, dtype=np.int64), self.qkv_a, self.o_b,
                          int(elems.max(initial=0)), data_start)


def stage(blob: torch.Tensor, config: dict, spec: ModelSpec,
          plans: PlanCache | None = None) -> StagedAdapter:
    """A StagedAdapter over safetensors bytes already in host memory (uint8 [nbytes])."""
    head = blob[:min(blob.numel(), 8 + st.MAX_HEADER_BYTES)].numpy()
    plans = plans or PlanCache(spec, capacity=1)
    return StagedAdapter(blob, config, plans.plan(head, blob.numel(), config))


def staged_from_peft_dir(path, spec: ModelSpec) -> StagedAdapter:
    """Read a PEFT directory (safetensors only) into a StagedAdapter (tests, tools)."""
    path = pathlib.Path(path)
    config = json.loads((path / "adapter_config.json").read_text())
    data = (path / "adapter_model.safetensors").read_bytes()
    return stage(torch.frombuffer(bytearray(data), dtype=torch.uint8), config, spec)


def staged_from_tensors(tensors: dict[str, torch.Tensor], config: dict,
                        spec: ModelSpec) -> StagedAdapter:
    """A StagedAdapter from PEFT state-dict tensors (benchmarks): saved as safetensors bytes."""
    from safetensors.torch import save
    data = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})
    return stage(torch.frombuffer(bytearray(data), dtype=torch.uint8), config, spec)
