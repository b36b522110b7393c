"""Build-time transforms of the base model's weights, each a form of the same math that a
PerfConfig chooses (bench/PERF_NOTES.md has why each default wins on the H200):

- folded norms: each layer's in-layer RMSNorm weights multiplied into the GEMMs after them,
  so a decoder layer launches no norm kernel (the model then reads the residual itself);
- the [K, N] layout: the decode GEMMs' weights stored column-major on CUDA;
- the BLAS backend torch hands the GEMMs to.

`apply` runs them in that order and returns what the model and the adapter pool need to know
(the folded norm weights).
"""
from __future__ import annotations

import torch

from services.worker.model.spec import ModelSpec
from services.worker.perf_config import BLAS_BACKENDS, PerfConfig


def apply(weights: dict, spec: ModelSpec, device: torch.device,
          perf: PerfConfig) -> dict[str, torch.Tensor] | None:
    """In place, the transforms perf chooses; returns group -> [L, K] of the norm weights folded
    into that group's GEMM, or None when the norms stay kernels."""
    folded = fold_norm_weights(weights) if fold_norms(spec, perf) else None
    if device.type == "cuda" and perf.weight_layout == "kn":
        to_kn_layout(weights)
    choose_blas(device, perf.blas)
    return folded


# Decode GEMMs whose weights a CUDA model keeps as [K, N] in memory (still [N, K]-shaped
# tensors, column-major); PerfConfig.weight_layout "nk" keeps them all [N, K]. Why these:
# bench/PERF_NOTES.md, "Why the defaults".
KN_GEMMS = ("qkv", "o", "gate_up")


# torch's BLAS backend for a CUDA model's GEMMs (PerfConfig.blas; cuBLASLt by default, why:
# bench/PERF_NOTES.md, "Why the defaults"). The choice is the process's: a worker runs one
# engine.


def choose_blas(device: torch.device, name: str) -> None:
    """Set torch's preferred BLAS backend for CUDA GEMMs (PerfConfig.blas). A bad value is an
    error on any device, so a typo shows on a CPU run too."""
    if name not in BLAS_BACKENDS:
        raise ValueError(f"LORAFLEET_BLAS must be one of {BLAS_BACKENDS}, got {name!r}")
    if device.type == "cuda":
        torch.backends.cuda.preferred_blas_library(name)


# The GEMMs whose input is a norm's output, and that norm: with folded norms (fold_norms) each
# keeps g * W (the norm weight g folded into its input columns) and gets the residual h itself;
# the consumer of its output scales rows by the norm's factor (kernels/fused.py), and the
# adapter pool folds g into these groups' LoRA A (services.worker.adapters.device_pool).
NORM_OF = {"qkv": "in_norm", "gate_up": "post_norm"}


def fold_norms(spec: ModelSpec, perf: PerfConfig) -> bool:
    """PerfConfig.fold_norms (default on): fold the in-layer RMSNorms into the GEMMs after
    them, so a decoder layer launches no norm kernel (the residual adds go into the o and down
    GEMMs' epilogues). Off for a model with a q/k/v bias, which the factor must not scale, with
    q/k norms (their eps would see the unscaled rows) and with Gemma's norms of the blocks'
    outputs (which come between the GEMM and the residual add)."""
    return perf.fold_norms and not (spec.qkv_bias or spec.qk_norm or spec.gemma_norms)


def fold_norm_weights(weights: dict) -> dict[str, torch.Tensor]:
    """In place: each layer's q/k/v and gate/up weight [N, K] times its norm's weight over K.
    Returns group -> [L, K] of the norm weights folded (the pool folds them into LoRA A)."""
    folded = {}
    for group, norm in NORM_OF.items():
        for layer in weights["layers"]:
            layer[group].mul_(layer[norm])
        folded[group] = torch.stack([layer[norm] for layer in weights["layers"]])
    return folded


def to_kn_layout(weights: dict) -> None:
    """In place: the KN_GEMMS of each layer (and an untied lm_head) stored column-major, one
    tensor at a time (the old storage is freed as each is replaced). F.linear then hands cuBLAS
    a contiguous [K, N] operand."""
    def kn(t: torch.Tensor) -> torch.Tensor:
        return t if t.stride(0) == 1 else t.t().contiguous().t()
    for layer in weights["layers"]:
        for name in KN_GEMMS:
            layer[name] = kn(layer[name])
    if weights["lm_head"] is not weights["embed"]:   # a tied table stays row-major: gathered
        weights["lm_head"] = kn(weights["lm_head"])
