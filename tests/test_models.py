"""Model families against transformers: every Llama-family variant the worker serves gives the
logits (fp32, 1e-4) and greedy tokens of the Hugging Face model; anything else is refused."""
from __future__ import annotations

import json
import pathlib
import pickle

import pytest
import torch

from services.worker.config import EngineOptions
from services.worker.engine.scheduler import Scheduled
from services.worker.engine.sequence import Sequence, Stopping
from services.worker.model.spec import UnsupportedModel, load_spec
from services.worker.startup.factory import build_engine
from tests.hf_fixtures import make_family
from tests.test_engine_parity import hf_greedy, run_all

PROMPTS = [list(range(3, 40)), [7, 9, 200, 4, 4, 31], [250]]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 500000.0}
FAMILIES = {
    # name: (arch, config overrides); make_family's default is a GQA Llama (4 heads, 2 kv heads)
    "llama-gqa": ("llama", {}),
    "llama-mqa-head-dim": ("llama", {"num_key_value_heads": 1, "head_dim": 32}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3}),
    "linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0,
                                                  "rope_theta": 10000.0}}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "tied-embeddings": ("llama", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {}),
    "qwen2-qkv-bias": ("qwen2", {}),
}


def engine_for(path: pathlib.Path, dtype: str = "float32"):
    return build_engine(path, EngineOptions(device="cpu", dtype=dtype, kv_cache_bytes=1 << 20,
                                            block_size=4, max_batch_tokens=64))


def prefill_logits(built, prompts) -> list[torch.Tensor]:
    """Last-position logits of each prompt, all prefilled in one engine forward."""
    runner = built.engine.runner
    seqs = [Sequence(str(i), p) for i, p in enumerate(prompts)]
    for s in seqs:
        assert built.engine.scheduler.blocks.ensure(s, len(s.tokens))
    inputs = runner.steps.eager([Scheduled(s, len(s.tokens)) for s in seqs], runner.buffers)
    logits = runner.model.forward(inputs.input_ids, inputs.ctx, runner.kv_cache)
    by_id = {e.seq.request_id: logits[row] for row, e in enumerate(inputs.sampled)}
    for s in seqs:
        built.engine.scheduler.blocks.free(s)
    return [by_id[str(i)] for i in range(len(prompts))]


def engine_greedy(built, prompts, n: int) -> list[list[int]]:
    seqs = [Sequence(f"g{i}", p, stopping=Stopping(max_new_tokens=n, ignore_eos=True))
            for i, p in enumerate(prompts)]
    out, _ = run_all(built.engine, seqs)
    return [out[f"g{i}"] for i in range(len(prompts))]


def hf_last_logits(model, prompt) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1]


def check_fp32(path: pathlib.Path, model) -> None:
    built = engine_for(path)
    for prompt, got in zip(PROMPTS, prefill_logits(built, PROMPTS)):
        torch.testing.assert_close(got, hf_last_logits(model, prompt), atol=1e-4, rtol=1e-4)
    assert engine_greedy(built, PROMPTS, 5) == [hf_greedy(model, p, 5) for p in PROMPTS]


@pytest.mark.parametrize("name", FAMILIES)
def test_family_matches_transformers(name, tmp_path):
    arch, overrides = FAMILIES[name]
    model = make_family(tmp_path, arch, seed=len(name), **overrides)
    check_fp32(tmp_path, model)


def test_tied_checkpoint_has_no_lm_head(tmp_path):
    make_family(tmp_path, tie_word_embeddings=True)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    assert load_spec(tmp_path).tie_word_embeddings


@pytest.mark.parametrize("key", ["type", "rope_type"])
def test_llama3_rope_old_config_form(key, tmp_path):
    """Checkpoints written before transformers 5 carry rope_theta + rope_scaling ("type" or
    "rope_type"); both forms give the same spec and the same logits."""
    model = make_family(tmp_path, rope_parameters=LLAMA3)
    new_spec = load_spec(tmp_path)
    assert new_spec.rope_theta == 500000.0 and new_spec.rope_scaling["rope_type"] == "llama3"
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {key: rope.pop("rope_type"), **rope}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    old_spec = load_spec(tmp_path)
    assert (old_spec.rope_theta, old_spec.rope_scaling) == (new_spec.rope_theta,
                                                            new_spec.rope_scaling)
    check_fp32(tmp_path, model)


def test_sharded_checkpoint(tmp_path):
    model = make_family(tmp_path, max_shard_size="200KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    check_fp32(tmp_path, model)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 0.1), (torch.float16, 0.02)])
def test_half_precision_weights(dtype, tol, tmp_path):
    """Half weights served in their dtype: logits within tol * (their spread) of HF run in fp32
    on the same rounded weights, and every greedy token a (near-)argmax of the reference."""
    model = make_family(tmp_path, dtype=dtype, init_std=0.1)
    name = str(dtype).replace("torch.", "")
    assert load_spec(tmp_path).torch_dtype == name
    built = engine_for(tmp_path, name)
    for prompt, got in zip(PROMPTS, prefill_logits(built, PROMPTS)):
        ref = hf_last_logits(model, prompt)
        assert (got - ref).abs().max() <= tol * ref.std(), (got - ref).abs().max()
    for prompt, out in zip(PROMPTS, engine_greedy(built, PROMPTS, 5)):
        with torch.no_grad():
            ref = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
        chosen = ref.gather(1, torch.tensor(out)[:, None]).squeeze(1)
        assert (ref.max(-1).values - chosen <= 2 * tol * ref.std(-1)).all()
    # the same half checkpoint loaded as fp32 is exact
    fp32 = engine_for(tmp_path, "float32")
    for prompt, got in zip(PROMPTS, prefill_logits(fp32, PROMPTS)):
        torch.testing.assert_close(got, hf_last_logits(model, prompt), atol=1e-4, rtol=1e-4)


def test_unknown_architecture_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel.*not supported.*LlamaForCausalLM"
                                               ".*MistralForCausalLM.*Qwen2ForCausalLM"):
        build_engine(tmp_path, EngineOptions())


class _Boom:
    """Unpickling this creates a marker file: proof that a pickle was opened."""
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_pickle_only_checkpoint_is_refused_unopened(tmp_path):
    make_family(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(_Boom(str(marker))))
    with pytest.raises(UnsupportedModel, match="safetensors"):
        build_engine(tmp_path, EngineOptions())
    assert not marker.exists()


@pytest.mark.parametrize("change,message", [
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}},
     "longrope"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_unsupported_variants_are_refused(change, message, tmp_path):
    make_family(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(UnsupportedModel, match=message):
        load_spec(tmp_path)


def test_mistral_sliding_window_is_computed_not_a_cap(tmp_path):
    """The window is computed in attention (tests/test_sliding_window.py), so the model serves
    its whole max_position_embeddings."""
    make_family(tmp_path, "mistral", sliding_window=128)
    spec = load_spec(tmp_path)
    assert spec.max_position == 256 and spec.windows == (128, 128)
    assert engine_for(tmp_path).engine.max_model_len == 256


def test_stray_tensors_are_refused(tmp_path):
    """A tensor the engine has no place for (here an mlp bias) means the math would differ."""
    from safetensors.torch import load_file, save_file
    make_family(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.bias"] = torch.zeros(64)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match="down_proj.bias"):
        engine_for(tmp_path)


def test_blas_backend_switch_is_checked():
    """LORAFLEET_BLAS names torch's BLAS backend for a CUDA model; a typo is an error even on
    CPU, where nothing is set."""
    from services.worker.model.transforms import choose_blas
    from services.worker.perf_config import PerfConfig
    choose_blas(torch.device("cpu"), PerfConfig.from_env({"LORAFLEET_BLAS": "cublas"}).blas)
    with pytest.raises(ValueError, match="LORAFLEET_BLAS"):
        PerfConfig.from_env({"LORAFLEET_BLAS": "cuBLAS-lt"})
    with pytest.raises(ValueError, match="LORAFLEET_BLAS"):
        choose_blas(torch.device("cpu"), "cuBLAS-lt")
