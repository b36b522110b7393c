"""What the engine needs to know about a Hugging Face checkpoint of a family it serves
(services.common.families: Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3, and Gemma 3's
multimodal checkpoints as their text model), torch-free."""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field

from services.common.families import FAMILIES, SPLIT_TARGETS, family_of, in_out
from services.common.text_model import text_config
from services.worker.model.quant_scheme import (Fp8Scheme, QuantizationError, read_kv_scheme,
                                                read_scheme)

SUPPORTED = tuple(sorted(FAMILIES))
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

# LoRA projection groups as the engine fuses them: group -> its slices (PEFT module names)
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
          "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
MODULE_GROUP = {m: (g, i) for g, mods in GROUPS.items() for i, m in enumerate(mods)}
# a checkpoint's fused projections (Phi-3) -> the group whose every slice they cover
FUSED = {"qkv_proj": "qkv", "gate_up_proj": "gate_up"}
# one bit per group: a step applies LoRA only to the groups its adapters target
GROUP_BIT = {g: 1 << i for i, g in enumerate(GROUPS)}
ALL_GROUPS = (1 << len(GROUPS)) - 1


class UnsupportedModel(ValueError):
    """The checkpoint is not a model we can serve."""


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str
    name: str = ""
    o_bias: bool = False                 # Llama with attention_bias: o_proj has a bias too
    qk_norm: bool = False                # an RMSNorm over each q and k head before RoPE
    lora_targets: tuple[str, ...] = SPLIT_TARGETS   # the checkpoint's (and PEFT's) projections
    act: str = "silu"                    # the gate's activation (gelu_pytorch_tanh: GeGLU)
    gemma_norms: bool = False            # (1 + w) norms, and norms after attention and MLP
    embed_scale: float = 1.0             # the embedding's rows times this (Gemma: sqrt(hidden))
    attn_scale: float = 0.0              # the scores' scale; 0: head_dim ** -0.5
    attn_softcap: float = 0.0            # scores -> cap * tanh(scores / cap); 0: none
    final_softcap: float = 0.0           # logits -> cap * tanh(logits / cap); 0: none
    windows: tuple[int, ...] = ()        # each layer's sliding window (0: full); (): all full
    rope_local: tuple[float, dict | None] | None = None   # (theta, scaling) of sliding layers
    quant: Fp8Scheme | None = None       # FP8 weights (services.worker.model.quant_scheme)
    kv_scales: bool = False              # the checkpoint's FP8 KV cache scales (kv_scheme)
    multimodal: bool = False             # a vision-language checkpoint served as its text
                                         # model (tensor names: services.common.text_model)
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        """The attention scores' scale."""
        return self.attn_scale or self.head_dim ** -0.5

    def window(self, layer: int) -> int:
        """Layer's sliding window in tokens (a query sees its last `window` positions); 0: all."""
        return self.windows[layer] if self.windows else 0

    def layer_rope(self, layer: int) -> tuple[float, dict | None]:
        """(theta, scaling) of the layer's RoPE (Gemma 3's sliding layers have their own)."""
        if self.rope_local is not None and self.window(layer):
            return self.rope_local
        return self.rope_theta, self.rope_scaling

    def in_out(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a projection, as LoRA A/B shapes need."""
        return in_out(module, self.hidden_size, self.intermediate_size, self.q_size,
                      self.kv_size)

    def slice_starts(self, group: str) -> tuple[int, ...]:
        """Column starts of each slice of a fused group's output, plus the total."""
        starts = [0]
        for mod in GROUPS[group]:
            starts.append(starts[-1] + self.in_out(mod)[1])
        return tuple(starts)


def _eos_ids(cfg: dict, gen: dict) -> tuple[int, ...]:
    ids = gen.get("eos_token_id", cfg.get("eos_token_id"))
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, list) else (int(ids),)


def _rope_dicts(cfg: dict, gemma: bool) -> tuple[dict, dict | None]:
    """The RoPE parameters of the full-attention layers, and of the sliding ones when they
    have their own (Gemma 3: nested by layer type in transformers 5, `rope_local_base_freq`
    before)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "full_attention" in rope or "sliding_attention" in rope:
        return dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    if not gemma:
        return rope, None
    rope.setdefault("rope_theta", cfg.get("rope_theta") or 1_000_000.0)
    return rope, {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 1e4)}


def _rope(rope: dict, cfg: dict, where: pathlib.Path) -> tuple[float, dict | None]:
    """(theta, scaling) from either form: transformers 5 writes `rope_parameters` (theta inside),
    older checkpoints `rope_theta` + `rope_scaling` (with `type` or `rope_type`)."""
    theta = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if float(rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0) != 1:
        raise UnsupportedModel(f"{where}: partial_rotary_factor is not supported")
    if kind == "default":
        return theta, None
    if kind not in ROPE_TYPES:
        raise UnsupportedModel(f"{where}: rope type {kind!r} is not supported; lorafleet "
                               f"supports {', '.join(ROPE_TYPES)}")
    # one canonical form; as transformers does, llama3 and yarn fall back to the model's own
    # length (Phi-3 keeps it beside the RoPE parameters), and dynamic always takes it
    scaling = {k: v for k, v in rope.items() if k not in ("type", "rope_theta")}
    scaling["rope_type"] = kind
    own = cfg.get("original_max_position_embeddings") or cfg.get("max_position_embeddings")
    if kind == "dynamic":
        scaling["original_max_position_embeddings"] = cfg.get("max_position_embeddings")
    elif cfg.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = own
    scaling.setdefault("original_max_position_embeddings", own)
    return theta, scaling


def _windows(cfg: dict, n_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as transformers applies them."""
    window = cfg.get("sliding_window")
    qwen = cfg.get("model_type") in ("qwen2", "qwen3")
    if not window or (qwen and not cfg.get("use_sliding_window")):
        return ()
    types = cfg.get("layer_types")
    if types:
        sliding = [t == "sliding_attention" for t in types]
    elif qwen:
        sliding = [i >= int(cfg.get("max_window_layers") or 0) for i in range(n_layers)]
    elif "sliding_window_pattern" in cfg or cfg.get("model_type", "").startswith("gemma3"):
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        sliding = [bool((i + 1) % pattern) for i in range(n_layers)]
    else:
        sliding = [True] * n_layers
    out = tuple(int(window) if s else 0 for s in sliding[:n_layers])
    return out if any(out) else ()


def _max_position(cfg: dict, scaling: dict | None) -> int:
    """The model's length: max_position_embeddings (times the factor for dynamic NTK RoPE,
    which stretches the length it was trained for)."""
    n = int(cfg.get("max_position_embeddings", 2048))
    if scaling and scaling["rope_type"] == "dynamic":
        n = int(n * float(scaling["factor"]))
    return n


def _check_layers(cfg: dict, where: pathlib.Path) -> str:
    """Refuse the variants the engine would compute wrongly; returns the activation."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise UnsupportedModel(f"{where}: hidden_act {act!r} is not supported (only "
                               f"{', '.join(ACTIVATIONS)})")
    if cfg.get("mlp_bias"):
        raise UnsupportedModel(f"{where}: mlp_bias is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModel(f"{where}: use_bidirectional_attention is not supported")
    return act


def _gemma_fields(cfg: dict, hidden: int) -> dict:
    """Gemma 3's ModelSpec fields beyond the Llama family's. Its attn_logit_softcapping is
    not applied: transformers' Gemma 3 never passes it to attention (Gemma 3 checkpoints set
    it to null; Gemma 2 did use it), and transformers is the reference."""
    return dict(gemma_norms=True, embed_scale=hidden ** 0.5,
                attn_scale=float(cfg.get("query_pre_attn_scalar") or 256) ** -0.5,
                final_softcap=float(cfg.get("final_logit_softcapping") or 0.0))


def load_spec(model_dir: str | pathlib.Path) -> ModelSpec:
    """Read config.json (and generation_config.json) of a checkpoint directory; a multimodal
    one's text model (services.common.text_model.text_config)."""
    path = pathlib.Path(model_dir)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except FileNotFoundError as e:
        raise UnsupportedModel(f"{path}: no config.json") from e
    found = family_of(cfg)
    if found is None:
        raise UnsupportedModel(
            f"{path}: architecture {cfg.get('architectures') or cfg.get('model_type')!r} is "
            f"not supported; lorafleet serves {', '.join(SUPPORTED)}")
    arch, fam = found
    try:
        cfg = text_config(cfg)
    except ValueError as e:
        raise UnsupportedModel(f"{path}: {e}") from None
    act = _check_layers(cfg, path)
    try:
        quant, kv_scales = read_scheme(cfg), read_kv_scheme(cfg)
    except QuantizationError as e:
        raise UnsupportedModel(f"{path}: {e}") from None
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    heads = int(cfg["num_attention_heads"])
    full, local = _rope_dicts(cfg, fam.gemma)
    theta, scaling = _rope(full, cfg, path)
    hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    bias = bool(cfg.get("attention_bias", False)) and fam.bias == "attention_bias"
    return ModelSpec(
        architecture=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]), num_layers=layers,
        num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_scaling=scaling, max_position=_max_position(cfg, scaling),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", fam.gemma)),
        qkv_bias=fam.bias == "qkv" or bias, o_bias=bias, qk_norm=fam.qk_norm,
        lora_targets=fam.targets, act=act, windows=_windows(cfg, layers),
        rope_local=None if local is None else _rope(local, cfg, path),
        eos_token_ids=_eos_ids(cfg, gen), bos_token_id=cfg.get("bos_token_id"),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        name=cfg.get("_name_or_path") or path.name, extra=cfg, quant=quant, kv_scales=kv_scales,
        multimodal=fam.multimodal,
        **(_gemma_fields(cfg, hidden) if fam.gemma else {}))
