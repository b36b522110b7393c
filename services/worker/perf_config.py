"""The engine's performance choices, as one value passed down from main().

Each is a build-time choice between forms that compute the same outputs (the parity tests hold
for every combination); bench/PERF_NOTES.md has the measurements behind each default. The worker
builds one from its environment in its config (`from_env`, the only place these variables are
read); benchmarks and tests pass values.

    LORAFLEET_BLAS           torch's BLAS backend for the CUDA GEMMs: cublaslt (default) | cublas
    LORAFLEET_FOLD_NORMS     1 (default): the in-layer RMSNorms folded into the GEMMs after them
    LORAFLEET_WEIGHT_LAYOUT  kn (default): the decode GEMMs' weights stored [K, N] on CUDA | nk
    LORAFLEET_LORA_COLUMNS   adapters whose q/k/v A rows sit beside the base weight (default:
                             32 on CUDA, 0 on CPU)
    LORAFLEET_LORA_ROWS      0 | 1, 2, 4, 8 or 16: the o projection's LoRA as row LoRA over the
                             column blocks (services.worker.model.lora_columns), its shrink in that
                             many rank parts (default: 4 on CUDA, 0 on CPU); nothing without
                             column blocks
    LORAFLEET_PDL            1 (default): Triton kernels launch with programmatic dependent
                             launch on sm_90+ | 0
    LORAFLEET_SGMV_SPLIT     fields of kernels.sgmv_split.SplitConfig set over its pick
                             ("k_chunk=512,progs_per_sm=2"; A/B runs)
    LORAFLEET_SPLIT_ATTENTION  0 (default) | 1: in a step with prompt chunks, the decode rows'
                             attention in the decode launch and the chunks' in the prefill
                             launch (kernels.attention_triton split_kinds), not all rows in the
                             prefill one (an A/B, not yet measured)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

BLAS_BACKENDS = ("cublas", "cublaslt")
WEIGHT_LAYOUTS = ("kn", "nk")
CUDA_COLUMNS = 32            # LoRA column blocks a CUDA model keeps by default
ROW_PARTS = (0, 1, 2, 4, 8, 16)  # LORAFLEET_LORA_ROWS: off, or the row LoRA shrink's rank parts
CUDA_ROW_PARTS = 4           # row LoRA on a CUDA model by default (bench/PERF_NOTES.md)


@dataclass(frozen=True)
class PerfConfig:
    blas: str = "cublaslt"
    fold_norms: bool = True
    weight_layout: str = "kn"
    lora_columns: int | None = None         # None: CUDA_COLUMNS on CUDA, 0 elsewhere
    lora_rows: int | None = None            # None: CUDA_ROW_PARTS on CUDA, 0 elsewhere
    pdl: bool = True
    sgmv_split: str = ""
    split_attention: bool = False

    def __post_init__(self) -> None:
        if self.blas not in BLAS_BACKENDS:
            raise ValueError(f"LORAFLEET_BLAS must be one of {BLAS_BACKENDS}, got {self.blas!r}")
        if self.weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"LORAFLEET_WEIGHT_LAYOUT must be one of {WEIGHT_LAYOUTS}, got "
                             f"{self.weight_layout!r}")
        if self.lora_columns is not None and self.lora_columns < 0:
            raise ValueError(f"LORAFLEET_LORA_COLUMNS must be a count >= 0, got "
                             f"{self.lora_columns!r}")
        if self.lora_rows is not None and self.lora_rows not in ROW_PARTS:
            raise ValueError(f"LORAFLEET_LORA_ROWS must be one of {ROW_PARTS}, got "
                             f"{self.lora_rows!r}")
        if self.sgmv_split:                 # a malformed one fails at start, not in a step
            from kernels.sgmv_split import parse_overrides
            parse_overrides(self.sgmv_split)

    def columns_for(self, cuda: bool) -> int:
        """The LoRA column blocks a model on this kind of device keeps."""
        if self.lora_columns is not None:
            return self.lora_columns
        return CUDA_COLUMNS if cuda else 0

    def rows_for(self, cuda: bool) -> int:
        """Row LoRA's shrink rank parts for a model on this kind of device (0: off)."""
        if self.lora_rows is not None:
            return self.lora_rows
        return CUDA_ROW_PARTS if cuda else 0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "PerfConfig":
        """From LORAFLEET_* variables (see the module doc); a malformed value is a ValueError
        naming the variable."""
        def flag(name: str, default: str) -> bool:
            val = env.get(name, default)
            if val not in ("0", "1"):
                raise ValueError(f"{name} must be 0 or 1, got {val!r}")
            return val == "1"
        cols = env.get("LORAFLEET_LORA_COLUMNS")
        if cols is not None and not cols.isdigit():
            raise ValueError(f"LORAFLEET_LORA_COLUMNS must be a count >= 0, got {cols!r}")
        rows = env.get("LORAFLEET_LORA_ROWS")
        if rows is not None and rows not in {str(p) for p in ROW_PARTS}:
            raise ValueError(f"LORAFLEET_LORA_ROWS must be one of {ROW_PARTS}, got {rows!r}")
        return cls(blas=env.get("LORAFLEET_BLAS", "cublaslt"),
                   fold_norms=flag("LORAFLEET_FOLD_NORMS", "1"),
                   weight_layout=env.get("LORAFLEET_WEIGHT_LAYOUT", "kn"),
                   lora_columns=int(cols) if cols is not None else None,
                   lora_rows=int(rows) if rows is not None else None,
                   pdl=env.get("LORAFLEET_PDL", "1") != "0",
                   sgmv_split=env.get("LORAFLEET_SGMV_SPLIT", ""),
                   split_attention=flag("LORAFLEET_SPLIT_ATTENTION", "0"))
