"""Column LoRA: the q/k/v LoRA shrink as extra rows of the base weight.

With the split SGMV a LoRA'd projection is three launches: the base GEMM, the shrink
(v = x @ A.T) and the expand (y += scale * v @ Bt). The shrink reads the same x as the GEMM and
is latency-bound at decode sizes. Here each of up to `n_cols` adapters with rank <= RANK_TILE
keeps its q/k/v A matrices as extra rows of the layer's q/k/v weight, [N + n_cols * 3 * 16, K]:
one GEMM then yields y and every resident adapter's x @ A.T, and only the expand remains
(kernels.sgmv.sgmv_expand_columns reads v from those output columns). The premise, on the H200
at batch 64 with 32 rank-16 adapters (bench/shrink_in_gemm.py, seventh session): q/k/v 50.7 ->
43.5 us a layer; the o projection gained nothing (cuBLAS slowed at N = 4608), so only q/k/v.

Layout: slot c's block is rows N + c * n_slices * 16 .. + n_slices * 16 of the extended weight;
slice j's A sits in its rows j * 16 .. j * 16 + rank, the rest zero. The extended weight has the
base weight's memory layout (row- or column-major); the model's `layer["qkv"]` becomes a view
of its first N rows, so steps without column LoRA stream only the base weight.

Which adapters get a block: the pool assigns one when it places an adapter of rank <= 16 that
targets q/k/v and a block is free (`assign`), and frees it with the slot (`release`). A step
takes the column path only when every q/k/v adapter in it has a block (LlamaModel.lora_mask's
COLUMNS_BIT); otherwise the split SGMV runs. Blocks are written on the pool's copy stream while
graphs may replay: a replay computes every block's columns, but reads only those of slots
whose `col_slot` entry is set, which happens after the block is written.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import torch

GROUP = "qkv"
RANK_TILE = 16


# Blocks a CUDA worker keeps by default. On the H200 (Llama-2-7B shape, batch 64, 32 rank-16
# adapters, bench/results/ab/e2e-cols-h200.md) 32 blocks took 6.31-6.35 -> 6.22-6.26 ms a
# decode step at 64 new tokens; one adapter 5.93 -> 5.96, base-only unchanged. They cost
# n_cols x 48 rows x K of q/k/v weight a layer (403 MB for that model). On the CPU none.
CUDA_DEFAULT = 32


def column_slots(device: torch.device | None = None) -> int:
    """LORAFLEET_LORA_COLUMNS: how many adapters keep q/k/v A rows beside the base weight
    (unset: CUDA_DEFAULT on a CUDA device, else 0; 0: none)."""
    default = CUDA_DEFAULT if device is not None and device.type == "cuda" else 0
    val = os.environ.get("LORAFLEET_LORA_COLUMNS", str(default))
    if not val.isdigit():
        raise ValueError(f"LORAFLEET_LORA_COLUMNS must be a count >= 0, got {val!r}")
    return int(val)


class LoraColumns:
    """The extended q/k/v weights of every layer and which adapter slot owns which block."""

    def __init__(self, weights: dict, n_slices: int, n_cols: int, device: torch.device):
        self.n_cols, self.n_slices = n_cols, n_slices
        self.width = n_cols * n_slices * RANK_TILE          # extra rows a layer
        self.device = device
        self.ext: list[torch.Tensor] = []
        for layer in weights["layers"]:
            w = layer[GROUP]                                 # [N, K]
            n, k = w.shape
            if w.stride(0) == 1 and n > 1:                   # column-major ([K, N] in memory)
                ext = torch.zeros(k, n + self.width, dtype=w.dtype, device=w.device).t()
            else:
                ext = torch.zeros(n + self.width, k, dtype=w.dtype, device=w.device)
            ext[:n].copy_(w)
            self.ext.append(ext)
            layer[GROUP] = ext[:n]
            layer[GROUP + "_ext"] = ext
            bias = layer.get(GROUP + "_bias")
            if bias is not None:
                layer[GROUP + "_ext_bias"] = torch.cat([bias, bias.new_zeros(self.width)])
        self.n_base = self.ext[0].shape[0] - self.width if self.ext else 0
        self.col_slot = torch.full((0,), -1, dtype=torch.int32, device=device)
        self.col_host = np.full(0, -1, dtype=np.int64)
        self._free = list(range(n_cols - 1, -1, -1))
        self._lock = threading.Lock()

    def bind(self, max_slots: int) -> None:
        """Size the slot -> block tables for the pool's slots (the pool calls it)."""
        self.col_slot = torch.full((max_slots,), -1, dtype=torch.int32, device=self.device)
        self.col_host = np.full(max_slots, -1, dtype=np.int64)

    def assign(self, slot: int, pool: torch.Tensor, a_off_host: np.ndarray, rank: int) -> int:
        """Give the adapter in `slot` a block, if it can have one, and write its A rows there
        (on the current stream). a_off_host [L, n_slices, n_slots]: the pool's q/k/v A
        offsets (slot's column already written). Returns the block, or -1."""
        offs = a_off_host[:, :, slot]
        if rank > RANK_TILE or not (offs >= 0).any():
            return -1
        with self._lock:
            if not self._free:
                return -1
            c = self._free.pop()
        k = self.ext[0].shape[1]
        r0 = self.n_base + c * self.n_slices * RANK_TILE
        for layer, ext in enumerate(self.ext):
            block = ext[r0:r0 + self.n_slices * RANK_TILE]
            block.zero_()
            for j in range(self.n_slices):
                a_o = int(offs[layer, j])
                if a_o >= 0:
                    block[j * RANK_TILE:j * RANK_TILE + rank].copy_(
                        pool[a_o:a_o + rank * k].view(rank, k))
        self.col_slot[slot] = c
        self.col_host[slot] = c
        return c

    def release(self, slot: int) -> None:
        """Free the slot's block (the caller guarantees no step uses the slot)."""
        c = int(self.col_host[slot])
        if c < 0:
            return
        self.col_slot[slot] = -1
        self.col_host[slot] = -1
        with self._lock:
            self._free.append(c)

    def covers(self, slots: np.ndarray) -> bool:
        """Whether every one of these adapter slots (its adapter targets q/k/v) has a block."""
        return bool(len(slots)) and bool((self.col_host[slots] >= 0).all())
