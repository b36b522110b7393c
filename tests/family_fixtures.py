"""Tiny random checkpoints of each model family the worker serves, made with transformers' own
config classes, and three PEFT adapters each (different ranks and targets, one on the MLP only):
the numerical reference for tests/test_families.py and the end-to-end family test."""
from __future__ import annotations

import pathlib

import torch

from tests.hf_fixtures import adapter_from_spec, randomize_norms, write_tokenizer

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, eos_token_id=1, bos_token_id=0, pad_token_id=0,
            tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "rope_theta": 10000.0}
DYNAMIC = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
GEMMA_LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
FAMILIES = {
    # name: (config class, model class, overrides of BASE)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "qwen3-yarn": ("Qwen3Config", "Qwen3ForCausalLM", {"rope_parameters": YARN,
                                                      "max_position_embeddings": 128}),
    "qwen2-dynamic": ("Qwen2Config", "Qwen2ForCausalLM",
                      {"rope_parameters": DYNAMIC, "max_position_embeddings": 32}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}),
    "phi3-window": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 24}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 16, "query_pre_attn_scalar": 24,
        "sliding_window": 16, "layer_types": GEMMA_LAYERS, "final_logit_softcapping": 3.0,
        "tie_word_embeddings": True, "bos_token_id": 2,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                               "rope_theta": 1_000_000.0},
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": 10_000.0}}}),
}
SPLIT = {  # name: (rank, alpha, targets, rslora, layers_to_transform)
    "r4-qv": (4, 8, ["q_proj", "v_proj"], False, None),
    "r16-mlp": (16, 16, ["gate_proj", "up_proj", "down_proj"], False, None),
    "r8-all": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"], True, [1]),
}
FUSED = {  # Phi-3: PEFT targets its fused projections
    "r4-qkv": (4, 8, ["qkv_proj"], False, None),
    "r16-mlp": (16, 16, ["gate_up_proj", "down_proj"], False, None),
    "r8-all": (8, 16, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], True, [1]),
}


def adapter_specs(name: str) -> dict:
    return FUSED if name.startswith("phi3") else SPLIT


def make_base(path: pathlib.Path, name: str, seed: int = 0, **more):
    """The family's tiny random checkpoint in fp32 (norm weights and biases away from their
    initial 1 and 0) with a word-level tokenizer; returns the HF model (eval)."""
    import transformers
    cfg_name, model_name, overrides = FAMILIES[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**{**BASE, **overrides, **more})
    model = getattr(transformers, model_name)(cfg).eval()
    randomize_norms(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, cfg.vocab_size)
    return model


def make_family(root: pathlib.Path, name: str, seed: int = 0):
    """(root, base model, {adapter: peft model}) with root/base and root/adapters/<adapter>."""
    base = make_base(root / "base", name, seed)
    specs = adapter_specs(name)
    peft = {a: adapter_from_spec(base, root / "adapters" / a, s, seed + i + 1)
            for i, (a, s) in enumerate(specs.items())}
    return root, base, peft


def reset_rope(model) -> None:
    """Forget a dynamic RoPE's grown frequencies (transformers keeps them across generate
    calls: a sequence's angles would depend on the ones before it)."""
    for m in model.modules():
        if hasattr(m, "original_inv_freq") and hasattr(m, "original_max_seq_len"):
            m.inv_freq = m.original_inv_freq.clone()
            m.max_seq_len_cached = m.original_max_seq_len


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    reset_rope(model)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
