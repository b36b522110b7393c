"""The model families lorafleet serves, and what sets them apart: the worker's model code builds
its forward from them, the store validates adapters against them (torch-free).

Every family is a decoder of RMSNorm, rotary attention and a gated MLP; the differences are the
checkpoint's projection names (which are also the PEFT target names), q/k norms, biases and, for
Gemma 3, the norms around each block, GeGLU and the scaled embedding. A multimodal architecture
(Gemma 3 4B/12B/27B) is served as its text model: services.common.text_model reads its config
and names its tensors. docs/models.md is the table for users.
"""
from __future__ import annotations

from dataclasses import dataclass

# PEFT target names: the base's linear layers, by family
SPLIT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")       # Phi-3
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
          "qkv_proj": "self_attn", "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp",
          "gate_up_proj": "mlp", "down_proj": "mlp"}


@dataclass(frozen=True)
class Family:
    """targets: the linear layers (checkpoint and PEFT names); bias: where q/k/v/o biases come
    from ("attention_bias": that config field, on q/k/v and o; "qkv": always on q/k/v, never on
    o; "none"); qk_norm: an RMSNorm over each q and k head before the rotation; gemma: Gemma's
    (1 + w) norms, norms after the attention and MLP blocks too, GeGLU, the embedding times
    sqrt(hidden), query_pre_attn_scalar, logit softcapping and a RoPE base per layer type;
    multimodal: the checkpoint is a vision-language model whose language model is served (its
    config nested as text_config, its tensors and its adapters' under language_model, the
    vision tower's never read)."""
    targets: tuple[str, ...] = SPLIT_TARGETS
    bias: str = "none"
    qk_norm: bool = False
    gemma: bool = False
    multimodal: bool = False


FAMILIES = {
    "LlamaForCausalLM": Family(bias="attention_bias"),
    "MistralForCausalLM": Family(),
    "Qwen2ForCausalLM": Family(bias="qkv"),
    "Qwen3ForCausalLM": Family(bias="attention_bias", qk_norm=True),
    "Phi3ForCausalLM": Family(targets=FUSED_TARGETS),
    "Gemma3ForCausalLM": Family(bias="attention_bias", qk_norm=True, gemma=True),
    "Gemma3ForConditionalGeneration": Family(bias="attention_bias", qk_norm=True, gemma=True,
                                             multimodal=True),
}


def family_of(config: dict) -> tuple[str, Family] | None:
    """(architecture, family) of a Hugging Face config.json's dict, None when not served."""
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in FAMILIES), None)
    return None if arch is None else (arch, FAMILIES[arch])


def in_out(module: str, hidden: int, intermediate: int, q_size: int,
           kv_size: int) -> tuple[int, int]:
    """(in_features, out_features) of a projection, as LoRA A [r, in] and B [out, r] need."""
    h, i = hidden, intermediate
    return {"q_proj": (h, q_size), "k_proj": (h, kv_size), "v_proj": (h, kv_size),
            "qkv_proj": (h, q_size + 2 * kv_size), "o_proj": (q_size, h),
            "gate_proj": (h, i), "up_proj": (h, i), "gate_up_proj": (h, 2 * i),
            "down_proj": (i, h)}[module]
