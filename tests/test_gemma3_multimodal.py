"""Gemma 3 4B/12B/27B's checkpoints (Gemma3ForConditionalGeneration) served as their text model
(services.common.text_model); the numerical parity with transformers + PEFT is the gemma3-mm
case of tests/test_families.py. Here: a config.json whose text_config leaves fields out (as the
published ones do) reads as the full one transformers makes of it; the language model's tensors
load under either naming, the vision tower's never read; the store takes adapters PEFT made on
the multimodal model (the vision tower's LoRA tensors ignored and counted, in its log) and
refuses, naming the tensor, one whose text tensors do not fit the base."""
from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
import shutil
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from services.adapter_store.validate import load_base_shapes, validate
from services.common.errors import Refusal
from services.worker.model.checkpoint import load_weights
from services.worker.model.spec import UnsupportedModel, load_spec
from tests.family_fixtures import OLD_NAMING, make_base, make_family
from tests.support import Service
from tests.test_store_support import StoreClient

# google/gemma-3-4b-it's config.json as published: text_config gives only what differs from
# Gemma3TextConfig's defaults (the vision_config is left out here: lorafleet never reads it)
PUBLISHED_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                    "model_type": "gemma3_text", "num_hidden_layers": 34,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0"}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """(root, base model, {adapter: peft model}) of the tests/family_fixtures gemma3-mm case."""
    return make_family(tmp_path_factory.mktemp("gemma3-mm"), "gemma3-mm", seed=3)


def _write_config(folder: pathlib.Path, config: dict) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _names(path: pathlib.Path) -> list[str]:
    with safe_open(str(path), "pt") as f:
        return list(f.keys())


# ---- the config -------------------------------------------------------------------------------

def test_a_text_config_that_leaves_fields_out_reads_as_the_full_one(tmp_path):
    """The published 4B's sparse config, and the full one transformers makes of it (every
    Gemma3TextConfig field written out), give the worker and the store the same model."""
    from transformers import Gemma3Config
    full = Gemma3Config.from_dict(PUBLISHED_4B).to_dict()
    assert len(full["text_config"]) > 2 * len(PUBLISHED_4B["text_config"])
    sparse_dir = _write_config(tmp_path / "sparse", PUBLISHED_4B)
    full_dir = _write_config(tmp_path / "full", full)
    sparse, whole = load_spec(sparse_dir), load_spec(full_dir)
    assert dataclasses.replace(sparse, name="") == dataclasses.replace(whole, name="")
    assert (sparse.num_heads, sparse.num_kv_heads, sparse.head_dim) == (8, 4, 256)
    assert (sparse.vocab_size, sparse.max_position, sparse.act) == (262_208, 131_072,
                                                                   "gelu_pytorch_tanh")
    assert sparse.rope_theta == 1_000_000.0 and sparse.rope_local == (10_000.0, None)
    assert sparse.rope_scaling["rope_type"] == "linear" and sparse.rope_scaling["factor"] == 8
    assert sparse.windows == tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(34))
    assert sparse.eos_token_ids == (1, 106) and sparse.bos_token_id == 2
    assert sparse.tie_word_embeddings and sparse.scale == 256 ** -0.5
    assert sparse.torch_dtype == "bfloat16" and sparse.multimodal
    assert load_base_shapes(sparse_dir / "config.json") == \
        load_base_shapes(full_dir / "config.json")


def test_a_text_config_that_is_not_an_object_is_refused_naming_it(tmp_path):
    folder = _write_config(tmp_path / "bad", {**PUBLISHED_4B, "text_config": [2560]})
    with pytest.raises(UnsupportedModel, match="text_config: list where an object"):
        load_spec(folder)
    with pytest.raises(ValueError, match="text_config: list where an object"):
        load_base_shapes(folder / "config.json")


# ---- the checkpoint ---------------------------------------------------------------------------

def _same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in ("embed", "norm", "lm_head"):
        assert torch.equal(a[key], b[key]), key
    for la, lb in zip(a["layers"], b["layers"], strict=True):
        assert la.keys() == lb.keys()
        for key in la:
            assert torch.equal(la[key], lb[key]), key


def test_the_language_model_loads_under_either_naming(family, tmp_path):
    """transformers 5 saves the older naming (language_model.model.*, the Hub's files); a copy
    renamed to the newer one (model.language_model.*, model.vision_tower.*) loads the same
    weights. In the copy the vision tower and the projector are float8_e5m2, which the loader
    refuses: it loads only because they are never read."""
    root, base, _ = family
    names = _names(root / "base" / "model.safetensors")
    assert any(n.startswith("language_model.model.layers.") for n in names)
    assert any(n.startswith("vision_tower.") for n in names)
    newer = tmp_path / "newer"
    shutil.copytree(root / "base", newer)
    renamed = {}
    for name, t in load_file(newer / "model.safetensors").items():
        if name.startswith("language_model.model."):
            renamed["model.language_model." + name[len("language_model.model."):]] = t
        else:
            renamed["model." + name] = t.to(torch.float8_e5m2)
    save_file(renamed, newer / "model.safetensors", metadata={"format": "pt"})
    spec = load_spec(root / "base")
    old = load_weights(root / "base", spec, torch.float32, torch.device("cpu"))
    _same_weights(load_weights(newer, spec, torch.float32, torch.device("cpu")), old)
    assert torch.equal(old["lm_head"], base.lm_head.weight)


def test_an_untied_head_loads_under_either_naming(tmp_path):
    model = make_base(tmp_path / "untied", "gemma3-mm", seed=5, tie_word_embeddings=False)
    spec = load_spec(tmp_path / "untied")
    assert not spec.tie_word_embeddings
    path = tmp_path / "untied" / "model.safetensors"
    assert "language_model.lm_head.weight" in _names(path)
    weights = load_weights(tmp_path / "untied", spec, torch.float32, torch.device("cpu"))
    assert torch.equal(weights["lm_head"], model.lm_head.weight)
    assert not torch.equal(weights["lm_head"], weights["embed"])
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors.pop("language_model.lm_head.weight")
    save_file(tensors, path, metadata={"format": "pt"})
    again = load_weights(tmp_path / "untied", spec, torch.float32, torch.device("cpu"))
    assert torch.equal(again["lm_head"], model.lm_head.weight)


# ---- the adapters -----------------------------------------------------------------------------

def test_peft_reads_the_older_adapter_naming_as_the_same_adapter(family):
    """Guards the fixture: the adapter saved under the older naming is one PEFT itself loads
    onto the multimodal model, and it computes what the adapter computed when it was made."""
    from peft import PeftModel
    root, base, peft = family
    ids = torch.tensor([list(range(5, 30))])
    for name in OLD_NAMING:
        assert _names(root / "adapters" / name / "adapter_model.safetensors")[0].startswith(
            "base_model.model.language_model.model.layers.")
        loaded = PeftModel.from_pretrained(copy.deepcopy(base), root / "adapters" / name)
        with torch.no_grad():
            torch.testing.assert_close(loaded.eval()(ids).logits, peft[name](ids).logits)


def test_the_store_takes_peft_adapters_of_the_multimodal_model(family):
    """Each adapter validated against the multimodal base (its language model's tensors checked,
    the vision tower's ignored and counted), and a store process over the adapters' folder makes
    every one READY and logs each ignored count. (The store's first-use path runs in its own
    process: its metrics share names with the worker's, which other tests import here.)"""
    root, _, _ = family
    base = load_base_shapes(root / "base" / "config.json")
    ignored = {}
    for folder in sorted((root / "adapters").iterdir()):
        vision = sum("vision_tower" in n for n in _names(folder / "adapter_model.safetensors"))
        config, tensors = _adapter(root, folder.name)
        ignored[folder.name] = validate(config, _save(tensors), base, 64).ignored_tensors
        assert ignored[folder.name] == vision
    assert ignored == {"r12-linear": 30, "r16-mlp": 0, "r4-qv": 8, "r8-all": 6}
    config = json.loads((root / "adapters" / "r12-linear" / "adapter_config.json").read_text())
    assert {"fc1", "fc2", "out_proj"} <= set(config["target_modules"])   # vision-only names

    store = Service("adapter_store", ["--model", str(root / "base"), "--adapters-dir",
                                      str(root / "adapters"), "--db", ":memory:"],
                    root).wait(timeout=30)
    try:
        client, end = StoreClient(store.addr), time.monotonic() + 30
        while {a.state for a in client.list(all_tenants=True)} != {"READY"}:
            assert time.monotonic() < end, (client.list(all_tenants=True), store.log()[-2000:])
            time.sleep(0.1)
        log = store.log()
        for name, count in ignored.items():
            line = f"{name}: {count} LoRA tensors of the vision tower or projector ignored"
            assert (line in log) == (count > 0), log[-3000:]
    finally:
        store.kill()


def _adapter(root: pathlib.Path, name: str) -> tuple[bytes, dict]:
    folder = root / "adapters" / name
    return ((folder / "adapter_config.json").read_bytes(),
            load_file(folder / "adapter_model.safetensors"))


def test_text_tensors_that_do_not_fit_the_base_are_refused_naming_them(family):
    root, _, _ = family
    base = load_base_shapes(root / "base" / "config.json")
    config, tensors = _adapter(root, "r4-qv")
    bad = "base_model.model.model.language_model.layers.2.self_attn.v_proj.lora_B.weight"
    tensors[bad] = torch.zeros(48, 4)
    with pytest.raises(Refusal, match=rf"tensor '{bad}': shape \[48, 4\], expected \[32, 4\].*"
                                      r"Gemma3ForConditionalGeneration"):
        validate(config, _save(tensors), base, max_rank=64)


def test_text_model_names_on_the_multimodal_base_are_refused(family):
    """An adapter named as Gemma3ForCausalLM's (base_model.model.model.layers.*): PEFT would
    not load it onto the multimodal model, and the store does not take it either."""
    root, _, _ = family
    base = load_base_shapes(root / "base" / "config.json")
    config, tensors = _adapter(root, "r4-qv")
    text = {n.replace("model.language_model.", "model."): t for n, t in tensors.items()}
    with pytest.raises(Refusal, match=r"tensor 'base_model\.model\.model\.layers\.0\..*not a "
                                      r"LoRA A/B weight"):
        validate(config, _save(text), base, max_rank=64)


def test_an_adapter_of_the_vision_tower_alone_is_refused(family):
    root, _, _ = family
    base = load_base_shapes(root / "base" / "config.json")
    config, tensors = _adapter(root, "r12-linear")
    config = json.dumps({**json.loads(config), "target_modules": ["fc1", "fc2"]}).encode()
    vision = {n: t for n, t in tensors.items() if "vision_tower" in n}
    with pytest.raises(Refusal, match="no module of the served text model is targeted"):
        validate(config, _save(vision), base, max_rank=64)


def _save(tensors: dict) -> bytes:
    from safetensors.torch import save
    return save({n: t.contiguous() for n, t in tensors.items()})
