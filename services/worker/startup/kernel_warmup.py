"""The warm-up's kernel witnesses: one LoRA call of each class a step of this worker can make.

Which specializations the LoRA kernels launch depends on the batch (its rows, its segments, the
pool's rank tile; kernels.sgmv_space says how); the warm-up's engine steps meet many of them, but
not every (rows, segments) pair: their decode rows and prompt lengths go together. So after
them the warm-up walks the calls a step can make, from 1 to --max-running sequences over up to
--max-batch-tokens rows, any mix of adapters of ranks up to its own rank bound, every projection
group and LoRA path the model has (kernels.sgmv_space.witnesses), and makes the first call of
each class (a `Witness`): zeros laid out as the model lays a step out (LlamaModel.lora_witness)
with every segment base-only, so the kernels find no work. A class the engine steps met costs a
launch of a compiled kernel; one they did not is compiled (or loaded from the kernel cache)
here, before SERVING, and not on the first step that needs it.
"""
from __future__ import annotations

import torch

from kernels import pdl
from kernels.sgmv_space import Space, Witness
from services.worker.executor.step_inputs import InputBuffers, device_segments
from services.worker.model.lora_columns import RANK_TILE as COLUMN_RANK_TILE
from services.worker.model.spec import ALL_GROUPS, FUSED, GROUPS, MODULE_GROUP
from services.worker.model.step_context import LoraMeta


def space_of(model, pool, max_tokens: int, max_running: int, max_rank: int) -> Space | None:
    """The LoRA calls this model's steps can make over the pool's adapters: steps of up to
    max_tokens rows and max_running sequences (a segment each at most, and no more than the
    pool's slots and the base rows'), ranks up to max_rank; None without an adapter pool."""
    tables = getattr(pool, "tables", None)
    if tables is None:
        return None
    s = model.spec
    targeted = {FUSED[m] if m in FUSED else MODULE_GROUP[m][0] for m in s.lora_targets}
    groups = tuple((g, s.in_out(mods[0])[0], len(mods)) for g, mods in GROUPS.items()
                   if g in targeted)
    cols = model.columns if model.columns is not None and model.columns.n_cols else None
    return Space(max_tokens=max_tokens, max_segs=min(max_running, pool.max_slots + 1),
                 max_rank=max_rank, groups=groups, dtype=model.dtype,
                 pdl=pdl.enabled(model.device),
                 columns=(cols.n_slices, COLUMN_RANK_TILE) if cols is not None else (0, 0),
                 rows=model.row_max_rows if cols is not None and cols.rows else 0)


def launch(model, tables, buffers: InputBuffers, witnesses: list[Witness]) -> None:
    """Each witness's call, on zeros over base-only segments (the first of one row each, the
    last of the rest: the kernels' specializations do not depend on where rows fall) in the
    eager steps' segment buffer (the same views, so the same alignments, as a step's)."""
    dev = model.device
    for w in witnesses:
        seg_start, seg_slot = device_segments(buffers, w.segs)
        seg_start.copy_(torch.tensor([*range(w.segs), w.rows], dtype=torch.int32))
        seg_slot.fill_(-1)
        meta = LoraMeta(seg_start, seg_slot, ALL_GROUPS, w.rank, w.path == "columns", tables)
        model.lora_witness(w.path, w.group, meta, w.rows)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
