"""Each model family the worker serves against transformers + PEFT (issue 47): a tiny random
checkpoint of the family (transformers' own config class) and three PEFT adapters (different
ranks and targets, one on the MLP only); a mixed batch of every adapter and the base, run
concurrently by the engine, gives every request the greedy tokens transformers + PEFT's
`generate` gives it alone, and the prefill logits agree to 1e-4 in fp32.

Prompts are longer than the sliding windows (Mistral, Phi-3, Gemma 3: windows of 16-24 tokens)
and than the original RoPE length (yarn: 32, dynamic NTK: 32), and most take several prefill
chunks (64-token steps), so chunked prefill meets the windows too.

gemma3-mm is Gemma 3 4B/12B/27B's form, Gemma3ForConditionalGeneration (the same text model
as text_config, beside a SigLIP vision tower), served as its text model against transformers'
multimodal model on text input_ids: its adapters, made by PEFT on the multimodal model, carry
the vision tower's LoRA tensors too (short target names, all-linear), and one is saved under
the older naming (tests/family_fixtures.py)."""
from __future__ import annotations

import pytest
import torch

from services.worker.adapters.layout import staged_from_peft_dir
from services.worker.engine.scheduler import Scheduled
from services.worker.engine.sequence import Sequence, Stopping
from services.worker.model.spec import load_spec
from services.worker.perf_config import PerfConfig
from services.worker.config import EngineOptions
from services.worker.startup.factory import build_engine
from tests.family_fixtures import hf_greedy, make_family, reset_rope
from tests.test_engine_parity import run_all

# family -> (prompt lengths: first, step; new tokens)
CASES = {
    "qwen3": ((5, 9), 8),
    "phi3": ((5, 9), 8),
    "qwen3-yarn": ((20, 13), 8),
    "mistral-window": ((10, 11), 10),
    "phi3-window": ((10, 11), 10),
    "gemma3": ((10, 11), 10),
    "gemma3-mm": ((10, 11), 10),
    "qwen2-dynamic": ((10, 7), 10),
}


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    name = request.param
    return (name, *make_family(tmp_path_factory.mktemp(name), name, seed=len(name)))


def _engine(root, perf: PerfConfig | None = None, max_batch_tokens: int = 64):
    opts = EngineOptions(device="cpu", dtype="float32", kv_cache_bytes=4 << 20, block_size=4,
                         max_batch_tokens=max_batch_tokens, perf=perf or PerfConfig())
    built = build_engine(root / "base", opts)
    slots = {p.name: built.pool.place(p.name, staged_from_peft_dir(p, built.spec))
             for p in sorted((root / "adapters").iterdir())}
    return built, slots


def test_mixed_batch_matches_peft_greedy(family):
    """Every adapter and base rows, twice each, in one concurrent batch."""
    name, root, base, peft = family
    built, slots = _engine(root)
    (first, step), new = CASES[name]
    g = torch.Generator().manual_seed(len(name))
    seqs, expected = [], {}
    for i, adapter in enumerate([*peft, None, *peft, None]):
        ids = torch.randint(2, 256, (first + step * i,), generator=g).tolist()
        rid = f"req{i}-{adapter}"
        seqs.append(Sequence(rid, ids, slot=slots[adapter] if adapter else -1,
                             stopping=Stopping(max_new_tokens=new, ignore_eos=True)))
        expected[rid] = hf_greedy(peft[adapter] if adapter else base, ids, new)
    got, _ = run_all(built.engine, seqs)
    assert got == expected


def test_prefill_logits_match_peft(family):
    """The last position's logits of each adapter's prompt, all in one prefill step (fp32)."""
    name, root, base, peft = family
    built, slots = _engine(root, max_batch_tokens=128)      # four adapters' prompts: 78 tokens
    runner = built.engine.runner
    prompts = {a: [(7 * i + 3 * j) % 250 + 2 for j in range(12 + 5 * i)]
               for i, a in enumerate(peft)}
    seqs = [Sequence(a, p, slot=slots[a]) for a, p in prompts.items()]
    for s in seqs:
        assert built.engine.scheduler.blocks.ensure(s, len(s.tokens))
    inputs = runner.steps.eager([Scheduled(s, len(s.tokens)) for s in seqs], runner.buffers)
    logits = runner.model.forward(inputs.input_ids, inputs.ctx, runner.kv_cache)
    for row, entry in enumerate(inputs.sampled):
        a = entry.seq.request_id
        reset_rope(peft[a])
        with torch.no_grad():
            ref = peft[a](torch.tensor([prompts[a]])).logits[0, -1]
        torch.testing.assert_close(logits[row], ref, atol=1e-4, rtol=1e-4)


def test_adapters_change_the_output(family):
    """Guards the parity tests: every adapter moves the logits away from the base's."""
    _, _, base, peft = family
    ids = torch.tensor([list(range(5, 30))])
    with torch.no_grad():
        ref = base(ids).logits[0, -1]
        for a, model in peft.items():
            assert (model(ids).logits[0, -1] - ref).abs().max() > 1e-2, a


def test_windows_matter(family):
    """Guards the window families' parity: without the windows the logits of a prompt longer
    than them differ (the engine with its layers' windows set to 0)."""
    name, root, _, _ = family
    built, _ = _engine(root)
    if not built.spec.windows:
        pytest.skip("no sliding window")
    prompt = [(5 * j) % 250 + 2 for j in range(60)]
    model = built.engine.runner.model
    got = []
    for windows in (model.windows, [0] * len(model.windows)):
        model.windows = windows
        seq = Sequence("w", prompt)
        assert built.engine.scheduler.blocks.ensure(seq, len(prompt))
        runner = built.engine.runner
        inputs = runner.steps.eager([Scheduled(seq, len(prompt))], runner.buffers)
        got.append(model.forward(inputs.input_ids, inputs.ctx, runner.kv_cache)[0])
        built.engine.scheduler.blocks.free(seq)
    assert (got[0] - got[1]).abs().max() > 1e-3


def test_the_warm_up_runs_the_family(family):
    """The warm-up's zero adapters take the family's targets (Phi-3's fused projections) and
    every set runs through the family's first layer; the pool and the KV cache are left as
    they were."""
    from services.worker.startup.warmup import Warmup, zero_adapter
    name, root, _, _ = family
    if name not in ("phi3", "gemma3", "qwen2-dynamic"):     # the others: Llama's layer shapes
        pytest.skip("covered by the families of the same layer")
    built = build_engine(root / "base", EngineOptions(device="cpu", dtype="float32",
                                                      max_batch_tokens=16, max_running=4,
                                                      pool_slots=6, block_size=4))
    assert zero_adapter(built.spec, 8).plan.groups_mask == 0b1111      # every group
    report = Warmup(built.engine, built.pool, built.spec, 16, max_rank=16, max_running=4).run()
    assert report.steps > 0
    assert built.pool.free_bytes == built.pool.capacity_bytes
    sched = built.engine.scheduler
    assert not sched.running and not sched.waiting and sched.blocks.used_fraction == 0.0


def test_spec_reads_the_family(family):
    name, root, _, _ = family
    spec = load_spec(root / "base")
    want = {"qwen3": ("Qwen3ForCausalLM", True, ()),
            "phi3": ("Phi3ForCausalLM", False, ()),
            "qwen3-yarn": ("Qwen3ForCausalLM", True, ()),
            "mistral-window": ("MistralForCausalLM", False, (16, 16)),
            "phi3-window": ("Phi3ForCausalLM", False, (24, 24)),
            "gemma3": ("Gemma3ForCausalLM", True, (16, 0, 16, 0)),
            "gemma3-mm": ("Gemma3ForConditionalGeneration", True, (16, 0, 16, 0)),
            "qwen2-dynamic": ("Qwen2ForCausalLM", False, ())}[name]
    assert (spec.architecture, spec.qk_norm, spec.windows) == want
    if name.startswith("phi3"):
        assert spec.lora_targets == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    if name.startswith("gemma3"):
        assert spec.gemma_norms and spec.act == "gelu_pytorch_tanh"
        assert spec.rope_local == (10_000.0, None) and spec.rope_theta == 1_000_000.0
        assert spec.tie_word_embeddings and spec.scale == 24 ** -0.5
        # transformers' multimodal head applies no final_logit_softcapping (text_config's 3.0)
        assert spec.final_softcap == (0 if name == "gemma3-mm" else 3)
        assert spec.multimodal == (name == "gemma3-mm")
