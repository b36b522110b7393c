"""The engine against transformers + PEFT: mixed-adapter batches give every request the tokens
(and logits) it gets alone in Hugging Face."""
from __future__ import annotations

import pathlib

import pytest
import torch

from services.worker.adapters.layout import staged_from_peft_dir
from services.worker.config import EngineOptions
from services.worker.engine.sequence import Sequence, Stopping
from services.worker.perf_config import PerfConfig
from services.worker.startup.factory import build_engine
from tests.hf_fixtures import ADAPTER_SPECS


@pytest.fixture(scope="module")
def ckpt(hf_ckpt):
    """(root, base, {name: peft model}): conftest's session checkpoint."""
    return hf_ckpt


def _engine(root: pathlib.Path, **kw):
    kw.setdefault("perf", PerfConfig())
    opts = EngineOptions(device="cpu", dtype="float32", kv_cache_bytes=kw.pop("kv", 4 << 20),
                         block_size=kw.pop("block_size", 4), max_batch_tokens=64, **kw)
    built = build_engine(root / "base", opts)
    slots = {n: built.pool.place(n, staged_from_peft_dir(root / "adapters" / n, built.spec))
             for n in ADAPTER_SPECS}
    return built, slots


def run_all(engine, seqs):
    out = {s.request_id: [] for s in seqs}
    stops = {}
    def sink_for(rid):
        def sink(ev):
            out[rid].extend(ev.token_ids)
            if ev.stop:
                stops[rid] = ev.stop
        return sink
    for s in seqs:
        engine.submit(s, sink_for(s.request_id))
    for _ in range(10_000):
        if len(stops) == len(seqs):
            break
        engine.step()
    return out, stops


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return gen[0, len(prompt):].tolist()


@pytest.mark.parametrize("fold", ["1", "0"])
def test_mixed_batch_matches_peft_greedy(ckpt, monkeypatch, fold):
    """Every adapter (q/k/v, o and MLP targets; ranks 1-64) and base rows in one batch give
    PEFT's greedy tokens, with the in-layer norms folded into the GEMMs (the default) and
    without (PerfConfig.fold_norms off). The checkpoint's norm weights are not 1, so a norm
    weight the fold left out (of a GEMM or of an adapter's A) changes the tokens."""
    root = ckpt[0]
    built, slots = _engine(root, perf=PerfConfig(fold_norms=fold == "1"))
    assert built.engine.runner.model.norms.folded == (fold == "1")
    g = torch.Generator().manual_seed(7)
    names = [*ADAPTER_SPECS, None, *ADAPTER_SPECS, None]
    seqs, expected = mixed_requests(names, slots, ckpt, g, prompt=(3, 5), new=8)
    got, _ = run_all(built.engine, seqs)
    assert got == expected


def mixed_requests(names, slots, ckpt, g, prompt: tuple[int, int], new: int):
    """(sequences, PEFT's greedy tokens by request id): request i uses adapter names[i] (None:
    base) and a random prompt of prompt[0] + prompt[1] * i tokens."""
    _, base, peft_models = ckpt
    seqs, expected = [], {}
    for i, name in enumerate(names):
        ids = torch.randint(2, 256, (prompt[0] + prompt[1] * i,), generator=g).tolist()
        rid = f"req{i}-{name}"
        seqs.append(Sequence(rid, ids, slot=slots[name] if name else -1,
                             stopping=Stopping(max_new_tokens=new, ignore_eos=True)))
        expected[rid] = hf_greedy(peft_models[name] if name else base, ids, new)
    return seqs, expected


@pytest.mark.parametrize("fold", ["1", "0"])
def test_prefill_logits_match_peft(ckpt, fold):
    root, base, peft_models = ckpt
    built, slots = _engine(root, perf=PerfConfig(fold_norms=fold == "1"))
    from services.worker.engine.scheduler import Scheduled
    prompts = {n: list(range(5 + i, 17 + 2 * i)) for i, n in enumerate(ADAPTER_SPECS)}
    seqs = [Sequence(n, p, slot=slots[n]) for n, p in prompts.items()]
    runner = built.engine.runner
    for s in seqs:
        assert built.engine.scheduler.blocks.ensure(s, len(s.tokens))
    inputs = runner.steps.eager([Scheduled(s, len(s.tokens)) for s in seqs], runner.buffers)
    # the eager step knows on the host whether one adapter has all the LoRA rows (it has not)
    assert inputs.ctx.lora.host_single is None
    one = runner.steps.eager([Scheduled(seqs[0], len(seqs[0].tokens))], runner.buffers)
    assert one.ctx.lora.host_single == (0, len(seqs[0].tokens), slots[seqs[0].request_id])
    inputs = runner.steps.eager([Scheduled(s, len(s.tokens)) for s in seqs], runner.buffers)
    logits = runner.model.forward(inputs.input_ids, inputs.ctx, runner.kv_cache)
    for row, entry in enumerate(inputs.sampled):
        name = entry.seq.request_id
        with torch.no_grad():
            ref = peft_models[name](torch.tensor([prompts[name]])).logits[0, -1]
        torch.testing.assert_close(logits[row], ref, atol=1e-4, rtol=1e-4)


def test_folded_norms_launch_no_norm_in_a_layer(ckpt, monkeypatch):
    """With folded norms a forward pass runs one norm (the final one, before lm_head) and no
    residual add + norm; the q/k/v and gate/up weights hold g * W, and the pool's q/k/v and
    gate/up A matrices g * A (o's and down's as written)."""
    from services.worker.adapters.layout import staged_from_peft_dir
    from services.worker.model import norms as norms_mod
    calls = {"rms_norm": 0, "add_rms_norm": 0}
    for name in calls:
        real = getattr(norms_mod, name)

        def counting(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(norms_mod, name, counting)
    root = ckpt[0]
    built, slots = _engine(root, perf=PerfConfig(fold_norms=True))
    seqs, expected = mixed_requests(["r64-all", None], slots, ckpt, torch.Generator(),
                                    prompt=(4, 2), new=3)
    got, _ = run_all(built.engine, seqs)
    assert got == expected
    # one norm a step (a prefill, then two decode steps), none in the layers
    assert calls == {"rms_norm": 3, "add_rms_norm": 0}, calls
    from safetensors.torch import load_file
    raw = load_file(root / "base" / "model.safetensors")
    model = built.engine.runner.model
    w0 = model.w["layers"][0]
    g_in = raw["model.layers.0.input_layernorm.weight"]
    assert not torch.allclose(g_in, torch.ones_like(g_in))
    torch.testing.assert_close(w0["qkv"][:raw["model.layers.0.self_attn.q_proj.weight"].shape[0]],
                               raw["model.layers.0.self_attn.q_proj.weight"] * g_in)
    t = built.pool.tables
    from safetensors.torch import load_file
    peft = load_file(str(root / "adapters" / "r64-all" / "adapter_model.safetensors"))
    slot = slots["r64-all"]
    for group, module, norm in (("qkv", "self_attn.q_proj", "input_layernorm"),
                                ("gate_up", "mlp.gate_proj", "post_attention_layernorm"),
                                ("o", "self_attn.o_proj", None), ("down", "mlp.down_proj", None)):
        a_in_pool = int(t.a_off_host[group][1, 0, slot])
        want = peft[f"base_model.model.model.layers.1.{module}.lora_A.weight"].to(built.dtype)
        if norm:
            want = want * raw[f"model.layers.1.{norm}.weight"]
        got = t.pool[a_in_pool:a_in_pool + want.numel()].view(want.shape)
        torch.testing.assert_close(got, want)


def test_fold_norms_setting(ckpt):
    """LORAFLEET_FOLD_NORMS: on by default, 0 turns it off, anything else is an error; a model
    with a q/k/v bias never folds (the norm factor must not scale the bias)."""
    import dataclasses
    from services.worker.model.spec import load_spec
    from services.worker.model.transforms import fold_norms
    spec = load_spec(ckpt[0] / "base")
    assert fold_norms(spec, PerfConfig.from_env({}))
    assert not fold_norms(dataclasses.replace(spec, qkv_bias=True), PerfConfig())
    assert not fold_norms(spec, PerfConfig.from_env({"LORAFLEET_FOLD_NORMS": "0"}))
    with pytest.raises(ValueError, match="LORAFLEET_FOLD_NORMS"):
        PerfConfig.from_env({"LORAFLEET_FOLD_NORMS": "yes"})


def test_pool_host_tables_mirror_the_device_tables(ckpt):
    """The host copies of the offset, rank and scale tables match the device's for every
    placed slot. A removal is host bookkeeping only (the host says -1; no row reads the
    device's stale entries), and the next placement in that slot rewrites every device entry
    of it, groups the new adapter does not target included."""
    root, _, _ = ckpt
    built, slots = _engine(root)
    t = built.pool.tables

    def same(live):
        for g in t.a_off:
            assert (t.a_off_host[g][..., live] == t.a_off[g].numpy()[..., live]).all()
            assert (t.b_off_host[g][..., live] == t.b_off[g].numpy()[..., live]).all()
        assert (t.ranks_host[live] == t.ranks.numpy()[live]).all()
        assert (t.scales_host[live] == t.scales.numpy()[live]).all()

    same(list(slots.values()))
    assert (t.ranks_host[list(slots.values())] > 0).all()
    gone = "r64-all"                                # targets every group
    built.pool.remove(gone)
    assert all((t.a_off_host[g][:, :, slots[gone]] == -1).all() for g in t.a_off)
    again = built.pool.place("again", staged_from_peft_dir(root / "adapters" / "r1-attn",
                                                           built.spec))
    assert again == slots[gone]                     # the freed slot, reused
    same([again])
    assert (t.a_off["gate_up"].numpy()[..., again] == -1).all()   # r1-attn: q/v only


def test_adapters_really_change_the_output(ckpt):
    """Guards the parity tests: every reference adapter moves the logits away from the base."""
    _, base, peft_models = ckpt
    ids = torch.tensor([list(range(5, 30))])
    with torch.no_grad():
        ref = base(ids).logits[0, -1]
        for name, model in peft_models.items():
            assert (model(ids).logits[0, -1] - ref).abs().max() > 1e-2, name


def test_kn_layout_keeps_the_values_and_the_linear():
    """to_kn_layout (what a CUDA model does to its decode GEMMs' weights) stores them
    column-major with the same shape and values, so F.linear gives the same product; a tied
    lm_head stays the row-major embedding table it is gathered from."""
    from services.worker.model.transforms import KN_GEMMS, to_kn_layout
    g = torch.Generator().manual_seed(0)
    layer = {n: torch.randn(48, 32, generator=g) for n in (*KN_GEMMS, "down")}
    before = {n: t.clone() for n, t in layer.items()}
    embed = torch.randn(100, 32, generator=g)
    weights = {"layers": [layer], "embed": embed, "lm_head": embed}
    x = torch.randn(5, 32, generator=g)
    to_kn_layout(weights)
    for n in KN_GEMMS:
        assert layer[n].shape == (48, 32) and layer[n].stride() == (1, 48)
        assert torch.equal(layer[n], before[n])
        torch.testing.assert_close(torch.nn.functional.linear(x, layer[n]), x @ before[n].T)
    assert layer["down"].is_contiguous()                  # measured slower as [K, N]: kept
    assert weights["lm_head"] is embed and embed.is_contiguous()
    untied = {"layers": [], "embed": embed, "lm_head": embed.clone()}
    to_kn_layout(untied)
    assert untied["lm_head"].stride() == (1, 100) and torch.equal(untied["lm_head"], embed)


@pytest.mark.parametrize("rows", [0, 2])
def test_column_lora_matches_peft_greedy(ckpt, monkeypatch, rows):
    """Column LoRA (q/k/v A rows beside the base weight, services.worker.model.lora_columns) with
    two blocks: the first two q/k/v adapters of rank <= 16 get one, r64-all never does. A batch
    of those two and base rows takes the column path; with r64-all in it the split SGMV runs.
    Both give every request PEFT's greedy tokens. With rows (row LoRA: the o Bt rows in the
    blocks too, PerfConfig.lora_rows) the column path's steps also run o as row LoRA."""
    from services.worker.model import llama as model_mod
    calls = {"columns": 0, "rows": 0}
    plain, plain_rows = model_mod.lora_expand_columns, model_mod.lora_shrink_rows

    def counting(*args, **kw):
        calls["columns"] += 1
        return plain(*args, **kw)

    def counting_rows(*args, **kw):
        calls["rows"] += 1
        return plain_rows(*args, **kw)

    monkeypatch.setattr(model_mod, "lora_expand_columns", counting)
    monkeypatch.setattr(model_mod, "lora_shrink_rows", counting_rows)
    root = ckpt[0]
    built, slots = _engine(root, perf=PerfConfig(lora_columns=2, lora_rows=rows))
    assert built.engine.runner.model.row_parts == (rows or 4)
    cols = built.engine.runner.model.columns
    blocks = {n: int(cols.col_host[s]) for n, s in slots.items()}
    assert sorted(b for b in blocks.values() if b >= 0) == [0, 1] and blocks["r64-all"] == -1
    with_block = [n for n, b in blocks.items() if b >= 0]
    g = torch.Generator().manual_seed(11)
    for names, column_path in ((with_block + [None], True), (["r64-all", *with_block], False)):
        calls["columns"] = calls["rows"] = 0
        seqs, expected = mixed_requests(names, slots, ckpt, g, prompt=(4, 3), new=6)
        got, _ = run_all(built.engine, seqs)
        assert got == expected, names
        assert (calls["columns"] > 0) == column_path, (names, calls)
        assert (calls["rows"] > 0) == (column_path and rows > 0), (names, calls)
    # a removed adapter gives its block back; the next placed one takes it (the device's
    # col_slot entry of the freed slot is rewritten by the slot's next placement)
    freed = blocks[with_block[0]]
    built.pool.remove(with_block[0])
    gone = slots[with_block[0]]
    assert cols.col_host[gone] == -1
    again = built.pool.place("again", staged_from_peft_dir(root / "adapters" / with_block[0],
                                                           built.spec))
    assert cols.col_host[again] == freed and int(cols.col_slot[again]) == freed


def test_steps_above_the_row_bound_run_o_through_the_split_sgmv(ckpt, monkeypatch):
    """Row LoRA only in steps of up to model.row_max_rows rows: with the bound at 3, the
    3-row decode steps of three requests run o as row LoRA, their prompt steps (21 rows) run
    q/k/v as column LoRA and o through the split SGMV; every request gets PEFT's tokens."""
    from services.worker.model import llama as model_mod
    calls = {"columns": 0, "rows": 0}
    plain, plain_rows = model_mod.lora_expand_columns, model_mod.lora_shrink_rows

    def counting(*args, **kw):
        calls["columns"] += 1
        return plain(*args, **kw)

    def counting_rows(*args, **kw):
        calls["rows"] += 1
        return plain_rows(*args, **kw)

    monkeypatch.setattr(model_mod, "lora_expand_columns", counting)
    monkeypatch.setattr(model_mod, "lora_shrink_rows", counting_rows)
    built, slots = _engine(ckpt[0], perf=PerfConfig(lora_columns=2, lora_rows=2))
    built.engine.runner.model.row_max_rows = 3
    cols = built.engine.runner.model.columns
    with_block = [n for n, s in slots.items() if int(cols.col_host[s]) >= 0]
    seqs, expected = mixed_requests(with_block + [None], slots, ckpt,
                                    torch.Generator().manual_seed(5), prompt=(4, 3), new=6)
    got, _ = run_all(built.engine, seqs)
    assert got == expected
    assert calls["rows"] > 0                        # the decode steps
    assert calls["columns"] > calls["rows"]         # the prompt steps: columns without rows
