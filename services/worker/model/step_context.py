"""What every layer reads of one step (`StepContext`) and its LoRA part (`LoraMeta`: the step's
segments, its LoRA choices, made by services.worker.executor.lora_choice, and the pool's tables).

The step-input builder (services.worker.executor.step_inputs) makes one LoraMeta a step, over its
own segment tables (eager) or the graph runner's static ones (captured decode graphs); the model
reads the pool's tables through it (`args`) and passes each projection's LoRA to the kernels as a
kernels.sgmv.LoraArgs. The pool owns and writes the tables (services.worker.adapters.device_pool).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kernels.sgmv import LoraArgs
from kernels.sgmv_choice import HostSegments
from services.worker.model.lora_columns import RANK_TILE as COLUMN_RANK_TILE
from services.worker.model.lora_tables import LoraTables
from services.worker.model.spec import GROUP_BIT


@dataclass
class LoraMeta:
    """A step's LoRA: its segments over the rows (sorted by adapter slot), what runs, and the
    pool's tables it reads. mask 0: no LoRA launch at all (base rows only, or no pool)."""
    seg_start: torch.Tensor          # int32 [G+1] segment bounds over rows
    seg_slot: torch.Tensor           # int32 [G]   adapter slot per segment, -1 = base only
    mask: int = 0                    # GROUP_BIT of each group some row's adapter targets
    rank: int = 0                    # the SGMV rank bound: a graph's rank tile, else the pool's
    columns: bool = False            # q/k/v as column LoRA (services.worker.model.lora_columns)
    tables: LoraTables | None = None
    # (first row, end row, slot) of the only segment with an adapter, from the host's copy of
    # the segment table (eager steps; None with none or several, and in captured graphs)
    host_single: tuple[int, int, int] | None = None

    def runs(self, group: str) -> bool:
        """Whether this step launches the LoRA of projection group `group`."""
        return bool(self.mask & GROUP_BIT[group])

    def args(self, group: str, layer: int, slices: Sequence[int]) -> LoraArgs:
        """What the kernels read for group's LoRA in this layer (see kernels.sgmv.LoraArgs)."""
        t = self.tables
        host = None
        if self.host_single is not None and group in t.a_off_host:
            host = HostSegments(self.host_single, t.a_off_host[group][layer],
                                t.b_off_host[group][layer], t.ranks_host, t.scales_host)
        return LoraArgs(t.pool, t.a_layers[group][layer], t.b_layers[group][layer], t.ranks,
                        t.scales, slices, self.seg_start, self.seg_slot, self.rank, t.align,
                        host)

    def column_args(self, layer: int, slices: Sequence[int]) -> LoraArgs:
        """The q/k/v expand's arguments for column LoRA (rank tile: the blocks' RANK_TILE)."""
        t = self.tables
        qkv = t.b_layers["qkv"][layer]
        return LoraArgs(t.pool, qkv, qkv, t.ranks, t.scales, slices, self.seg_start,
                        self.seg_slot, COLUMN_RANK_TILE, t.align)

    def row_args(self, layer: int) -> LoraArgs:
        """The o shrink's arguments for row LoRA (kernels.sgmv.lora_shrink_rows: A offsets of
        o's one slice; rank tile: the blocks' RANK_TILE)."""
        t = self.tables
        o = t.a_layers["o"][layer]
        return LoraArgs(t.pool, o, o, t.ranks, t.scales, (0,), self.seg_start, self.seg_slot,
                        COLUMN_RANK_TILE, t.align)


@dataclass
class StepContext:
    """Per-step metadata. T = rows (tokens) this step, S = sequences, R = rows that sample."""
    positions: torch.Tensor     # int64 [T]   absolute position of each row's token
    slot_mapping: torch.Tensor  # int64 [T]   KV slot of each row (-1 = padding)
    block_tables: torch.Tensor  # int32 [S, MB]
    q_seq: torch.Tensor         # int32 [T]   row -> sequence index in block_tables
    q_pos: torch.Tensor         # int32 [T]   = positions, as the attention kernel wants it
    sample_rows: torch.Tensor | None  # int64 [R] rows whose logits are needed; None: all
    max_context: int            # host bound on positions + 1 (for sizing attention)
    lora: LoraMeta              # the step's LoRA segments, choices and the pool's tables
    # int64 [T] the length a dynamic-NTK RoPE scales each row's angles for: its prompt's
    # length for a prompt row, position + 1 after (services.worker.model.rope.dynamic_angles)
    rope_len: torch.Tensor | None = None
