"""A checkpoint's FP8 KV cache scales: each decoder layer's k_scale and v_scale (one float each),
with which an e4m3 cache stores K / k_scale and V / v_scale (kernels.attention_ref.write_kv_ref).

Published as llm-compressor writes them (`model.layers.N.self_attn.k_scale` and `v_scale`, with a
compressed-tensors `kv_cache_scheme`: quant_scheme.read_kv_scheme), or in the older form of
AutoFP8 and early compressed-tensors (`self_attn.k_proj.output_scale`, `v_proj.output_scale`).
They are read in float32, never in the model dtype (fp8.convert), taken out of the checkpoint's
tensors as they are found (pop_kv_scales) and checked only where the cache will be e4m3
(checked): one positive, finite value a tensor, every layer's pair present.
"""
from __future__ import annotations

import math

import torch

from services.worker.model.spec import UnsupportedModel

# (k, v) names of a layer's scales after "model.layers.N.", in the order they are looked for
NAMES = (("self_attn.k_scale", "self_attn.v_scale"),
         ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"))
UNIT = (1.0, 1.0)

# a layer's scales as found: ((k name, tensor or None), (v name, tensor or None))
Found = tuple[tuple[str, torch.Tensor | None], tuple[str, torch.Tensor | None]]


def is_kv_scale(name: str) -> bool:
    """Whether a checkpoint tensor is a layer's K or V cache scale."""
    return name.startswith("model.layers.") and any(name.endswith("." + n)
                                                   for pair in NAMES for n in pair)


def pop_kv_scales(raw: dict, layers: int) -> list[Found] | None:
    """Each of the first `layers` layers' scale tensors as found (unchecked), taken out of raw;
    None when the checkpoint has none. Scales of layers past `layers` (a shallower load) are
    dropped."""
    if not any(is_kv_scale(k) for k in raw):
        return None
    found = [_layer(raw, f"model.layers.{i}.") for i in range(layers)]
    for key in [k for k in raw if is_kv_scale(k)]:
        del raw[key]
    return found


def _layer(raw: dict, prefix: str) -> Found:
    names = next(((k, v) for k, v in NAMES if prefix + k in raw or prefix + v in raw), NAMES[0])
    return tuple((prefix + n, raw.pop(prefix + n, None)) for n in names)


def checked(found: list[Found] | None, layers: int,
            declared: bool) -> list[tuple[float, float]]:
    """Each layer's (k_scale, v_scale) for an e4m3 cache: the checkpoint's, checked (a missing
    or bad one refused naming the tensor), or 1.0 where it has none and its config declares
    none (declared: spec.kv_scales)."""
    if found is None:
        if declared:
            raise UnsupportedModel(f"checkpoint lacks tensor model.layers.0.{NAMES[0][0]}: "
                                   f"{_why(True)}")
        return [UNIT] * layers
    return [(_value(*k, declared), _value(*v, declared)) for k, v in found]


def _why(declared: bool) -> str:
    if declared:
        return "its config.json declares an FP8 KV cache (kv_cache_scheme) with per-layer scales"
    return "the checkpoint has other layers' KV cache scales"


def _value(name: str, t: torch.Tensor | None, declared: bool) -> float:
    if t is None:
        raise UnsupportedModel(f"checkpoint lacks tensor {name}: {_why(declared)}")
    if t.numel() != 1:
        raise UnsupportedModel(f"tensor {name} has shape {tuple(t.shape)}: a KV cache scale is "
                               f"one value (per-tensor)")
    value = float(t.reshape(()).float())
    if not (value > 0 and math.isfinite(value)):
        raise UnsupportedModel(f"tensor {name} is {value}: a KV cache scale must be positive "
                               f"and finite")
    return value
