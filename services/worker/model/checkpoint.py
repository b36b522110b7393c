"""Load Hugging Face safetensors checkpoints (sharded or not) into the engine's fused layout,
FP8 ones too (services.worker.model.fp8: the decoder layers' linear weights as Fp8Weight), and
a multimodal checkpoint's language model (services.common.text_model: its tensors read under
the text model's names, the vision tower's and the projector's never read)."""
from __future__ import annotations

import json
import logging
import pathlib
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors import safe_open

from services.common.text_model import IMAGE, split_name
from services.worker.model import fp8
from services.worker.model.kv_scales import pop_kv_scales
from services.worker.model.quant_scheme import Fp8Scheme
from services.worker.model.spec import ModelSpec, UnsupportedModel

log = logging.getLogger(__name__)

LOAD_THREADS = 8                 # checkpoint shards read at once
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _shard_files(path: pathlib.Path) -> list[pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise UnsupportedModel(f"{path}: shards listed in {index.name} are missing: "
                                   f"{', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModel(f"{path}: no *.safetensors weights (pickled .bin is not loaded)")
    return files


def _wanted(key: str, layers: int | None, multimodal: bool) -> str | None:
    """The name a checkpoint tensor is kept under, None when it is not read: a layer past
    `layers`, or the vision side of a multimodal checkpoint (its language model's tensors are
    named as the text model's)."""
    if multimodal:
        part, key = split_name(key)
        if part == IMAGE:
            return None
    if layers is not None and key.startswith("model.layers.") and \
            int(key.split(".", 3)[2]) >= layers:
        return None
    return key


def read_checkpoint(path: pathlib.Path, dtype: torch.dtype, device: torch.device,
                    layers: int | None = None, quant: Fp8Scheme | None = None,
                    multimodal: bool = False) -> dict:
    """Every tensor of the checkpoint (of its first `layers` decoder layers and the rest, when
    given), cast to dtype on device, with progress in the log. With an FP8 scheme (quant) the
    decoder layers' linear weights are Fp8Weight instead: quantized one at a time as they are
    read (so a bf16 checkpoint never sits whole on the device), or as published. multimodal:
    the language model's tensors only, under the text model's names."""
    files = _shard_files(path)
    start = time.monotonic()

    def shard(f: pathlib.Path) -> dict[str, torch.Tensor]:
        out = {}
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for key in st.keys():
                name = _wanted(key, layers, multimodal)
                if name in out:         # a multimodal checkpoint in both namings
                    raise UnsupportedModel(f"{f.name}: tensor {name} is stored twice")
                if name is not None:
                    out[name] = fp8.convert(name, st.get_tensor(key), quant, dtype, device)
        return out
    # shards in parallel: a copy out of a memory-mapped file is bound by its page faults, and
    # the copies give the GIL up
    tensors: dict[str, torch.Tensor] = {}
    with ThreadPoolExecutor(min(LOAD_THREADS, len(files))) as pool:
        for i, (f, part) in enumerate(zip(files, pool.map(shard, files)), 1):
            twice = sorted(tensors.keys() & part.keys())
            if twice:
                raise UnsupportedModel(f"{path}: tensor {twice[0]} is stored twice")
            tensors.update(part)
            log.info("loaded shard %d/%d (%s) %.1fs", i, len(files), f.name,
                     time.monotonic() - start)
    if quant is not None:
        fp8.pack(tensors, quant, dtype)
    return tensors


def fuse_layers(raw: dict, spec: ModelSpec) -> dict:
    """Rename and fuse HF tensors: per layer one qkv [q+2kv, H] and one gate_up [2I, H] (a
    Phi-3 checkpoint stores them fused already; FP8 ones stay FP8: fp8.cat_rows); Gemma's
    (1 + w) norm weights stored as 1 + w; the layers' FP8 KV cache scales, where the checkpoint
    has them, as "kv_scales" (kv_scales.pop_kv_scales)."""
    def take(name: str) -> torch.Tensor:
        try:
            t = raw.pop(name)
        except KeyError as e:
            raise UnsupportedModel(f"checkpoint lacks tensor {name}") from e
        return t + 1 if spec.gemma_norms and name.endswith("norm.weight") else t

    out = {"embed": take("model.embed_tokens.weight"), "norm": take("model.norm.weight")}
    scales = pop_kv_scales(raw, spec.num_layers)
    if scales is not None:
        out["kv_scales"] = scales       # each layer's scale tensors, unchecked: kv_scales
    if spec.tie_word_embeddings:
        raw.pop("lm_head.weight", None)         # some checkpoints store the tied copy too
        out["lm_head"] = out["embed"]
    else:
        out["lm_head"] = take("lm_head.weight")
    out["layers"] = [_layer(take, spec, f"model.layers.{i}.") for i in range(spec.num_layers)]
    leftover = sorted(k for k in raw if not k.endswith("rotary_emb.inv_freq"))
    if leftover:
        more = f" (+{len(leftover) - 3} more)" if len(leftover) > 3 else ""
        raise UnsupportedModel(f"checkpoint has tensors the engine would ignore: "
                               f"{', '.join(leftover[:3])}{more}")
    return out


def _fused(take, spec: ModelSpec, p: str) -> dict:
    """q/k/v and gate/up of one layer, fused (as they are in a Phi-3 checkpoint)."""
    if "qkv_proj" in spec.lora_targets:
        return {"qkv": take(f"{p}self_attn.qkv_proj.weight"),
                "gate_up": take(f"{p}mlp.gate_up_proj.weight")}
    attn = [take(f"{p}self_attn.{m}.weight") for m in ("q_proj", "k_proj", "v_proj")]
    return {"qkv": fp8.cat_rows(attn),
            "gate_up": fp8.cat_rows([take(f"{p}mlp.gate_proj.weight"),
                                     take(f"{p}mlp.up_proj.weight")])}


def _layer(take, spec: ModelSpec, p: str) -> dict:
    """One decoder layer's tensors, q/k/v and gate/up fused. post_norm is the norm before the
    MLP (Gemma's pre_feedforward_layernorm); Gemma's norms of the attention's and the MLP's
    outputs are attn_out_norm and mlp_out_norm."""
    layer = {
        "in_norm": take(f"{p}input_layernorm.weight"),
        "o": take(f"{p}self_attn.o_proj.weight"),
        "down": take(f"{p}mlp.down_proj.weight"),
        **_fused(take, spec, p),
    }
    if spec.gemma_norms:
        layer["post_norm"] = take(f"{p}pre_feedforward_layernorm.weight")
        layer["attn_out_norm"] = take(f"{p}post_attention_layernorm.weight")
        layer["mlp_out_norm"] = take(f"{p}post_feedforward_layernorm.weight")
    else:
        layer["post_norm"] = take(f"{p}post_attention_layernorm.weight")
    if spec.qk_norm:
        layer["q_norm"] = take(f"{p}self_attn.q_norm.weight")
        layer["k_norm"] = take(f"{p}self_attn.k_norm.weight")
    if spec.qkv_bias:
        layer["qkv_bias"] = torch.cat(
            [take(f"{p}self_attn.{m}.bias") for m in ("q_proj", "k_proj", "v_proj")], 0)
    if spec.o_bias:
        layer["o_bias"] = take(f"{p}self_attn.o_proj.bias")
    return layer


def load_weights(path: str | pathlib.Path, spec: ModelSpec, dtype: torch.dtype,
                 device: torch.device, first_layers: bool = False) -> dict:
    """The fused weights of a checkpoint directory, ready for services.worker.model.llama
    (first_layers: of the first spec.num_layers layers of a deeper checkpoint; FP8 as
    spec.quant says)."""
    raw = read_checkpoint(pathlib.Path(path), dtype, device,
                          spec.num_layers if first_layers else None, spec.quant, spec.multimodal)
    return fuse_layers(raw, spec)
