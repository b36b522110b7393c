"""Published FP8 checkpoints (issue 46): compressed-tensors float-quantized (llm-compressor's
FP8 / FP8-Dynamic / FP8-Block) and transformers' `quant_method: fp8` (block-wise
`weight_scale_inv`), written here from a tiny bf16 Llama by this suite's own quantizers, load
as published and give the greedy tokens (and prefill logits, 1e-4 in fp32) of transformers +
PEFT over their dequantized weights, with adapters and base rows in one batch. Anything else
is refused naming the field or the tensor."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from services.worker.config import EngineOptions, WorkerConfig, parse_args
from services.worker.model.fp8 import Fp8Weight
from services.worker.model.quant_scheme import AT_LOAD
from services.worker.model.spec import UnsupportedModel, load_spec
from services.worker.perf_config import PerfConfig
from services.worker.startup.factory import build_engine, resolve_quantization
from tests import fp8_fixtures as fx
from tests.support import MODEL_DIR
from tests.test_fp8 import FIVE, _engine, _family, _mixed_batch, _prefill_logits

TWO = {n: FIVE[n] for n in ("r64-all", "r8-rslora-attn")}
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return _family(tmp_path_factory.mktemp("fp8-src"), "llama", TWO, seed=5)


def _by_rows(name, w):
    q, s = fx.quant_rows(w, BF16)              # llm-compressor keeps scales in the model dtype
    return {"weight": q, "weight_scale": s, "ref": fx.dequant(q, s)}


def _by_tensor(name, w):
    q, s = fx.quant_tensor(w, BF16)
    return {"weight": q, "weight_scale": s, "ref": fx.dequant(q, s)}


def _blocks(block, scale_name="weight_scale", dtype=BF16):
    def quant(name, w):
        q, s = fx.quant_blocks(w, block, dtype)
        return {"weight": q, scale_name: s, "ref": fx.dequant(q, s, block)}
    return quant


def _channel_mlp_tensor(name, w):
    """Attention per channel, MLP per tensor; layer 1's k_proj left unquantized (in `ignore`),
    so its fused q/k/v is served dequantized."""
    if "layers.1.self_attn.k_proj" in name:
        return {"weight": w, "ref": w.float()}
    return (_by_tensor if ".mlp." in name else _by_rows)(name, w)


CT = {  # case: (weights args of each config group, the quantizer)
    "channel+tensor": ([{"strategy": "channel", "targets": ["re:.*self_attn.*"]},
                        {"strategy": "tensor", "targets": ["re:.*mlp.*"]}], _channel_mlp_tensor),
    "block": ({"strategy": "block", "block_structure": [32, 48]}, _blocks((32, 48))),
    "group": ({"strategy": "group", "group_size": 24}, _blocks((1, 24))),
}
def _scalar_scale_inv(name, w):
    """transformers fp8 without a block size: one 0-d float32 weight_scale_inv a weight."""
    q, s = fx.quant_tensor(w)
    return {"weight": q, "weight_scale_inv": s.reshape(()), "ref": fx.dequant(q, s)}


HF = {  # case: (weight_block_size, the quantizer)
    "block-128": ([128, 128], _blocks((128, 128), "weight_scale_inv", torch.float32)),
    "block-24x48": ([24, 48], _blocks((24, 48), "weight_scale_inv", torch.float32)),
    "per-tensor": (None, _scalar_scale_inv),
}


def _check_published(src, ckpt, refs: dict, source: str, mode: str = "auto",
                     bf16_inputs: str = ""):
    """The published checkpoint under --quantization mode against its reference: its own
    dequantized weights, and under W8A8 (what FP8-Dynamic and transformers' fp8 declare, so
    auto's) each linear's input quantized per token but those of bf16_inputs (a regex of
    linears the engine serves from bf16 weights)."""
    base_dir, base, dirs = src
    built, slots = _engine(ckpt, dirs, mode, tokens=128)
    assert built.spec.quant.source == source
    layer = built.engine.runner.model.w["layers"][0]
    assert all(isinstance(layer[g], Fp8Weight) for g in ("qkv", "o", "gate_up", "down"))
    w8a8 = mode != "fp8-weight-only"
    assert all(layer[g].tokens == w8a8 for g in ("qkv", "o", "gate_up", "down"))
    ref = fx.with_base_weights(base, refs)
    if w8a8:
        ref = fx.with_token_inputs(ref, skip=bf16_inputs)
    peft = fx.peft_on(ref, dirs)
    prompts = {n: [(3 * i + 7 * j) % 250 + 2 for j in range(10 + 6 * i)]
               for i, n in enumerate([*dirs, "base"])}
    for name, logits in _prefill_logits(built, slots, prompts).items():
        with torch.no_grad():
            want = (peft.get(name) or ref)(torch.tensor([prompts[name]])).logits[0, -1]
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    got, expected = _mixed_batch(built, slots, ref, peft, seed=len(source))
    assert got == expected
    return built


@pytest.mark.parametrize("case", list(CT))
def test_compressed_tensors_checkpoint(src, tmp_path, case):
    weights, quant = CT[case]
    ignore = ["lm_head"] + (["model.layers.1.self_attn.k_proj"] if case == "channel+tensor"
                            else [])
    refs = fx.write_quantized(src[0], tmp_path / "ckpt",
                              fx.compressed_tensors_config(weights, ignore), quant)
    # channel+tensor leaves layer 1's k_proj bf16: its fused q/k/v is served dequantized, its
    # inputs unquantized
    plain = r"model\.layers\.1\.self_attn\.[qkv]_proj" if case == "channel+tensor" else ""
    built = _check_published(src, tmp_path / "ckpt", refs, "compressed-tensors",
                             bf16_inputs=plain)
    if case == "channel+tensor":   # a fused q/k/v with a bf16 part: served dequantized
        layers = built.engine.runner.model.w["layers"]
        assert not isinstance(layers[1]["qkv"], Fp8Weight)
        assert isinstance(layers[1]["gate_up"], Fp8Weight)


@pytest.mark.parametrize("case", list(HF))
def test_transformers_fp8_checkpoint(src, tmp_path, case):
    """Block scales [ceil(N / bn), ceil(K / bk)]: 128 x 128 (one block covers a tiny layer's
    projection) and 24 x 48 (whole and partial blocks, k/v's 32 rows in two); and, with
    `weight_block_size: null`, one scale a tensor."""
    block, quant = HF[case]
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
              "weight_block_size": block}
    refs = fx.write_quantized(src[0], tmp_path / "ckpt", config, quant)
    _check_published(src, tmp_path / "ckpt", refs, "fp8")
    if case == "block-24x48":               # weight-only on request
        _check_published(src, tmp_path / "ckpt", refs, "fp8", "fp8-weight-only")


def test_a_published_checkpoint_is_served_as_published(tmp_path):
    """--quantization fp8 on an FP8 checkpoint keeps its own scales; on a plain one it
    quantizes at load; auto leaves a plain one plain. fp8 and its alias fp8-dynamic quantize
    the linear inputs per token (W8A8), fp8-weight-only and auto do not."""
    plain = load_spec(MODEL_DIR)
    published = _with_config(tmp_path, {"quant_method": "fp8", "weight_block_size": [128, 128]})
    w8a8 = dataclasses.replace(AT_LOAD, activations="token")
    assert resolve_quantization("fp8", plain).quant == w8a8
    assert resolve_quantization("fp8-dynamic", plain).quant == w8a8
    assert resolve_quantization("fp8-weight-only", plain).quant == AT_LOAD
    assert resolve_quantization("auto", plain).quant is None
    assert resolve_quantization("fp8", load_spec(published)).quant.block == (128, 128)
    assert resolve_quantization("fp8", load_spec(published)).quant.activations == "token"
    assert resolve_quantization("auto", load_spec(published)).quant.activations == "token"
    assert (resolve_quantization("fp8-weight-only", load_spec(published)).quant.activations
            == "bf16")
    # transformers' default block when the config leaves weight_block_size out
    assert load_spec(_with_config(tmp_path / "d", {"quant_method": "fp8"})).quant.block == \
        (128, 128)


def _with_config(tmp_path, qconfig: dict):
    """A directory with the tiny model's files and config.json given this quantization_config."""
    path = tmp_path / "m"
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(MODEL_DIR, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _ct(**weights) -> dict:
    return fx.compressed_tensors_config({"strategy": "channel", **weights})


def _ct_with(**fields) -> dict:
    return {**_ct(), **fields}


def _ct_inputs(**inputs) -> dict:
    cfg = _ct()
    cfg["config_groups"]["group_0"]["input_activations"].update(inputs)
    return cfg


REFUSED = [  # (quantization_config, the field the error names)
    ({"quant_method": "awq", "bits": 4}, "quantization_config.quant_method 'awq'"),
    ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method"),
    (_ct_with(format="pack-quantized"), "quantization_config.format 'pack-quantized'"),
    (_ct_with(quantization_status="frozen"), "quantization_config.quantization_status"),
    (_ct_with(kv_cache_scheme={"num_bits": 8}), "quantization_config.kv_cache_scheme"),
    (_ct(type="int"), "quantization_config.config_groups.group_0.weights.type 'int'"),
    (_ct(num_bits=4), "config_groups.group_0.weights.num_bits"),
    (_ct(symmetric=False), "config_groups.group_0.weights.symmetric"),
    (_ct(strategy="tensor_group"), "config_groups.group_0.weights.strategy"),
    (_ct(strategy="group", group_size=128, actorder="group"), "weights.actorder"),
    (_ct_inputs(dynamic=False), "config_groups.group_0.input_activations.dynamic"),
    ({"quant_method": "fp8", "activation_scheme": "static"},
     "quantization_config.activation_scheme 'static'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "quantization_config.weight_block_size"),
    ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "quantization_config.scale_fmt"),
]


@pytest.mark.parametrize("qconfig,field", REFUSED, ids=[f for _, f in REFUSED])
def test_unsupported_schemes_are_refused_naming_the_field(tmp_path, qconfig, field):
    path = _with_config(tmp_path, qconfig)
    with pytest.raises(UnsupportedModel, match=field.replace("[", r"\[")) as err:
        load_spec(path)
    assert str(path) in str(err.value)
    with pytest.raises(ValueError, match=f"--model {path}: .*{field.split()[0]}"):
        WorkerConfig(model=str(path))


def test_fp8_tensors_without_a_scheme_or_scale_are_refused_naming_the_tensor(src, tmp_path):
    bare = tmp_path / "bare"
    fx.write_quantized(src[0], bare, {}, _by_rows)
    cfg = json.loads((bare / "config.json").read_text())
    del cfg["quantization_config"]
    (bare / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match=r"tensor model\.layers\.\d+\..*float8_e4m3fn "
                                               r"but config.json has no FP8"):
        _engine(bare, {})
    wrong = tmp_path / "wrong"          # per-row scales where the checkpoint declares 128-blocks
    config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    fx.write_quantized(src[0], wrong, config, lambda n, w: {
        k.replace("weight_scale", "weight_scale_inv"): v for k, v in _by_tensor(n, w).items()}
        | {"weight_scale_inv": torch.ones(2, 3)})
    with pytest.raises(UnsupportedModel, match=r"tensor model\.layers\..*weight: scales of "
                                               r"shape \[2, 3\] do not fit"):
        _engine(wrong, {})


def test_fp8_flags():
    """--quantization is checked and reaches the engine's options; the LoRA column blocks,
    which extend bf16 weights, are refused beside FP8 naming their variable."""
    assert parse_args(["--quantization", "fp8"]).engine.quantization == "fp8"
    assert parse_args([]).engine.quantization == "auto"
    assert parse_args(["--quantization", "fp8-dynamic"]).engine.quantization == "fp8-dynamic"
    assert (parse_args(["--quantization", "fp8-weight-only"]).engine.quantization
            == "fp8-weight-only")
    with pytest.raises(ValueError, match="--quantization: 'int4'"):
        EngineOptions(quantization="int4")
    for perf, var in ((PerfConfig(lora_columns=4), "LORAFLEET_LORA_COLUMNS=4"),
                      (PerfConfig(lora_columns=4, lora_rows=2), "LORAFLEET_LORA_COLUMNS=4"),
                      (PerfConfig(lora_rows=2), "LORAFLEET_LORA_ROWS=2")):
        with pytest.raises(ValueError, match=var):
            build_engine(MODEL_DIR, EngineOptions(quantization="fp8", perf=perf))


def test_auto_takes_the_activations_a_compressed_tensors_checkpoint_declares():
    """Every group quantizing its inputs dynamically (FP8-Dynamic): W8A8 ("token"); none, or
    only some groups: weight-only ("bf16"); transformers' fp8 (dynamic by definition): W8A8."""
    from services.worker.model.quant_scheme import read_scheme
    both = [{"strategy": "channel", "targets": ["re:.*self_attn.*"]},
            {"strategy": "channel", "targets": ["re:.*mlp.*"]}]
    cfg = fx.compressed_tensors_config(both)
    assert read_scheme({"quantization_config": cfg}).activations == "token"
    groups = cfg["config_groups"]
    groups["group_1"]["input_activations"] = None
    assert read_scheme({"quantization_config": cfg}).activations == "bf16"
    groups["group_0"]["input_activations"] = None
    assert read_scheme({"quantization_config": cfg}).activations == "bf16"
    assert read_scheme({"quantization_config": {"quant_method": "fp8"}}).activations == "token"
