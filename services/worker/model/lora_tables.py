"""The device view of the adapter pool that the model's LoRA kernels read: the pool owns and writes
it (services.worker.adapters.device_pool); the step-input builder hands it to the model with each
step (services.worker.model.step_context.LoraMeta)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class LoraTables:
    """Device view of the adapter pool that the SGMV kernel reads (see kernels.sgmv_ref)."""
    pool: torch.Tensor                 # [P] flat adapter storage
    a_off: dict[str, torch.Tensor]     # group -> int64 [L, n_slices, n_slots]
    b_off: dict[str, torch.Tensor]
    ranks: torch.Tensor                # int32 [n_slots]
    scales: torch.Tensor               # float32 [n_slots]
    max_rank: int
    # every offset (>= 0) in a_off and b_off is a multiple of this many elements (the device
    # pool's layout keeps 8): the SGMV kernels then load adapter weights in 16-byte vectors
    align: int = 1
    # host: GROUP_BIT mask of the groups each slot's adapter targets (0 = empty slot)
    slot_groups: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # host mirrors of a_off, b_off, ranks and scales (what the pool wrote to the device copies)
    a_off_host: dict[str, np.ndarray] = field(default_factory=dict)
    b_off_host: dict[str, np.ndarray] = field(default_factory=dict)
    ranks_host: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    scales_host: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))

    def __post_init__(self):
        # each layer's [n_slices, n_slots] offset views, made once (the model's LoRA calls
        # read them every step)
        self.a_layers = {g: list(t.unbind(0)) for g, t in self.a_off.items()}
        self.b_layers = {g: list(t.unbind(0)) for g, t in self.b_off.items()}
