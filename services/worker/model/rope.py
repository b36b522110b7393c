"""Rotary position tables: inverse frequencies as transformers computes them (default, linear,
llama3 and yarn scaling), and the cos / sin tables each layer rotates q and k with; dynamic NTK
scaling's angles, which depend on the length they are computed for, per step (`DynamicRope`).

Computed in fp32 with transformers' own operations, so long positions get the very same angles
(the tables are then cast to the model's dtype, as transformers casts cos and sin).
"""
from __future__ import annotations

import math

import torch

from services.worker.model.spec import ModelSpec


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv: torch.Tensor, sc: dict) -> torch.Tensor:
    factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(
        sc["high_freq_factor"])
    old = float(sc["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    smooth = ((old / wavelen) - lo) / (hi - lo)
    mid = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wavelen > old / lo, inv / factor,
                       torch.where(wavelen < old / hi, inv, mid))


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, sc: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' _compute_yarn_parameters): per dimension a blend of the original
    and the interpolated frequency along a ramp between the beta_fast and beta_slow rotations
    of the original length, and cos / sin scaled by the attention factor."""
    old = int(sc["original_max_position_embeddings"])
    factor = sc.get("factor") or max_position / old
    attention = sc.get("attention_factor")
    if attention is None:
        m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
        attention = (_mscale(factor, m) / _mscale(factor, m_all) if m and m_all
                     else _mscale(factor))
    fast, slow = sc.get("beta_fast") or 32, sc.get("beta_slow") or 1

    def correction(rotations: float) -> float:
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))
    low, high = correction(fast), correction(slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                       # as transformers: no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention)


def inv_freq(theta: float, scaling: dict | None, head_dim: int,
             max_position: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [D/2] fp32, the factor cos and sin are scaled by)."""
    sc = scaling or {}
    kind = sc.get("rope_type", sc.get("type"))
    inv = _base_inv_freq(theta, head_dim)
    if kind == "linear":
        return inv / float(sc["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv, sc), 1.0
    if kind == "yarn":
        return _yarn(theta, head_dim, sc, max_position)
    if kind not in (None, "default", "dynamic"):      # dynamic: these up to its length
        raise ValueError(f"rope scaling {kind!r} is not supported")
    return inv, 1.0


class DynamicRope:
    """Dynamic NTK scaling as transformers runs it: a forward's angles are computed for its
    length L (the largest position + 1) and, past the model's max_position_embeddings, with the
    base theta * (factor * L / max_pos - (factor - 1)) ** (D / (D - 2)); the keys in the cache
    keep the angles they were written with. So a prompt's rows are rotated for the prompt's
    length and each later token for its own position + 1: L = max(position + 1, prompt length)
    a row (StepContext.rope_len), the base's operations in fp32 as transformers does them."""

    def __init__(self, theta: float, scaling: dict, head_dim: int, device: torch.device):
        self.theta, self.factor = theta, float(scaling["factor"])
        self.orig = int(scaling["original_max_position_embeddings"])
        self.power = head_dim / (head_dim - 2)
        self.exps = (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim).to(device)
        self.inv = _base_inv_freq(theta, head_dim).to(device)

    def angles(self, positions: torch.Tensor, rope_len: torch.Tensor | None,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, D/2] of each row (positions, rope_len: int64 [T])."""
        if rope_len is None:
            rope_len = positions + 1
        length = torch.clamp(rope_len, min=self.orig).float()
        base = self.theta * ((self.factor * length / self.orig) - (self.factor - 1)) ** self.power
        inv = torch.where((rope_len > self.orig)[:, None], 1.0 / (base[:, None] ** self.exps),
                          self.inv)
        freqs = positions.float()[:, None] * inv
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def dynamic_ropes(spec: ModelSpec, device: torch.device) -> list[DynamicRope | None]:
    """Each layer's DynamicRope, None for a layer whose RoPE is not dynamic."""
    out, made = [], {}
    for layer in range(spec.num_layers):
        theta, scaling = spec.layer_rope(layer)
        if not scaling or scaling.get("rope_type") != "dynamic":
            out.append(None)
            continue
        key = repr((theta, sorted(scaling.items())))
        made.setdefault(key, DynamicRope(theta, scaling, spec.head_dim, device))
        out.append(made[key])
    return out


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """The full-attention layers' inverse frequencies (tests, tools)."""
    return inv_freq(spec.rope_theta, spec.rope_scaling, spec.head_dim, spec.max_position)[0]


def rope_tables(spec: ModelSpec, device: torch.device, dtype: torch.dtype
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (cos, sin) [max_position, D/2] in dtype; layers of one RoPE share them."""
    made: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    out = []
    for layer in range(spec.num_layers):
        theta, scaling = spec.layer_rope(layer)
        key = repr((theta, sorted((scaling or {}).items())))
        if key not in made:
            inv, attention = inv_freq(theta, scaling, spec.head_dim, spec.max_position)
            t = torch.arange(spec.max_position, dtype=torch.float32)
            freqs = torch.outer(t, inv).to(device)                       # [max_pos, D/2]
            made[key] = ((freqs.cos() * attention).to(dtype),
                         (freqs.sin() * attention).to(dtype))
        out.append(made[key])
    return out
