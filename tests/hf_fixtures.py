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


def make_base(path: pathlib.Path, seed: int = 0, **overrides):
    """A random GQA Llama saved as a HF checkpoint; returns the model (fp32, eval)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5, eos_token_id=1, bos_token_id=0, tie_word_embeddings=False)
    cfg.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, cfg["vocab_size"])
    return model


def make_adapter(base, path: pathlib.Path, name: str, seed: int):
    """A PEFT LoRA adapter with random (non-zero) A and B, saved as safetensors."""
    from peft import LoraConfig, get_peft_model
    rank, alpha, targets, rslora, layers = ADAPTER_SPECS[name]
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                     layers_to_transform=layers, lora_dropout=0.0, bias="none",
                     task_type="CAUSAL_LM")
    import copy
    model = get_peft_model(copy.deepcopy(base), cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path / name, safe_serialization=True)
    return model.eval()
