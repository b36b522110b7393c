"""Turn a PEFT adapter's tensors into one contiguous blob in the pool's layout.

Per (layer, group, slice) the adapter targets, the blob holds A [r, K] then Bt [r, N]
(kernels.sgmv_ref documents the layout). Offsets are relative to the blob start; the pool adds
the blob's position when it places it. Each matrix starts at a multiple of OFFSET_ALIGN
elements (zeros pad the gaps), so that with the blob's own start aligned the SGMV kernels may
load A and Bt in 16-byte vectors whatever r, K and N are.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import numpy as np
import torch

from services.common.errors import InvalidArgument
from services.worker.model_spec import GROUPS, MODULE_GROUP, ModelSpec

OFFSET_ALIGN = 8     # elements: 16 bytes in bf16 / fp16

KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass
class AdapterLayout:
    blob: torch.Tensor                  # [E] in the pool dtype (pinned host memory on CUDA)
    rank: int
    scale: float
    offsets: dict[str, np.ndarray]      # group -> int64 [L, n_slices, 2] (a, b), -1 = absent

    @property
    def nbytes(self) -> int:
        return self.blob.numel() * self.blob.element_size()


def lora_scale(config: dict) -> float:
    r = int(config["r"])
    alpha = float(config.get("lora_alpha", r))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _pairs(tensors: dict[str, torch.Tensor]) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = KEY.search(name)
        if m is None:
            raise InvalidArgument(f"tensor {name}: not a LoRA A/B weight of a known projection")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in MODULE_GROUP:
            raise InvalidArgument(f"tensor {name}: module {module} is not a supported target")
        pairs.setdefault((layer, module), {})[ab] = t
    return pairs


def build_layout(tensors: dict[str, torch.Tensor], config: dict, spec: ModelSpec,
                 dtype: torch.dtype, pin: bool = False) -> AdapterLayout:
    """Pack PEFT tensors (state-dict names) into a blob for the pool."""
    r = int(config["r"])
    pairs = _pairs(tensors)
    offsets = {g: np.full((spec.num_layers, len(m), 2), -1, dtype=np.int64)
               for g, m in GROUPS.items()}
    parts: list[torch.Tensor] = []
    cursor = 0

    def take(t: torch.Tensor) -> int:
        """Append t (flat) at the next aligned offset; return that offset."""
        nonlocal cursor
        start = cursor
        pad = -(start + t.numel()) % OFFSET_ALIGN
        parts.extend([t, torch.zeros(pad, dtype=t.dtype)] if pad else [t])
        cursor += t.numel() + pad
        return start
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"} or layer >= spec.num_layers:
            raise InvalidArgument(f"layer {layer} {module}: needs both lora_A and lora_B")
        k, n = spec.in_out(module)
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (r, k) or tuple(b.shape) != (n, r):
            raise InvalidArgument(f"layer {layer} {module}: shapes {tuple(a.shape)}, "
                                  f"{tuple(b.shape)} do not match r={r} and the base model")
        group, j = MODULE_GROUP[module]
        offsets[group][layer, j] = (take(a.reshape(-1)), take(b.t().contiguous().reshape(-1)))
    blob = torch.cat([p.to(dtype) for p in parts]) if parts else torch.zeros(0, dtype=dtype)
    if pin:
        blob = blob.pin_memory()
    return AdapterLayout(blob, r, lora_scale(config), offsets)


def layout_from_peft_dir(path, spec: ModelSpec, dtype: torch.dtype) -> AdapterLayout:
    """Read a PEFT directory (safetensors only) straight into a layout (tests, tools)."""
    from safetensors.torch import load_file
    config = json.loads(open(f"{path}/adapter_config.json").read())
    return build_layout(load_file(f"{path}/adapter_model.safetensors"), config, spec, dtype)
