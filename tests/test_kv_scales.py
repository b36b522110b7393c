"""A published FP8 KV cache (issue 46, "e4m3 with scales"): a compressed-tensors checkpoint with a
`kv_cache_scheme` and each layer's `self_attn.k_scale` / `v_scale` (what llm-compressor's KV
calibration writes; AutoFP8's older `k_proj.output_scale` / `v_proj.output_scale` too) is served
with an e4m3 KV cache holding K / k_scale and V / v_scale. The tiny Llama on CPU against
transformers + PEFT whose keys (after RoPE) and values go through e4m3 with the same scales;
what is refused, naming the field or the tensor."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from services.worker.model.quant_scheme import read_kv_scheme, read_scheme
from services.worker.model.spec import UnsupportedModel, load_spec
from tests.hf_fixtures import ADAPTER_SPECS
from tests.test_engine_parity import mixed_requests, run_all
from tests.test_kv_fp8_engine import _engine, _prefill_logits, rounded_kv

FP8 = torch.float8_e4m3fn
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
             "symmetric": True, "group_size": None, "observer": "minmax"}
# each layer's (k_scale, v_scale): not powers of two (e4m3's grid moves), exact in bf16
SCALES = [(0.6875, 1.375), (2.5, 0.4375)]


def kv_config(groups: dict | None = None, **scheme) -> dict:
    """A compressed-tensors quantization_config that quantizes the KV cache (and, with
    groups, the weights too)."""
    return {"quant_method": "compressed-tensors", "format": "dense",
            "quantization_status": "compressed", "config_groups": groups or {},
            "kv_cache_scheme": {**KV_SCHEME, **scheme}, "ignore": ["lm_head"]}


def write_kv_checkpoint(root, dst, scales=SCALES, names=("k_scale", "v_scale"),
                        qconfig: dict | None = None):
    """root's tiny model (hf_ckpt) as dst/base, its config declaring the KV scheme and each
    layer's scales stored beside its weights (names: the two tensors after self_attn.; a
    scale of None left out); dst/adapters: root's adapters."""
    shutil.copytree(root / "base", dst / "base")
    (dst / "adapters").symlink_to(root / "adapters")
    add_kv_scales(dst / "base", scales, names, qconfig)
    return dst


def add_kv_scales(model, scales=SCALES, names=("k_scale", "v_scale"),
                  qconfig: dict | None = None) -> None:
    """In place: model's config.json given qconfig (default kv_config()) and its
    model.safetensors each layer's two scales (layer 0 float32 of shape [], the others bf16 of
    shape [1]: published both ways)."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(model / "model.safetensors"))
    for i, pair in enumerate(scales):
        for name, value in zip(names, pair):
            if value is not None:
                tensors[f"model.layers.{i}.self_attn.{name}"] = torch.full(
                    (1,) if i else (), value, dtype=torch.bfloat16 if i else torch.float32)
    save_file(tensors, str(model / "model.safetensors"))
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"] = qconfig or kv_config()
    (model / "config.json").write_text(json.dumps(cfg))


def test_a_published_fp8_kv_cache_is_served_with_its_scales(hf_ckpt, tmp_path):
    """auto serves the declared e4m3 cache with the checkpoint's per-layer scales: every
    adapter and base rows in one batch give the greedy tokens of PEFT whose K and V are
    rounded through e4m3 with those scales; the prompts' logits are within 1e-4 of that
    reference and measurably off the same cache with scale 1.0."""
    root, base, peft_models = hf_ckpt
    ckpt = write_kv_checkpoint(root, tmp_path / "kv")
    built, slots = _engine(ckpt, "auto")
    assert all(k.dtype == FP8 and v.dtype == FP8 for k, v in built.engine.runner.kv_cache)
    assert built.engine.runner.model.kv_scales == SCALES
    names = [*ADAPTER_SPECS, None, *ADAPTER_SPECS]
    with rounded_kv([base, *peft_models.values()], SCALES):
        seqs, expected = mixed_requests(names, slots, hf_ckpt, torch.Generator().manual_seed(7),
                                        prompt=(3, 5), new=8)
    got, _ = run_all(built.engine, seqs)
    assert got == expected
    prompts = {n: list(range(5 + i, 17 + 2 * i)) for i, n in enumerate(ADAPTER_SPECS)}
    scaled = _prefill_logits(built, slots, prompts)
    unit = _prefill_logits(*_engine(root, "fp8"), prompts)
    worst = 0.0
    for name, ids in prompts.items():
        with torch.no_grad(), rounded_kv([peft_models[name]], SCALES):
            ref = peft_models[name](torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(scaled[name], ref, atol=1e-4, rtol=1e-4)
        worst = max(worst, float((scaled[name] - unit[name]).abs().max()))
    assert worst > 1e-3, worst


def test_the_older_output_scale_names_and_fp8_weights_beside(hf_ckpt, tmp_path):
    """AutoFP8's k_proj.output_scale / v_proj.output_scale are the same scales; a checkpoint
    whose weights are FP8 too declares both (its weights' scheme and the KV scheme)."""
    root = hf_ckpt[0]
    ckpt = write_kv_checkpoint(root, tmp_path / "old",
                               names=("k_proj.output_scale", "v_proj.output_scale"))
    built, _ = _engine(ckpt, "auto")
    assert built.engine.runner.model.kv_scales == SCALES
    from tests.fp8_fixtures import compressed_tensors_config
    cfg = {"quantization_config": {**compressed_tensors_config({"strategy": "channel"}),
                                   "kv_cache_scheme": KV_SCHEME}}
    assert read_scheme(cfg).source == "compressed-tensors" and read_kv_scheme(cfg)
    assert read_scheme({"quantization_config": kv_config()}) is None
    assert read_kv_scheme({"quantization_config": kv_config()})
    assert not read_kv_scheme({}) and not read_kv_scheme(
        {"quantization_config": {"quant_method": "fp8"}})


def test_auto_keeps_the_model_dtype_without_a_kv_scheme_and_fp8_takes_unit_scales(hf_ckpt):
    root = hf_ckpt[0]
    plain, _ = _engine(root, "auto")
    assert plain.engine.runner.kv_cache[0][0].dtype == torch.float32
    unit, _ = _engine(root, "fp8")
    assert unit.engine.runner.model.kv_scales == [(1.0, 1.0)] * len(SCALES)


REFUSED = [  # (kv_cache_scheme fields, the field the error names)
    ({"type": "int"}, "kv_cache_scheme.type 'int'"),
    ({"num_bits": 4}, "kv_cache_scheme.num_bits 4"),
    ({"strategy": "channel"}, "kv_cache_scheme.strategy 'channel'"),
    ({"dynamic": True}, "kv_cache_scheme.dynamic True"),
    ({"symmetric": False}, "kv_cache_scheme.symmetric False"),
]


@pytest.mark.parametrize("scheme,field", REFUSED, ids=[f for _, f in REFUSED])
def test_unsupported_kv_schemes_are_refused_naming_the_field(hf_ckpt, tmp_path, scheme, field):
    ckpt = write_kv_checkpoint(hf_ckpt[0], tmp_path / "bad", qconfig=kv_config(**scheme))
    with pytest.raises(UnsupportedModel, match=f"quantization_config.{field}"):
        load_spec(ckpt / "base")


@pytest.mark.parametrize("scales,names,message", [
    ([(0.5, 0.5), (0.5, None)], ("k_scale", "v_scale"), "lacks tensor model.layers.1.self_attn"
                                                        ".v_scale"),
    ([(0.5, 0.5)], ("k_scale", "v_scale"), "lacks tensor model.layers.1.self_attn.k_scale"),
    ([(0.5, 0.0), (1.0, 1.0)], ("k_scale", "v_scale"), "model.layers.0.self_attn.v_scale is "
                                                       "0.0: .* positive and finite"),
    ([(float("nan"), 1.0), (1.0, 1.0)], ("k_scale", "v_scale"), "k_scale is nan"),
], ids=["a layer without its v_scale", "a layer without scales", "zero", "nan"])
def test_missing_or_bad_scales_are_refused_naming_the_tensor(hf_ckpt, tmp_path, scales, names,
                                                             message):
    ckpt = write_kv_checkpoint(hf_ckpt[0], tmp_path / "bad", scales=scales, names=names)
    with pytest.raises(UnsupportedModel, match=message):
        _engine(ckpt, "auto")


@pytest.mark.parametrize("extra,field", [
    ({"format": "pack-quantized"}, "quantization_config.format 'pack-quantized'"),
    ({"transform_config": {"rotation": "hadamard"}}, "quantization_config.transform_config"),
    ({"sparsity_config": {"format": "sparse-24"}}, "quantization_config.sparsity_config"),
], ids=["packed weights", "a transform", "sparsity"])
def test_a_kv_only_checkpoint_that_changes_its_weights_is_refused(hf_ckpt, tmp_path, extra,
                                                                 field):
    """A KV-only checkpoint (no config_groups) with packed weights, a rotation or sparsity
    would serve wrong outputs: refused, naming the field. A null strategy reads as per
    tensor (compressed-tensors' default)."""
    ckpt = write_kv_checkpoint(hf_ckpt[0], tmp_path / "bad", qconfig={**kv_config(), **extra})
    with pytest.raises(UnsupportedModel, match=field):
        load_spec(ckpt / "base")
    assert read_kv_scheme({"quantization_config": kv_config(strategy=None)})


def test_model_keeps_the_model_dtype_and_undeclared_scales_serve_fp8_only(hf_ckpt, tmp_path):
    """--kv-cache-dtype model: the model dtype whatever the checkpoint declares. Scales in a
    checkpoint whose config declares none are used by an explicit fp8 only (auto: the model
    dtype, and a bad one is not even read); a missing one is refused naming the tensor in the
    naming the checkpoint uses."""
    root = hf_ckpt[0]
    declared = write_kv_checkpoint(root, tmp_path / "declared")
    model, _ = _engine(declared, "model")
    assert model.engine.runner.kv_cache[0][0].dtype == torch.float32
    loose = write_kv_checkpoint(root, tmp_path / "loose", scales=[(0.5, 0.0), (1.0, 1.0)])
    cfg = json.loads((loose / "base" / "config.json").read_text())
    del cfg["quantization_config"]
    (loose / "base" / "config.json").write_text(json.dumps(cfg))
    auto, _ = _engine(loose, "auto")
    assert auto.engine.runner.kv_cache[0][0].dtype == torch.float32
    with pytest.raises(UnsupportedModel, match="layers.0.self_attn.v_scale is 0.0"):
        _engine(loose, "fp8")
    older = write_kv_checkpoint(root, tmp_path / "older", scales=[(0.5, 0.5), (0.5, None)],
                                names=("k_proj.output_scale", "v_proj.output_scale"))
    with pytest.raises(UnsupportedModel, match="lacks tensor model.layers.1.self_attn.v_proj"
                                               ".output_scale: its config.json declares"):
        _engine(older, "auto")


def test_a_gpu_before_sm89_refuses_fp8_and_keeps_auto_in_the_model_dtype(monkeypatch):
    """e4m3 conversions need sm_89+: an explicit fp8 is refused naming the card, a declared
    FP8 KV cache under auto falls back to the model dtype (its scales unused)."""
    from services.worker.startup import factory
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    spec = load_spec_stub(kv_scales=True)
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8: NVIDIA A100 .*sm_89"):
        factory.kv_cache_form("fp8", spec, torch.bfloat16, cuda, None)
    dtype, scales = factory.kv_cache_form("auto", spec, torch.bfloat16, cuda, None)
    assert dtype == torch.bfloat16 and scales == [(1.0, 1.0)] * spec.num_layers
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    dtype, scales = factory.kv_cache_form("fp8", load_spec_stub(), torch.bfloat16, cuda, None)
    assert dtype == FP8 and scales == [(1.0, 1.0)] * spec.num_layers


def load_spec_stub(**fields):
    """The tiny model's spec with these fields replaced."""
    import dataclasses
    from tests.support import MODEL_DIR
    return dataclasses.replace(load_spec(MODEL_DIR), **fields)
