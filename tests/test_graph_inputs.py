"""The CUDA-graph decode path fills static buffers itself; on CPU (no graphs) check that what it
writes for the live rows is exactly what the eager step builder computes, and that padding rows
are inert (no KV slot, no attention, no LoRA segment)."""
from __future__ import annotations

import torch

from services.worker.graph_runner import GraphRunner
from services.worker.model_spec import ALL_GROUPS, GROUP_BIT
from services.worker.scheduler import Scheduled
from services.worker.sequence import Sequence
from services.worker.step_inputs import build
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
    eager = build(batch, runner.buffers, runner.block_size)
    g = GraphRunner(runner, sizes=(8,))
    ordered = sorted(batch, key=lambda x: (x.seq.slot < 0, x.seq.slot, x.seq.arrival))
    g._fill(ordered, 8)
    n = len(seqs)
    ctx = g._ctx(8, ALL_GROUPS)
    assert torch.equal(g.ids[:n], eager.input_ids)
    assert torch.equal(ctx.positions[:n], eager.ctx.positions)
    assert torch.equal(ctx.slot_mapping[:n], eager.ctx.slot_mapping)
    assert torch.equal(ctx.q_seq[:n].long(), torch.arange(n))
    mb = eager.ctx.block_tables.shape[1]
    assert torch.equal(ctx.block_tables[:n, :mb], eager.ctx.block_tables)
    g_segs = eager.ctx.seg_slot.shape[0]
    assert torch.equal(ctx.seg_slot[:g_segs], eager.ctx.seg_slot)
    assert torch.equal(ctx.seg_start[:g_segs + 1], eager.ctx.seg_start)
    assert (ctx.slot_mapping[n:] == -1).all() and (ctx.q_seq[n:] == -1).all()
    assert (ctx.seg_slot[g_segs:] == -1).all() and (ctx.seg_start[g_segs:] == n).all()


def test_lora_mask_names_the_groups_the_batch_targets(hf_ckpt):
    """A step runs LoRA only for the groups its adapters target (a graph per mask on GPU); the
    mask follows placement and removal."""
    root, _, _ = hf_ckpt
    built, slots = _engine(root)
    model, bit = built.engine.runner.model, GROUP_BIT
    assert model.lora_mask([]) == model.lora_mask([-1, -1]) == 0
    assert model.lora_mask([slots["r1-attn"]]) == bit["qkv"]
    assert model.lora_mask([slots["r8-rslora"], -1]) == bit["qkv"] | bit["o"]
    assert model.lora_mask([slots["r16-layers"]]) == (bit["qkv"] | bit["o"] | bit["gate_up"]
                                                       | bit["down"])
    assert model.lora_mask([slots["r1-attn"], slots["r64-all"]]) == ALL_GROUPS
    built.pool.remove("r1-attn")
    assert model.lora_mask([slots["r1-attn"]]) == 0
