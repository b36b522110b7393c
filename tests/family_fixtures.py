"""Tiny random checkpoints of each model family the worker serves, made with transformers' own
config classes, and three PEFT adapters each (different ranks and targets, one on the MLP only;
four for the multimodal Gemma 3): the numerical reference for tests/test_families.py and the
end-to-end family test."""
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
GEMMA = {"num_hidden_layers": 4, "head_dim": 16, "query_pre_attn_scalar": 24,
         "sliding_window": 16, "layer_types": GEMMA_LAYERS, "final_logit_softcapping": 3.0,
         "tie_word_embeddings": True, "bos_token_id": 2,
         "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 10_000.0}}}
# the multimodal Gemma 3's vision tower (SigLIP): two layers, four image tokens
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              image_size=28, patch_size=14)
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
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA),
    # Gemma 3 4B/12B/27B's form: the same text model as text_config beside a vision tower
    "gemma3-mm": ("Gemma3Config", "Gemma3ForConditionalGeneration", GEMMA),
}
SPLIT = {  # name: (rank, alpha, targets, rslora, layers_to_transform)
    "r4-qv": (4, 8, ["q_proj", "v_proj"], False, None),
    "r16-mlp": (16, 16, ["gate_proj", "up_proj", "down_proj"], False, None),
    "r8-all": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"], True, [1]),
}
MULTIMODAL = {  # on Gemma3ForConditionalGeneration, PEFT matches the vision tower's modules too
    "r4-qv": SPLIT["r4-qv"],              # and the vision tower's q_proj and v_proj
    "r16-mlp": SPLIT["r16-mlp"],          # the language model's MLP alone
    "r8-all": SPLIT["r8-all"],            # and layer 1's q/k/v in the vision tower
    "r12-linear": (12, 24, "all-linear", False, None),    # and every vision linear layer
}
# saved under the older PEFT naming (base_model.model.language_model.model.layers...)
OLD_NAMING = ("r16-mlp",)
FUSED = {  # Phi-3: PEFT targets its fused projections
    "r4-qkv": (4, 8, ["qkv_proj"], False, None),
    "r16-mlp": (16, 16, ["gate_up_proj", "down_proj"], False, None),
    "r8-all": (8, 16, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], True, [1]),
}


def adapter_specs(name: str) -> dict:
    if name == "gemma3-mm":
        return MULTIMODAL
    return FUSED if name.startswith("phi3") else SPLIT


def make_config(name: str, **more):
    """The family's transformers config of BASE with its overrides (a multimodal one's text
    model as its text_config, beside a small SigLIP)."""
    import transformers
    cfg_name, _, overrides = FAMILIES[name]
    fields = {**BASE, **overrides, **more}
    if cfg_name != "Gemma3Config":
        return getattr(transformers, cfg_name)(**fields)
    return transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**fields),
        vision_config=transformers.SiglipVisionConfig(**VISION), mm_tokens_per_image=4,
        tie_word_embeddings=fields["tie_word_embeddings"])


def make_base(path: pathlib.Path, name: str, seed: int = 0, **more):
    """The family's tiny random checkpoint in fp32 (norm weights and biases away from their
    initial 1 and 0) with a word-level tokenizer; returns the HF model (eval)."""
    import transformers
    torch.manual_seed(seed)
    cfg = make_config(name, **more)
    model = getattr(transformers, FAMILIES[name][1])(cfg).eval()
    randomize_norms(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, cfg.get_text_config().vocab_size)
    return model


def make_family(root: pathlib.Path, name: str, seed: int = 0):
    """(root, base model, {adapter: peft model}) with root/base and root/adapters/<adapter>."""
    base = make_base(root / "base", name, seed)
    specs = adapter_specs(name)
    peft = {a: adapter_from_spec(base, root / "adapters" / a, s, seed + i + 1)
            for i, (a, s) in enumerate(specs.items())}
    if name == "gemma3-mm":
        for a in OLD_NAMING:
            rename_tensors(root / "adapters" / a / "adapter_model.safetensors",
                           [("base_model.model.model.language_model.",
                             "base_model.model.language_model.model.")])
    return root, base, peft


def rename_tensors(path: pathlib.Path, renames: list[tuple[str, str]]) -> None:
    """Rewrite a safetensors file with each name's first matching (old, new) prefix replaced."""
    from safetensors.torch import load_file, save_file
    out = {}
    for name, t in load_file(path).items():
        old, new = next(((o, n) for o, n in renames if name.startswith(o)), ("", ""))
        out[new + name[len(old):]] = t
    save_file(out, path, metadata={"format": "pt"})


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
