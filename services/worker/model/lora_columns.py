"""Column LoRA: the q/k/v LoRA shrink as extra rows of the base weight.

With the split SGMV a LoRA'd projection is three launches: the base GEMM, the shrink
(v = x @ A.T) and the expand (y += scale * v @ Bt). The shrink reads the same x as the GEMM and
is latency-bound at decode sizes. Here each of up to `n_cols` adapters with rank <= RANK_TILE
keeps its q/k/v A matrices as extra rows of the layer's q/k/v weight, [N + n_cols * 3 * 16, K]:
one GEMM then yields y and every resident adapter's x @ A.T, and only the expand remains
(kernels.sgmv.sgmv_expand_columns reads v from those output columns). The premise, on the H200
at batch 64 with 32 rank-16 adapters (bench/shrink_in_gemm.py, 2026-11-30 night session): q/k/v 50.7 ->
43.5 us a layer; the o projection gained nothing (cuBLAS slowed at N = 4608), so only q/k/v.

Layout: slot c's block is rows N + c * n_slices * 16 .. + n_slices * 16 of the extended weight;
slice j's A sits in its rows j * 16 .. j * 16 + rank, the rest zero. The extended weight has the
base weight's memory layout (row- or column-major); the model's `layer["qkv"]` becomes a view
of its first N rows, so steps without column LoRA stream only the base weight.

Row LoRA (`rows`, PerfConfig.lora_rows): the o projection's twin. Each block c also keeps its
adapter's o Bt rows beside the o weight in K, columns K + c * 16 .. + 16 of an [N, K + n_cols *
16] weight (`o_ext`, `layer["o"]` a view of its first K columns). The model writes attention's
output into the first K columns of a [T, K + n_cols * 16] buffer and each row's scaled x @ A_o.T
into its adapter's block of the rest (kernels.shrink_blocks, zeros elsewhere): one GEMM over the
buffer and o_ext gives the base output plus every row's o expand, with no expand launch.

Which adapters get a block: the pool assigns one when it places an adapter of rank <= 16 that
targets q/k/v (or o, with rows) and a block is free (`assign`), and frees it with the slot
(`release`). A step takes the column path only when every q/k/v (and, with rows, o) adapter in
it has a block (LoraMeta.columns, chosen by services.worker.executor.lora_choice); otherwise the
split SGMV runs. Blocks are written on the pool's copy stream while graphs may replay: a replay
computes every block's columns, but reads only those of slots whose `col_slot` entry is set,
which happens after the block is written.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

GROUP = "qkv"
RANK_TILE = 16


# How many adapters a model keeps blocks for: PerfConfig.lora_columns (services/worker/
# perf_config.py; 32 on CUDA by default, the measurements in bench/PERF_NOTES.md).


class LoraColumns:
    """The extended q/k/v (and, with rows, o) weights of every layer and which adapter slot
    owns which block."""

    def __init__(self, weights: dict, n_slices: int, n_cols: int, device: torch.device,
                 rows: bool = False):
        self.n_cols, self.n_slices, self.rows = n_cols, n_slices, rows
        self.width = n_cols * n_slices * RANK_TILE          # extra rows a layer
        self.row_width = n_cols * RANK_TILE if rows else 0  # extra o columns a layer
        self.device = device
        self.ext: list[torch.Tensor] = []
        self.o_ext: list[torch.Tensor] = []
        for layer in weights["layers"]:
            w = layer[GROUP]                                 # [N, K]
            n, k = w.shape
            ext = _zeros_like_layout(w, n + self.width, k)
            ext[:n].copy_(w)
            self.ext.append(ext)
            if rows:                                         # o: [N, K] -> [N, K + row_width]
                wo = layer["o"]
                o_ext = _zeros_like_layout(wo.t(), wo.shape[1] + self.row_width,
                                           wo.shape[0]).t()
                o_ext[:, :wo.shape[1]].copy_(wo)
                self.o_ext.append(o_ext)
                layer["o"] = o_ext[:, :wo.shape[1]]
                layer["o_ext"] = o_ext
            layer[GROUP] = ext[:n]
            layer[GROUP + "_ext"] = ext
            bias = layer.get(GROUP + "_bias")
            if bias is not None:
                layer[GROUP + "_ext_bias"] = torch.cat([bias, bias.new_zeros(self.width)])
        self.n_base = self.ext[0].shape[0] - self.width if self.ext else 0
        self.k_o = self.o_ext[0].shape[1] - self.row_width if self.o_ext else 0
        # the most elements one block segment writes (the scatter's grid must cover it)
        self.max_elems = max([RANK_TILE * e.shape[1] for e in self.ext[:1]]
                             + [RANK_TILE * e.shape[0] for e in self.o_ext[:1]] + [0])
        # each layer's dsts index, K, and its block's row and column strides: element (row i,
        # column kk) of row-major [N + width, K] storage, or of the column-major one
        # ([K, N + width] in memory)
        self._geo = np.array([(1 + layer, e.shape[1]) + ((1, e.shape[0]) if _column_major(e)
                              else (e.shape[1], 1)) for layer, e in enumerate(self.ext)],
                             dtype=np.int64).reshape(-1, 4)
        # the o weights': dsts index, N, and the strides of a block's rows (K) and columns (N)
        # in their storage (element (n, kk) of o_ext at n * stride(0) + kk * stride(1))
        n_layers = len(self.ext)
        self._geo_o = np.array([(1 + n_layers + layer, e.shape[0], e.stride(1), e.stride(0))
                                for layer, e in enumerate(self.o_ext)],
                               dtype=np.int64).reshape(-1, 4)
        self.col_slot = torch.full((0,), -1, dtype=torch.int32, device=device)
        self.col_host = np.full(0, -1, dtype=np.int64)
        self._free = list(range(n_cols - 1, -1, -1))
        self._lock = threading.Lock()

    def bind(self, max_slots: int, col_slot: torch.Tensor | None = None) -> None:
        """Size the slot -> block tables for the pool's slots (the pool calls it, handing over
        the device table it writes with each placement's other slot entries)."""
        self.col_slot = col_slot if col_slot is not None else torch.full(
            (max_slots,), -1, dtype=torch.int32, device=self.device)
        self.col_host = np.full(max_slots, -1, dtype=np.int64)

    @property
    def flat(self) -> list[torch.Tensor]:
        """Each layer's extended q/k/v weight, then (rows) each layer's extended o weight, as
        flat storage (what `segments` addresses: the pool's scatter writes blocks through
        these)."""
        return [_flat(e) for e in self.ext] + [_flat(e.t()) for e in self.o_ext]

    def assign(self, slot: int, rank: int, targets_qkv: bool, targets_o: bool = False) -> int:
        """Give the adapter placed in `slot` a block if it can have one (rank <= RANK_TILE, it
        targets q/k/v or, with rows, o, a block is free); returns it, or -1. Host bookkeeping:
        the pool writes the block (`segments`) and the device's col_slot entry with the rest of
        the slot."""
        if rank > RANK_TILE or not (targets_qkv or (self.rows and targets_o)):
            return -1
        with self._lock:
            if not self._free:
                return -1
            c = self._free.pop()
        self.col_host[slot] = c
        return c

    def segments(self, c: int, segs: np.ndarray, qkv_a: np.ndarray, rank: int,
                 o_b: np.ndarray | None = None) -> np.ndarray:
        """kernels.adapter_scatter rows that write block c: each q/k/v A the adapter has (its
        pool segment in `segs`, index qkv_a[layer, slice]), copied to its 16 rows of the block
        in layer l's extended weight (dsts index 1 + l), and zeros in the rows past the rank
        and in the rows of slices it lacks. In (layer, slice) order, the copy before the zeros;
        then, with rows, the o Bt rows the same way (o_b [L]: the pool segment of each o B).
        Array work only (a placement runs it beside the engine thread's step work)."""
        from kernels import adapter_scatter as sc
        if not self.ext:
            return np.zeros((0, sc.NFIELDS), dtype=np.int64)
        qkv = self._qkv_segments(c, segs, qkv_a, rank)
        if not self.rows:
            return qkv
        if o_b is None:
            o_b = np.full(len(self.ext), -1, dtype=np.int64)
        return np.concatenate([qkv, self._o_segments(c, segs, o_b, rank)])

    def _o_segments(self, c: int, segs: np.ndarray, o_b: np.ndarray, rank: int) -> np.ndarray:
        """Block c's o Bt rows in each layer's o_ext: the pool's B segment (B [N, r] read row by
        row) written to columns k_o + c * 16 .. + r, zeros in the columns past the rank (all 16
        where the adapter lacks o in that layer)."""
        from kernels import adapter_scatter as sc
        geo = self._geo_o                                    # [L, 4]: dst, N, k stride, n stride
        first = self.k_o + c * RANK_TILE
        has = o_b >= 0
        rows = np.zeros((len(o_b), 2, sc.NFIELDS), dtype=np.int64)
        copy, zero = rows[:, 0], rows[:, 1]
        copy[:] = segs[np.maximum(o_b, 0)]
        copy[:, sc.DST] = geo[:, 0]
        copy[:, sc.DST_OFF] = first * geo[:, 2]
        copy[:, sc.DST_RS], copy[:, sc.DST_CS] = geo[:, 3], geo[:, 2]
        zero[:, sc.DST] = geo[:, 0]
        zero[:, sc.DST_OFF] = np.where(has, first + rank, first) * geo[:, 2]
        zero[:, sc.ROWS] = geo[:, 1]
        zero[:, sc.COLS] = np.where(has, RANK_TILE - rank, RANK_TILE)
        zero[:, sc.DST_RS], zero[:, sc.DST_CS] = geo[:, 3], geo[:, 2]
        zero[:, sc.FOLD], zero[:, sc.FLAGS] = -1, sc.ZERO
        keep = np.stack([has, zero[:, sc.COLS] > 0], axis=-1)
        return rows[keep]

    def _qkv_segments(self, c: int, segs: np.ndarray, qkv_a: np.ndarray,
                      rank: int) -> np.ndarray:
        from kernels import adapter_scatter as sc
        geo = self._geo                                      # [L, 4]: dst, k, d_rs, d_cs
        n_layers, n_sl = len(self.ext), self.n_slices
        base = self.n_base + (c * n_sl + np.arange(n_sl)) * RANK_TILE          # [J]
        has = qkv_a >= 0                                                        # [L, J]
        rows = np.zeros((n_layers, n_sl, 2, sc.NFIELDS), dtype=np.int64)
        d_rs, d_cs = geo[:, 2:3], geo[:, 3:4]                                   # [L, 1]
        copy = rows[:, :, 0]
        copy[:] = segs[np.maximum(qkv_a, 0)]
        copy[..., sc.DST] = geo[:, 0:1]
        copy[..., sc.DST_OFF] = base * d_rs
        copy[..., sc.DST_RS], copy[..., sc.DST_CS] = d_rs, d_cs
        zero = rows[:, :, 1]
        first = np.where(has, base + rank, base)
        zero[..., sc.DST] = geo[:, 0:1]
        zero[..., sc.DST_OFF] = first * d_rs
        zero[..., sc.ROWS] = np.where(has, RANK_TILE - rank, RANK_TILE)
        zero[..., sc.COLS] = geo[:, 1:2]
        zero[..., sc.DST_RS], zero[..., sc.DST_CS] = d_rs, d_cs
        zero[..., sc.FOLD], zero[..., sc.FLAGS] = -1, sc.ZERO
        keep = np.stack([has, zero[..., sc.ROWS] > 0], axis=-1)
        return rows[keep]

    def release(self, slot: int) -> None:
        """Free the slot's block (the caller guarantees no step uses the slot). Host only: the
        device's col_slot entry is rewritten by the slot's next placement."""
        c = int(self.col_host[slot])
        if c < 0:
            return
        self.col_host[slot] = -1
        with self._lock:
            self._free.append(c)

    def covers(self, slots: np.ndarray) -> bool:
        """Whether every one of these adapter slots (at least one) has a block."""
        return bool(len(slots)) and bool((self.col_host[slots] >= 0).all())


def _column_major(ext: torch.Tensor) -> bool:
    return ext.stride(0) == 1 and ext.shape[0] > 1


def _zeros_like_layout(w: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Zeros [n, k] in w's memory layout: column-major ([k, n] in memory) when w is."""
    if _column_major(w):
        return torch.zeros(k, n, dtype=w.dtype, device=w.device).t()
    return torch.zeros(n, k, dtype=w.dtype, device=w.device)


def _flat(e: torch.Tensor) -> torch.Tensor:
    """A row- or column-major matrix's storage as a flat view."""
    return e.t().view(-1) if _column_major(e) else e.view(-1)
