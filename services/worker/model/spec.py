"""What the engine needs to know about a Hugging Face Llama-family checkpoint (torch-free)."""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field

# architectures we serve -> whether q/k/v carry a bias
SUPPORTED = {"LlamaForCausalLM": False, "MistralForCausalLM": False, "Qwen2ForCausalLM": True}
ROPE_TYPES = ("default", "linear", "llama3")

# LoRA projection groups as the engine fuses them: group -> its slices (PEFT module names)
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
          "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
MODULE_GROUP = {m: (g, i) for g, mods in GROUPS.items() for i, m in enumerate(mods)}
# one bit per group: a step applies LoRA only to the groups its adapters target
GROUP_BIT = {g: 1 << i for i, g in enumerate(GROUPS)}
ALL_GROUPS = (1 << len(GROUPS)) - 1


class UnsupportedModel(ValueError):
    """The checkpoint is not a Llama-family model we can serve."""


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
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def in_out(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a projection, as LoRA A/B shapes need."""
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, self.q_size), "k_proj": (h, self.kv_size),
                "v_proj": (h, self.kv_size), "o_proj": (self.q_size, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[module]

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


def _rope(cfg: dict, where: pathlib.Path) -> tuple[float, dict | None]:
    """(theta, scaling) from either form: transformers 5 writes `rope_parameters` (theta inside),
    older checkpoints `rope_theta` + `rope_scaling` (with `type` or `rope_type`)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if float(rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0) != 1:
        raise UnsupportedModel(f"{where}: partial_rotary_factor is not supported")
    if kind == "default":
        return theta, None
    if kind not in ROPE_TYPES:
        raise UnsupportedModel(f"{where}: rope type {kind!r} is not supported; lorafleet "
                               f"supports {', '.join(ROPE_TYPES)}")
    # one canonical form; as transformers does, llama3 falls back to the model's own length
    scaling = {k: v for k, v in rope.items() if k not in ("type", "rope_theta")}
    scaling["rope_type"] = kind
    scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    return theta, scaling


def _max_position(cfg: dict) -> int:
    """The model's length; a sliding window caps it (within the window, attention is full)."""
    n = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    sliding = "sliding_attention" in (cfg.get("layer_types") or [])
    if window and (cfg.get("model_type") == "mistral" or cfg.get("use_sliding_window") or sliding):
        n = min(n, int(window))
    return n


def _check_layers(cfg: dict, where: pathlib.Path) -> None:
    """Refuse the Llama-family variants the engine would compute wrongly."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"{where}: hidden_act {act!r} is not supported (only silu)")
    if cfg.get("mlp_bias"):
        raise UnsupportedModel(f"{where}: mlp_bias is not supported")


def load_spec(model_dir: str | pathlib.Path) -> ModelSpec:
    """Read config.json (and generation_config.json) of a checkpoint directory."""
    path = pathlib.Path(model_dir)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except FileNotFoundError as e:
        raise UnsupportedModel(f"{path}: no config.json") from e
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED), None)
    if arch is None:
        raise UnsupportedModel(
            f"{path}: architecture {archs or cfg.get('model_type')!r} is not supported; "
            f"lorafleet serves {', '.join(sorted(SUPPORTED))}")
    _check_layers(cfg, path)
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    heads = int(cfg["num_attention_heads"])
    theta, scaling = _rope(cfg, path)
    hidden = int(cfg["hidden_size"])
    bias = bool(cfg.get("attention_bias", False)) and arch == "LlamaForCausalLM"
    return ModelSpec(
        architecture=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_scaling=scaling, max_position=_max_position(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=SUPPORTED[arch] or bias, o_bias=bias,
        eos_token_ids=_eos_ids(cfg, gen), bos_token_id=cfg.get("bos_token_id"),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        name=cfg.get("_name_or_path") or path.name, extra=cfg)
