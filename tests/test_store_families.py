"""The store validates adapters against the served base's family (services.common.families):
each family's own PEFT targets are accepted with its shapes (Phi-3's fused qkv_proj and
gate_up_proj), and an adapter made for another base is refused naming the mismatch, the module
the base lacks or the shape and the base it expected (numpy only, no torch)."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from safetensors.numpy import save

from services.adapter_store.validate import BaseShapes, load_base_shapes, validate
from services.common.errors import Refusal
from services.common.families import FAMILIES, PARENT
from tests.test_store_support import peft_config

pytestmark = pytest.mark.policy     # torch-free: `make test-policy`

SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}
BASES = {  # name: config.json beyond SIZES
    "llama": {"architectures": ["LlamaForCausalLM"], "head_dim": 16},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "head_dim": 32},
    "phi3": {"architectures": ["Phi3ForCausalLM"]},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "head_dim": 16, "num_hidden_layers": 4},
}


def base(tmp_path: pathlib.Path, name: str) -> BaseShapes:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({**SIZES, **BASES[name]}))
    return load_base_shapes(path)


def adapter(shapes: BaseShapes, targets, r: int = 4, layers: int | None = None
            ) -> tuple[bytes, bytes]:
    """(adapter_config.json, safetensors) of a PEFT LoRA with `targets` in every layer, shaped
    for `shapes` (the base it was made for)."""
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(layers or shapes.layers):
        for m in targets:
            stem = f"base_model.model.model.layers.{layer}.{PARENT[m]}.{m}"
            fan_in, fan_out = shapes.in_out(m)
            tensors[f"{stem}.lora_A.weight"] = rng.standard_normal((r, fan_in), np.float32)
            tensors[f"{stem}.lora_B.weight"] = rng.standard_normal((fan_out, r), np.float32)
    config = peft_config(r=r, target_modules=list(targets))
    return json.dumps(config).encode(), save(tensors)


@pytest.mark.parametrize("name", list(BASES))
def test_each_family_takes_its_own_targets(tmp_path, name):
    shapes = base(tmp_path, name)
    arch = BASES[name]["architectures"][0]
    assert shapes.architecture == arch and shapes.targets == FAMILIES[arch].targets
    summary = validate(*adapter(shapes, shapes.targets, r=8), shapes, max_rank=64)
    assert summary.targets == shapes.targets and summary.rank == 8
    assert summary.layers == tuple(range(shapes.layers))
    # "all-linear" resolves to the family's own modules
    config, blob = adapter(shapes, shapes.targets)
    config = json.dumps({**json.loads(config), "target_modules": "all-linear"}).encode()
    assert validate(config, blob, shapes, max_rank=64).targets == shapes.targets


def test_phi3_shapes_are_the_fused_projections(tmp_path):
    phi3 = base(tmp_path, "phi3")
    assert phi3.in_out("qkv_proj") == (64, 64 + 2 * 32)
    assert phi3.in_out("gate_up_proj") == (64, 2 * 128)


@pytest.mark.parametrize("made_for,served,message", [
    # a Llama-family adapter on Phi-3: q_proj is inside Phi-3's qkv_proj
    ("llama", "phi3", r"no module 'q_proj' \(LoRA targets of Phi3ForCausalLM \(qkv_proj, "
                      r"o_proj, gate_up_proj, down_proj\)\)"),
    ("phi3", "qwen3", r"no module 'qkv_proj' \(LoRA targets of Qwen3ForCausalLM"),
    # Qwen3's 32-wide heads on a Llama of 16-wide heads: the B rows differ
    ("qwen3", "llama", r"_proj.lora_B.weight': shape \[(128|64), 4\], expected \[(64|32), 4\].*"
                       r"LlamaForCausalLM, hidden 64, intermediate 128, 4/2 heads of 16"),
    # Gemma 3's four layers on a two-layer base
    ("gemma3", "llama", r"layer 2 out of range \(the base has 2 layers\)"),
])
def test_an_adapter_for_another_base_is_refused_naming_the_mismatch(tmp_path, made_for,
                                                                     served, message):
    source, target = base(tmp_path, made_for), base(tmp_path, served)
    config, blob = adapter(source, [t for t in source.targets if t != "o_proj"])
    with pytest.raises(Refusal, match=message):
        validate(config, blob, target, max_rank=64)


def test_fused_tensors_under_split_names_are_refused(tmp_path):
    """A file whose tensors are Phi-3's while its config names q_proj: the tensor is named."""
    llama, phi3 = base(tmp_path, "llama"), base(tmp_path, "phi3")
    _, blob = adapter(phi3, ["qkv_proj"])
    config, _ = adapter(llama, ["q_proj"])
    with pytest.raises(Refusal, match=r"qkv_proj.*not a LoRA A/B weight of a q_proj/k_proj"
                                      r".* projection \(the served base is LlamaForCausalLM\)"):
        validate(config, blob, llama, max_rank=64)


def test_an_unserved_architecture_is_refused_at_start(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SIZES, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not served"):
        load_base_shapes(path)
