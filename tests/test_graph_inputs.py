"""The CUDA-graph decode path fills static buffers itself; on CPU (no graphs) check that what it
writes for the live rows is exactly what the eager step builder computes, and that padding rows
are inert (no KV slot, no attention, no LoRA segment)."""
from __future__ import annotations

import numpy as np
import torch

from services.worker.engine.scheduler import Scheduled
from services.worker.engine.sequence import Sequence
from services.worker.engine.step_profile import StepShape
from services.worker.executor.graph_runner import GraphRunner
from services.worker.executor.lora_choice import choose
from services.worker.executor.step_inputs import step_shape
from services.worker.model.spec import ALL_GROUPS, GROUP_BIT
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
    segments = g.inputs.fill(g.steps.plan(batch, graph=True), 8)
    n = len(seqs)
    # what launch records of the step (step profile): its rows, no prompt tokens, the distinct
    # adapters of its rows (base rows are none), as the eager step's record says too
    adapters = len({q.slot for q in seqs if q.slot >= 0})
    assert adapters >= 2 and any(q.slot < 0 for q in seqs)
    plan = g.steps.plan(batch, graph=True)
    assert step_shape("decode-graph", plan, segments, None) == StepShape("decode-graph", n, 0,
                                                                         adapters)
    assert eager.shape == StepShape("eager", n, 0, adapters)
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


def test_a_mixed_step_from_the_graph_buffers_gives_the_eager_logits(hf_ckpt):
    """A mixed step (decode rows on adapters and the base model, a prompt's last chunk, and a
    chunk that does not end its prompt) written into the graph runner's static buffers, padded to
    its mixed graph's token count, gives through the model the eager step's logits for every
    sampling row, in the same order; the padding rows write no KV slot and attend nothing, and
    the sample rows past the live ones read row 0."""
    root, _, _ = hf_ckpt
    built, slots = _engine(root)
    runner = built.engine.runner
    names = list(slots)
    blocks = built.engine.scheduler.blocks
    batch = []
    for i in range(6):                                   # decode rows
        seq = Sequence(f"d{i}", list(range(3, 9 + 3 * i)),
                       slot=slots[names[i % len(names)]] if i % 3 else -1)
        assert blocks.ensure(seq, len(seq.tokens))
        seq.num_computed = len(seq.tokens) - 1
        batch.append(Scheduled(seq, 1))
    last = Sequence("p-last", list(range(5, 18)), slot=slots[names[0]])
    assert blocks.ensure(last, len(last.tokens))
    batch.append(Scheduled(last, len(last.tokens)))      # a whole prompt: samples
    part = Sequence("p-part", list(range(7, 40)), slot=-1)
    assert blocks.ensure(part, 12)
    batch.append(Scheduled(part, 12))                    # the first 12 of 33: no sample
    g = GraphRunner(runner)
    size = g.mixed_size(batch)
    assert size == 64 and g.mixed_seqs(size) >= len(batch)
    eager = runner.steps.eager(batch, runner.buffers)
    want = runner.model.forward(eager.input_ids, eager.ctx, runner.kv_cache)
    plan = g.steps.plan(batch, graph=True)
    sampled, shape = g.fill_mixed(plan, size)
    # the step's record: its sequences, the tokens of its two prompt chunks, its adapters
    adapters = len({b.seq.slot for b in batch if b.seq.slot >= 0})
    assert shape == StepShape("mixed-graph", len(batch), len(last.tokens) + 12, adapters)
    assert eager.shape == shape._replace(kind="eager")
    assert [b.seq.request_id for b in sampled] == [b.seq.request_id for b in eager.sampled]
    assert "p-part" not in {b.seq.request_id for b in sampled}
    ctx = g._ctx_mixed(size, plan.mask, plan.rank, plan.columns)
    got = runner.model.forward(g.ids[:size], ctx, runner.kv_cache)
    assert got.shape[0] == g.mixed_seqs(size)
    torch.testing.assert_close(got[:len(sampled)], want, rtol=1e-4, atol=1e-4)
    t = sum(b.num_tokens for b in batch)
    assert (ctx.slot_mapping[t:] == -1).all() and (ctx.q_seq[t:] == -1).all()
    assert (ctx.sample_rows[len(sampled):] == 0).all()
    assert g.mixed_size(batch + [Scheduled(part, 64)]) is None          # too many tokens


def test_mixed_graph_sizes_take_the_budget_and_the_warm_up_turns_them_off(hf_ckpt):
    """The mixed graphs' token counts end at the step budget (a full-budget step is the usual one
    under a backlog of prompts), none with --graph-mixed-tokens 0; they serve steps only once
    captured, and the warm-up's eager_mixed turns them off for its duration, through a
    FaultyRunner wrapper too."""
    from services.worker.executor.fault_inject import FaultyRunner
    root, _, _ = hf_ckpt
    built, _ = _engine(root)
    runner = built.engine.runner
    assert GraphRunner(runner).mixed_sizes == [64]
    assert GraphRunner(runner, mixed_tokens=40).mixed_sizes == [40]
    assert GraphRunner(runner, mixed_tokens=0).mixed_sizes == []
    g = GraphRunner(runner)
    assert not g.mixed_on                     # nothing captured
    g.mixed_on = True
    with FaultyRunner(g, 1000).eager_mixed():
        assert not g.mixed_on
    assert g.mixed_on


def test_a_launched_steps_sampling_and_collect_on_cpu_tensors():
    """graph_inputs.start_sampling then collect: each sampling row's greedy token (and its
    logprobs when asked), in the batch's order, through the host buffer it was given; a step
    that sampled nothing collects nothing."""
    from services.worker.engine.sequence import Sampling
    from services.worker.executor.graph_inputs import collect, start_sampling
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.5], [2.0, 0.0, 1.0, 0.0]])
    rows = []
    for i in range(2):
        seq = Sequence(f"s{i}", [1, 2, 3], sampling=Sampling(logprobs=1))
        seq.num_computed = 2
        rows.append(Scheduled(seq, 1))
    host = torch.zeros(8, dtype=torch.int64)
    batch, tokens, lps = collect(start_sampling(rows, logits, None, (), host))
    assert batch == rows and tokens == [1, 0] and host[:2].tolist() == [1, 0]
    want = torch.log_softmax(logits, -1)
    assert [round(lp[0], 5) for lp in lps] == [round(float(want[0, 1]), 5),
                                               round(float(want[1, 0]), 5)]
    assert collect(start_sampling([], logits[:0], None, (), host)) == ([], [], None)
