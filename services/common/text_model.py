"""The text model the worker computes from a checkpoint: its config as transformers fills it in,
and a multimodal checkpoint's tensors under the text model's names (torch-free: the worker's
spec and loader and the store's validation all read them here).

Gemma 3 4B, 12B and 27B are published as `Gemma3ForConditionalGeneration`: a SigLIP vision tower
and a projector in front of a Gemma 3 text decoder, whose config is nested as `text_config`.
lorafleet takes text prompts only, and on input_ids without images that model computes its
decoder and nothing else, so the worker serves the decoder:

- `text_config(config)`: the flat config.json of the text model, as transformers reads it;
- `split_name(name, prefix)`: a tensor's name in the multimodal model (a checkpoint's, or a PEFT
  adapter's after `base_model.model.`) as the text model's (`model.layers.N...`,
  `model.embed_tokens.weight`, `lm_head.weight`), or marked as the vision side's, which text
  serving never reads (the checkpoint loader skips them, the store counts an adapter's).

The language model's tensors have two published namings: `language_model.model.X` and
`language_model.lm_head` (the Hub's google/gemma-3-*-it files, and what transformers 5 writes),
and `model.language_model.X` and `lm_head` (transformers 4.52 to 4.x, and the module paths of
the model in memory since 4.52, which PEFT adapters name). Both are read.
"""
from __future__ import annotations

from services.common.families import family_of

# Gemma3TextConfig's defaults (transformers 5, models/gemma3/configuration_gemma3.py), for the
# fields the worker and the store read: a config.json may leave out any field it does not
# change (the published 4B's text_config gives only its sizes, sliding_window and
# rope_scaling), and transformers fills these in.
GEMMA3_TEXT_DEFAULTS = {
    "model_type": "gemma3_text", "vocab_size": 262_208, "hidden_size": 2304,
    "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "pad_token_id": 0,
    "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True,
    "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "use_bidirectional_attention": False,
}
# architecture -> the defaults of its text model's config class (the others' configs are read
# as they are)
TEXT_DEFAULTS = {"Gemma3ForCausalLM": GEMMA3_TEXT_DEFAULTS,
                 "Gemma3ForConditionalGeneration": GEMMA3_TEXT_DEFAULTS}

# what a multimodal config's text model takes from the outer config rather than text_config:
# the token ids (generation reads the outer ones first, text_config's where they are unset),
# the checkpoint's dtype and quantization, and its name
OUTER_FIRST = ("bos_token_id", "eos_token_id", "pad_token_id")
OUTER_ONLY = ("torch_dtype", "dtype", "quantization_config", "_name_or_path")

# the language model's tensors in the multimodal model -> the text model's names
TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head."))
# the multimodal model's module paths of its decoder layers, under both namings, and its head
LAYER_STEMS = ("model.language_model.", "language_model.model.")
HEADS = ("lm_head", "language_model.lm_head")
# the vision tower and the projector: never part of what text serving computes
IMAGE_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                  "multi_modal_projector.")
# module names only the vision tower (SigLIP) has: a PEFT target_modules list may name them
# (they change image inputs only), beside the projections the two towers share (q_proj, ...)
VISION_MODULES = ("out_proj", "fc1", "fc2", "patch_embedding")

PEFT_PREFIX = "base_model.model."      # before the base's module path in a PEFT tensor name
TEXT, IMAGE, OTHER = "text", "image", "other"


def text_config(config: dict) -> dict:
    """The flat config.json of the model the worker computes from `config` (a config.json's
    dict): a Gemma3ForConditionalGeneration's language model (its text_config over
    Gemma3TextConfig's defaults, plus the outer fields transformers reads from the outer
    config); a Gemma3ForCausalLM config with the fields it omits filled in; any other as it
    is. ValueError naming the field if text_config is not an object."""
    arch, fam = family_of(config) or ("", None)
    if arch not in TEXT_DEFAULTS:
        return config
    if not fam.multimodal:
        return {**TEXT_DEFAULTS[arch], **config}
    text = config.get("text_config") or {}
    if not isinstance(text, dict):
        raise ValueError(f"text_config: {type(text).__name__} where an object was expected")
    flat = {**TEXT_DEFAULTS[arch], **text, "architectures": [arch]}
    flat.update({k: config[k] for k in OUTER_FIRST if config.get(k) is not None})
    flat.update({k: config[k] for k in OUTER_ONLY if k in config})
    # the outer config's tying decides (transformers ties lm_head to the language model's
    # embedding by it, default true); text_config's is not read
    flat["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", True))
    # transformers' Gemma3ForConditionalGeneration never applies final_logit_softcapping (only
    # Gemma3ForCausalLM does; the published checkpoints set it null), and transformers is the
    # reference
    flat["final_logit_softcapping"] = None
    return flat


def split_name(name: str, prefix: str = "") -> tuple[str, str]:
    """(part, name) of a multimodal model's tensor `prefix + rest`: TEXT with the text model's
    name (prefix kept) for the language model's; IMAGE for the vision tower's and the
    projector's; OTHER, the name as it is, for one under neither (or without the prefix)."""
    if not name.startswith(prefix):
        return OTHER, name
    rest = name[len(prefix):]
    if rest.startswith(IMAGE_PREFIXES):
        return IMAGE, name
    for old, new in TEXT_PREFIXES:
        if rest.startswith(old):
            return TEXT, prefix + new + rest[len(old):]
    return OTHER, name
