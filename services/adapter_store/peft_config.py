"""The field policy for a PEFT adapter_config.json (the store applies it at registration; README: adapter-store).

Every field a LoRA config may carry (PEFT 0.21) falls in one of three groups:
- checked: `peft_type` (LORA), `r` (1..max_rank), `lora_alpha` (> 0), `use_rslora`,
  `target_modules` (a list, "all-linear" or a regex whose matching time is bounded:
  target_regex.py), `layers_to_transform`, `layers_pattern`,
  `init_lora_weights` (not a kind that rewrites the base weights);
- features we do not serve, accepted only at their "off" value (`use_dora`, `modules_to_save`,
  `bias`, `rank_pattern`, ...): anything else is refused naming the field;
- metadata that does not change the math (`task_type`, `lora_dropout`, ...).
A field this list does not know (a newer PEFT's) is accepted when it is left at an "off" value
(null, false, "", [] or {}: what PEFT writes for a feature not used) and listed in
LoraFields.ignored, which the store logs; set to anything else it is refused, since it may
change what the adapter computes.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from services.adapter_store.target_regex import TooCostly, check_cost
from services.common.errors import Refusal

MAX_CONFIG_BYTES = 64 << 10
REQUIRED = ("peft_type", "r", "lora_alpha", "target_modules")
CHECKED = {"use_rslora", "layers_to_transform", "layers_pattern", "init_lora_weights"}


def _off(value: object) -> bool:
    return value in (None, False, "", [], {}, ())


def _unset(value: object) -> bool:
    """null, false or empty: how PEFT writes a feature that is not used (0 is not: for an
    unknown field it may be a setting)."""
    return value is None or value is False or (isinstance(value, (str, list, dict))
                                               and not value)


# field -> (predicate for its "off" value, why it is refused otherwise)
UNSUPPORTED = {
    "use_dora": (_off, "DoRA adapters are not supported"),
    "modules_to_save": (_off, "full modules to save are not supported, only LoRA A/B weights"),
    "bias": (lambda v: v in (None, "none"), "only bias = \"none\" is supported"),
    "fan_in_fan_out": (_off, "fan_in_fan_out (Conv1D bases) is not supported"),
    "rank_pattern": (_off, "per-module ranks are not supported"),
    "alpha_pattern": (_off, "per-module alphas are not supported"),
    "exclude_modules": (_off, "exclude_modules is not supported"),
    "layer_replication": (_off, "layer replication is not supported"),
    "lora_bias": (_off, "LoRA bias terms are not supported"),
    "use_qalora": (_off, "QA-LoRA is not supported"),
    "trainable_token_indices": (_off, "trainable tokens are not supported"),
    "target_parameters": (_off, "target_parameters is not supported"),
    "megatron_config": (_off, "Megatron layers are not supported"),
    "loftq_config": (_off, "LoftQ adapters need their modified base weights"),
    "alora_invocation_tokens": (_off, "activated LoRA is not supported"),
    "use_bdlora": (_off, "BD-LoRA is not supported"),
    "arrow_config": (_off, "Arrow routing is not supported"),
    "kasa_config": (_off, "KaSA is not supported"),
    "ensure_weight_tying": (_off, "weight tying of saved modules is not supported"),
}
METADATA = {"task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
            "inference_mode", "lora_dropout", "megatron_core", "qalora_group_size",
            "eva_config", "corda_config", "lora_ga_config", "velora_config", "monteclora_config"}
# init_lora_weights values whose training rewrote the base weights (PiSSA, OLoRA, CorDA, ...):
# such an adapter is only right on top of that modified base.
_PLAIN_INIT = (True, False, "gaussian", "eva", "orthogonal")


@dataclass(frozen=True)
class LoraFields:
    """The config fields that matter once an adapter is accepted."""

    r: int
    alpha: float
    rslora: bool
    target_modules: str | tuple[str, ...]
    target_regex: re.Pattern | None
    layers: frozenset[int] | None
    ignored: tuple[str, ...] = ()     # unknown fields left at their "off" values


def check_config(raw: bytes, n_layers: int, max_rank: int) -> LoraFields:
    """Parse and check adapter_config.json; raises Refusal naming the field."""
    cfg = _parse(raw)
    ignored = []
    for key in cfg:
        if key in METADATA or key in CHECKED or key in UNSUPPORTED or key in REQUIRED:
            continue
        if not _unset(cfg[key]):
            raise Refusal("config_field", f"adapter_config.json: unknown field {key!r} set to "
                                          f"{json.dumps(cfg[key])[:80]} (it may change what "
                                          "the adapter computes)")
        ignored.append(key)
    for key in REQUIRED:
        if key not in cfg:
            raise Refusal("config_field", f"adapter_config.json: missing required field "
                                          f"{key!r}")
    for key, (is_off, why) in UNSUPPORTED.items():
        if key in cfg and not is_off(cfg[key]):
            raise Refusal(key, f"{key}: {why} (got {json.dumps(cfg[key])[:80]})")
    if cfg["peft_type"] != "LORA":
        raise Refusal("peft_type", f"peft_type: {cfg['peft_type']!r} is not LORA")
    _check_init(cfg.get("init_lora_weights", True))
    _check_layers_pattern(cfg.get("layers_pattern"))
    targets, regex = _targets(cfg["target_modules"])
    if isinstance(targets, str) and cfg.get("layers_to_transform") is not None:
        raise Refusal("layers_to_transform", "layers_to_transform: cannot be used when "
                                             "target_modules is a string (as in PEFT)")
    return LoraFields(r=_rank(cfg["r"], max_rank), alpha=_alpha(cfg["lora_alpha"]),
                      rslora=_flag(cfg.get("use_rslora", False), "use_rslora"),
                      target_modules=targets, target_regex=regex,
                      layers=_layers(cfg.get("layers_to_transform"), n_layers),
                      ignored=tuple(ignored))


def _parse(raw: bytes) -> dict:
    if len(raw) > MAX_CONFIG_BYTES:
        raise Refusal("config_size", f"adapter_config.json: {len(raw)} bytes exceeds the "
                                     f"{MAX_CONFIG_BYTES}-byte cap")
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Refusal("config_json", f"adapter_config.json: not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise Refusal("config_json", "adapter_config.json: not a JSON object")
    return cfg


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _rank(r: object, max_rank: int) -> int:
    if not _is_int(r) or not 1 <= r <= max_rank:
        raise Refusal("r", f"r: {r!r} is not a rank in 1..{max_rank} (--max-rank)")
    return r


def _alpha(alpha: object) -> float:
    if (not isinstance(alpha, (int, float)) or isinstance(alpha, bool)
            or not math.isfinite(alpha) or alpha <= 0):
        raise Refusal("lora_alpha", f"lora_alpha: {alpha!r} must be a finite number > 0")
    return float(alpha)


def _flag(value: object, field: str) -> bool:
    if not isinstance(value, bool):
        raise Refusal(field, f"{field}: {value!r} must be true or false")
    return value


def _check_init(value: object) -> None:
    if value not in _PLAIN_INIT:
        raise Refusal("init_lora_weights", f"init_lora_weights: {value!r} adapters rewrite the "
                                           "base weights; convert to plain LoRA first")


def _check_layers_pattern(value: object) -> None:
    if value not in (None, "layers", ["layers"], ""):
        raise Refusal("layers_pattern", f"layers_pattern: {value!r} is not the base's "
                                        "'layers'")


def _targets(value: object) -> tuple[str | tuple[str, ...], re.Pattern | None]:
    """target_modules as "all-linear", a regex (compiled), or a tuple of module names."""
    if isinstance(value, str):
        if value == "all-linear":
            return value, None
        if len(value) > 512:
            raise Refusal("target_modules", "target_modules: regex longer than 512 characters")
        try:
            check_cost(value)         # before any match: PEFT's re.fullmatch backtracks
            return value, re.compile(value)
        except re.error as exc:
            raise Refusal("target_modules", f"target_modules: bad regex: {exc}") from None
        except TooCostly as exc:
            raise Refusal("target_modules", f"target_modules: regex {value[:80]!r} may take "
                                            f"too long to match ({exc}); give a list of module "
                                            "names or a simpler pattern") from None
    if (isinstance(value, list) and value and len(value) <= 64
            and all(isinstance(v, str) and 0 < len(v) <= 128 for v in value)):
        return tuple(value), None
    raise Refusal("target_modules", f"target_modules: {json.dumps(value)[:80]} must be a "
                                    "non-empty list of module names, \"all-linear\" or a regex")


def _layers(value: object, n_layers: int) -> frozenset[int] | None:
    if value is None:
        return None
    layers = [value] if _is_int(value) else value
    if not isinstance(layers, list) or not layers or not all(_is_int(v) for v in layers):
        raise Refusal("layers_to_transform", f"layers_to_transform: {value!r} must be an int "
                                             "or a non-empty list of ints")
    bad = [v for v in layers if not 0 <= v < n_layers]
    if bad:
        raise Refusal("layers_to_transform", f"layers_to_transform: layer {bad[0]} out of "
                                             f"range (the base has {n_layers} layers)")
    return frozenset(layers)
