"""Build-time transforms of the base model's weights, each a form of the same math that a
PerfConfig chooses (bench/PERF_NOTES.md has why each default wins on the H200):

- folded norms: each layer's in-layer RMSNorm weights multiplied into the GEMMs after them,
  so a decoder layer launches no norm kernel (the model then reads the residual itself);
- the [K, N] layout: the decode GEMMs' weights stored column-major on CUDA;
- the BLAS backend torch hands the GEMMs to.

`apply` runs them in that order and returns what the model and the adapter pool need to know
(the folded norm weights).

FP8 weights (services.worker.model.fp8, spec.quant set) keep the checkpoint's math exactly: no
norm is folded into them (g * W would have to be quantized again), the [K, N] layout leaves
them as they are (their GEMM dequantizes them), and the LoRA column and row blocks, which
extend the q/k/v and o weights in place, are off (`lora_forms`): every adapter's q/k/v and o
go through the split SGMV, as on a CPU.
"""
from __future__ import annotations

import torch

from services.worker.model.fp8 import Fp8Weight
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


def lora_forms(spec: ModelSpec, perf: PerfConfig, cuda: bool) -> tuple[int, int]:
    """(LoRA column blocks, row LoRA's rank parts) for this model: PerfConfig's, or (0, 0) for
    FP8 weights, where asking for them (LORAFLEET_LORA_COLUMNS or LORAFLEET_LORA_ROWS > 0) is
    a ValueError naming the variable."""
    if spec.quant is None:
        return perf.columns_for(cuda), perf.rows_for(cuda)
    for name, value in (("LORAFLEET_LORA_COLUMNS", perf.lora_columns),
                        ("LORAFLEET_LORA_ROWS", perf.lora_rows)):
        if value:
            raise ValueError(f"{name}={value}: the LoRA column and row blocks extend bf16 "
                             f"weights; with FP8 weights leave it unset or 0")
    return 0, 0


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
    outputs (which come between the GEMM and the residual add), and with FP8 weights (the
    norm weight would have to be quantized into them)."""
    return perf.fold_norms and not (spec.qkv_bias or spec.qk_norm or spec.gemma_norms
                                    or spec.quant)


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
    a contiguous [K, N] operand. FP8 weights are left as they are (their GEMM dequantizes)."""
    def kn(t: torch.Tensor | Fp8Weight) -> torch.Tensor | Fp8Weight:
        if isinstance(t, Fp8Weight) or t.stride(0) == 1:
            return t
        return t.t().contiguous().t()
    for layer in weights["layers"]:
        for name in KN_GEMMS:
            layer[name] = kn(layer[name])
    if weights["lm_head"] is not weights["embed"]:   # a tied table stays row-major: gathered
        weights["lm_head"] = kn(weights["lm_head"])
