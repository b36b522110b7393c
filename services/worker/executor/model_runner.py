"""The only part of the engine that touches the device: KV cache, model forward, sampling.

`ModelRunner` runs each step eagerly and waits for it (a Runner of services.worker.engine.loop
that launches nothing ahead); services.worker.executor.graph_runner replays decode and mixed
steps from CUDA graphs over it, and runs the others through it."""
from __future__ import annotations

import logging

import torch

from services.worker.engine.scheduler import Scheduled
from services.worker.engine.step_profile import StepShape
from services.worker.executor.graph_inputs import PendingStep, collect
from services.worker.executor.sampling import pack_logprobs, sample, unpack_logprobs
from services.worker.executor.step_inputs import InputBuffers, StepBuilder
from services.worker.model.llama import LlamaModel
from services.worker.model.lora_columns import LoraColumns
from services.worker.model.lora_tables import LoraTables
from services.worker.model.spec import ModelSpec

log = logging.getLogger(__name__)


def kv_blocks_for_budget(spec: ModelSpec, budget_bytes: int, block_size: int,
                         dtype: torch.dtype) -> int:
    """How many KV blocks fit in a byte budget (K and V, every layer)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    per_block = 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem
    return max(1, budget_bytes // per_block)


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 max_batch_tokens: int, max_running: int, max_model_len: int,
                 lora: LoraTables | None = None, columns: LoraColumns | None = None,
                 kv_dtype: torch.dtype | None = None):
        """lora: the adapter pool's tables (services.worker.adapters.device_pool), columns: its
        column blocks; the step builder reads them and hands them to the model with each step.
        kv_dtype: the KV cache's (default the model's; torch.float8_e4m3fn: --kv-cache-dtype
        fp8, which the attention kernels read back in the model's dtype)."""
        spec, dev, dt = model.spec, model.device, kv_dtype or model.dtype
        self.model, self.block_size = model, block_size
        self.steps = StepBuilder(block_size, lora, columns, eos=tuple(spec.eos_token_ids))
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_cache = [(torch.zeros(shape, dtype=dt, device=dev),
                          torch.zeros(shape, dtype=dt, device=dev))
                         for _ in range(spec.num_layers)]
        max_blocks = -(-max_model_len // block_size)
        self.buffers = InputBuffers(max_batch_tokens, max_running, max_blocks, dev)
        # structured output's TokenMasks (services.worker.startup.factory.assemble): the grammar
        # rows' masks, applied before sampling, and their matchers fed the sampled tokens
        self.masks = None
        self.shape: StepShape | None = None       # what the last run's step was
        log.info("KV cache: %d blocks x %d tokens (%.1f MiB, %s) on %s", num_blocks,
                 block_size, 2 * spec.num_layers * self.kv_cache[0][0].numel()
                 * self.kv_cache[0][0].element_size() / 2**20, str(dt).replace("torch.", ""),
                 dev)

    def launch(self, batch: list[Scheduled], prev: PendingStep | None = None) -> None:
        """Nothing is launched ahead: an eager step is run and waited for (run)."""
        return None

    collect = staticmethod(collect)         # the Runner protocol's (never called: no launch)

    def run(self, batch: list[Scheduled]) -> tuple[list[Scheduled], list[int], list | None]:
        """One forward pass; returns the entries that sampled, their new token ids, and their
        logprobs when some row asked (see sampling.unpack_logprobs; else None)."""
        inputs = self.steps.eager(batch, self.buffers)
        self.shape = inputs.shape
        logits = self.model.forward(inputs.input_ids, inputs.ctx, self.kv_cache)
        if inputs.prompt_rows is not None:           # the first rows: prompt logprobs
            e = len(inputs.prompt_targets)
            _prompt_logprobs(logits[:e], inputs.prompt_rows, inputs.prompt_targets)
            logits = logits[e:]
        if not inputs.sampled:
            return [], [], None
        masks = self.masks if inputs.sampling.constrained else None
        if masks is not None:                 # grammar rows: built while the device runs
            inputs.sampling.allowed = masks.build(inputs.sampled)
        tokens = sample(logits, inputs.sampling)
        k = inputs.sampling.logprobs
        if k < 0:
            out = inputs.sampled, tokens.tolist(), None         # the step's one host sync
        else:
            rows = pack_logprobs(logits, tokens, k).tolist()    # ... with the logprobs in it
            out = (inputs.sampled, [int(r[0]) for r in rows],
                   unpack_logprobs(rows, [b.seq.sampling.logprobs for b in inputs.sampled]))
        if masks is not None:                 # the grammar rows' matchers see their tokens
            masks.advance(out[0], out[1])
        return out


def _prompt_logprobs(logits: torch.Tensor, per: list[tuple], targets) -> None:
    """Each asking sequence's prompt logprobs of this step's rows, appended to its prompt_lps
    (the engine hands them on with its first token): per row (token, logprob, top)."""
    k = max(seq.sampling.prompt_logprobs for seq, _ in per)
    ids = torch.as_tensor(targets, device=logits.device)
    rows = pack_logprobs(logits, ids, k).tolist()        # one host sync, asked for
    at = 0
    for seq, n in per:
        for r, lp in zip(rows[at:at + n], unpack_logprobs(rows[at:at + n],
                                                           [seq.sampling.prompt_logprobs] * n)):
            seq.prompt_lps.append((int(r[0]), *lp))
        at += n

