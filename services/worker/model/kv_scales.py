"""A checkpoint's FP8 KV cache scales: each decoder layer's k_scale and v_scale (one float each),
with which an e4m3 cache stores K / k_scale and V / v_scale (kernels.attention_ref.write_kv_ref).

Published as llm-compressor writes them (`model.layers.N.self_attn.k_scale` and `v_scale`, with a
compressed-tensors `kv_cache_scheme`: quant_scheme.read_kv_scheme), or in the older form of
AutoFP8 and early compressed-tensors (`self_attn.k_proj.output_scale`, `v_proj.output_scale`).
They are read in float32 (fp8.convert), never in the model dtype, and checked: one positive,
finite value a tensor. A layer without them, where the config declares them, is refused naming
the tensor.
"""
from __future__ import annotations

import math

import torch

from services.worker.model.spec import UnsupportedModel

# (k, v) names of a layer's scales after "model.layers.N.", in the order they are looked for
NAMES = (("self_attn.k_scale", "self_attn.v_scale"),
         ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"))
UNIT = (1.0, 1.0)


def is_kv_scale(name: str) -> bool:
    """Whether a checkpoint tensor is a layer's K or V cache scale."""
    return name.startswith("model.layers.") and any(name.endswith("." + n)
                                                   for pair in NAMES for n in pair)


def pop_kv_scales(raw: dict, layers: int, declared: bool) -> list[tuple[float, float]] | None:
    """Each of the first `layers` layers' (k_scale, v_scale), taken out of raw; None when the
    checkpoint has none and its config declares none (declared: spec.kv_scales). Scales of
    layers past `layers` (a shallower load) are dropped."""
    present = [k for k in raw if is_kv_scale(k)]
    if not present and not declared:
        return None
    scales = [_layer(raw, f"model.layers.{i}.") for i in range(layers)]
    for key in [k for k in raw if is_kv_scale(k)]:
        del raw[key]
    return scales


def _layer(raw: dict, prefix: str) -> tuple[float, float]:
    for k_name, v_name in NAMES:
        if prefix + k_name in raw or prefix + v_name in raw:
            return (_value(raw.pop(prefix + k_name, None), prefix + k_name),
                    _value(raw.pop(prefix + v_name, None), prefix + v_name))
    raise UnsupportedModel(f"checkpoint lacks tensor {prefix}{NAMES[0][0]}: its config.json "
                           f"declares an FP8 KV cache (kv_cache_scheme) with per-layer scales")


def _value(t: torch.Tensor | None, name: str) -> float:
    if t is None:
        raise UnsupportedModel(f"checkpoint lacks tensor {name} (its layer has the other KV "
                               f"cache scale)")
    if t.numel() != 1:
        raise UnsupportedModel(f"tensor {name} has shape {tuple(t.shape)}: a KV cache scale is "
                               f"one value (per-tensor)")
    value = float(t.reshape(()).float())
    if not (value > 0 and math.isfinite(value)):
        raise UnsupportedModel(f"tensor {name} is {value}: a KV cache scale must be positive "
                               f"and finite")
    return value
