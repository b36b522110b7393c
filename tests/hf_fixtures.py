"""Tiny random Llama checkpoints and PEFT adapters written with transformers + PEFT, the
numerical reference for the engine."""
from __future__ import annotations

import pathlib

import torch

ADAPTER_SPECS = {
    # name: (rank, alpha, targets, rslora, layers_to_transform)
    "r1-attn": (1, 2, ["q_proj", "v_proj"], False, None),
    "r64-all": (64, 32, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"], False, None),
    "r8-rslora": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], True, None),
    "r16-layers": (16, 16, ["q_proj", "o_proj", "down_proj", "up_proj"], False, [1]),
}


def write_tokenizer(path: pathlib.Path, vocab_size: int) -> None:
    """A word-level tokenizer over tokens 't0'..'tN' (enough for id-level tests)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(path / "tokenizer.json"))


def randomize_norms(model) -> None:
    """HF initializes every RMSNorm weight to 1, under which a norm weight applied in the wrong
    place (or not at all: the engine folds them into the GEMMs and the adapters' A) would not
    show: give them values around 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))


def make_base(path: pathlib.Path, seed: int = 0, **overrides):
    """A random GQA Llama saved as a HF checkpoint; returns the model (fp32, eval)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5, eos_token_id=1, bos_token_id=0, tie_word_embeddings=False)
    cfg.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    randomize_norms(model)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, cfg["vocab_size"])
    return model


def make_adapter(base, path: pathlib.Path, name: str, seed: int):
    """The ADAPTER_SPECS adapter `name`, saved under path / name (adapter_from_spec)."""
    return adapter_from_spec(base, path / name, ADAPTER_SPECS[name], seed)


def adapter_from_spec(base, path: pathlib.Path, spec: tuple, seed: int):
    """A PEFT LoRA adapter of spec (rank, alpha, targets, rslora, layers) with random
    (non-zero) A and B, saved as safetensors in path."""
    import copy

    from peft import LoraConfig, get_peft_model
    rank, alpha, targets, rslora, layers = spec
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                     layers_to_transform=layers, lora_dropout=0.0, bias="none",
                     task_type="CAUSAL_LM")
    model = get_peft_model(copy.deepcopy(base), cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


ARCHS = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
         "mistral": ("MistralConfig", "MistralForCausalLM"),
         "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def make_family(path: pathlib.Path, arch: str = "llama", seed: int = 0, dtype=None,
                max_shard_size=None, init_std: float = 0.02, **overrides):
    """A random Llama-family checkpoint (arch in ARCHS), saved as safetensors in `dtype`
    (default fp32), sharded when max_shard_size is given. Returns the HF model in fp32 holding
    the very weights written (rounded to dtype), as the reference."""
    import transformers
    cfg_cls, model_cls = (getattr(transformers, n) for n in ARCHS[arch])
    torch.manual_seed(seed)
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5, eos_token_id=1, bos_token_id=0, tie_word_embeddings=False,
               initializer_range=init_std)
    cfg.update(overrides)
    model = model_cls(cfg_cls(**cfg)).eval()
    randomize_norms(model)
    with torch.no_grad():           # HF inits biases to 0 too: make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    if dtype is not None:
        model = model.to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kw)
    write_tokenizer(path, cfg["vocab_size"])
    if dtype is None:
        return model
    # reloaded rather than .float(): .to(dtype) also rounded the rotary inv_freq buffer
    return model_cls.from_pretrained(path, dtype=torch.float32).eval()
