"""The CUDA-graph decode path fills static buffers itself; on CPU (no graphs) check that what it
writes for the live rows is exactly what the eager step builder computes, and that padding rows
are inert (no KV slot, no attention, no LoRA segment)."""
from __future__ import annotations

import numpy as np
import torch

from services.worker.graph_runner import GraphRunner
from services.worker.lora_meta import choose
from services.worker.model_spec import ALL_GROUPS, GROUP_BIT
from services.worker.scheduler import Scheduled
from services.worker.sequence import Sequence
from tests.test_engine_parity import _engine


def test_graph_fill_matches_eager_build(hf_ckpt):
    root, _, _ = hf_ckpt
    built, slots = _engine(root)
    runner = built.engine.runner
    names = list(slots)
    seqs = []
    for i in range(5):
        slot = slots[names[i % len(names)]] if i % 3 else -1
        seq = Sequence(f"s{i}", list(range(3, 10 + 4 * i)), slot=slot)
        assert built.engine.scheduler.blocks.ensure(seq, len(seq.tokens))
        seq.num_computed = len(seq.tokens) - 1                        # decoding
        seqs.append(seq)
    batch = [Scheduled(s, 1) for s in seqs]
    eager = runner.steps.eager(batch, runner.buffers)
    g = GraphRunner(runner, sizes=(8,))
    g._fill(g.steps.plan(batch, graph=True), 8)
    n = len(seqs)
    ctx = g._ctx(8, ALL_GROUPS)
    assert torch.equal(g.ids[:n], eager.input_ids)
    assert torch.equal(ctx.positions[:n], eager.ctx.positions)
    assert torch.equal(ctx.slot_mapping[:n], eager.ctx.slot_mapping)
    assert torch.equal(ctx.q_seq[:n].long(), torch.arange(n))
    mb = eager.ctx.block_tables.shape[1]
    assert torch.equal(ctx.block_tables[:n, :mb], eager.ctx.block_tables)
    lora, eager_lora = ctx.lora, eager.ctx.lora
    g_segs = eager_lora.seg_slot.shape[0]
    assert torch.equal(lora.seg_slot[:g_segs], eager_lora.seg_slot)
    assert torch.equal(lora.seg_start[:g_segs + 1], eager_lora.seg_start)
    assert (ctx.slot_mapping[n:] == -1).all() and (ctx.q_seq[n:] == -1).all()
    assert (lora.seg_slot[g_segs:] == -1).all() and (lora.seg_start[g_segs:] == n).all()
    # the same choices, but the graph's rank tile against the pool's largest rank
    plan, graph_plan = runner.steps.plan(batch, graph=False), g.steps.plan(batch, graph=True)
    assert (plan.mask, plan.columns) == (eager_lora.mask, eager_lora.columns) == (
        graph_plan.mask, graph_plan.columns)
    assert eager_lora.rank == built.pool.tables.max_rank == 64 and graph_plan.rank == 64


def test_lora_mask_names_the_groups_the_batch_targets(hf_ckpt):
    """A step runs LoRA only for the groups its adapters target (a graph per mask on GPU); the
    mask follows placement and removal."""
    root, _, _ = hf_ckpt
    built, slots = _engine(root)
    steps, bit = built.engine.runner.steps, GROUP_BIT

    def lora_mask(slots):
        return choose(steps.tables, steps.columns, np.array(slots, dtype=np.int64), False)[0]
    assert lora_mask([]) == lora_mask([-1, -1]) == 0
    assert lora_mask([slots["r1-attn"]]) == bit["qkv"]
    assert lora_mask([slots["r8-rslora"], -1]) == bit["qkv"] | bit["o"]
    assert lora_mask([slots["r16-layers"]]) == (bit["qkv"] | bit["o"] | bit["gate_up"]
                                                | bit["down"])
    assert lora_mask([slots["r1-attn"], slots["r64-all"]]) == ALL_GROUPS
    built.pool.remove("r1-attn")
    assert lora_mask([slots["r1-attn"]]) == 0
    # the rank tiles a graph step takes: that of the largest rank among its own adapters
    graph = [choose(steps.tables, steps.columns, np.array(s, dtype=np.int64), True)[1]
             for s in ([-1], [slots["r8-rslora"]], [slots["r8-rslora"], slots["r64-all"]])]
    assert graph == [0, 16, 64]
