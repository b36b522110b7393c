"""A step's LoRA choices, made in one place from its rows' adapter slots (`choose`): which
projection groups run LoRA, the SGMV rank bound (for a step replayed from a graph, the rank tile
of its own adapters: kernels.sgmv_choice.rank_tile) and whether q/k/v run as column LoRA. The
step-input builder (services.worker.executor.step_inputs.StepBuilder.plan) asks once a step; the
graph runner picks the graph to replay by them; the model reads them in the step's LoraMeta.
"""
from __future__ import annotations

import numpy as np

from kernels.sgmv_choice import rank_tile
from services.worker.model.lora_columns import LoraColumns
from services.worker.model.lora_tables import LoraTables
from services.worker.model.spec import GROUP_BIT


def choose(tables: LoraTables | None, columns: LoraColumns | None, slots: np.ndarray,
           graph: bool) -> tuple[int, int, bool]:
    """A step's LoRA choices from its rows' adapter slots (-1 = base only): (group mask, rank
    bound, column LoRA). The rank bound of a graph step is the rank tile of the largest rank
    among its own adapters (graphs are captured per tile); an eager step's is the pool's
    largest rank. Column LoRA when every q/k/v adapter among them (and, when the blocks hold o
    rows too, every o adapter) has a column block."""
    if tables is None:
        return 0, 0, False
    live = slots[slots >= 0]
    if not len(live):
        return 0, 0, False
    groups = tables.slot_groups[live]
    mask = int(np.bitwise_or.reduce(groups))
    if not mask:
        return 0, 0, False
    cols = False
    if columns is not None:
        need = GROUP_BIT["qkv"] | (GROUP_BIT["o"] if columns.rows else 0)
        cols = columns.covers(live[(groups & need) != 0])
    rank = rank_tile(int(tables.ranks_host[live].max())) if graph else tables.max_rank
    return mask, rank, cols
