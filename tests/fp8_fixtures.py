"""FP8 references for tests/test_fp8.py, written here from the formats' definitions (not from
the worker's code): e4m3 quantizers per channel, per tensor and per block, the published
checkpoints' files (compressed-tensors float-quantized, transformers fp8), and transformers +
PEFT reference models whose base linear weights are the dequantized ones."""
from __future__ import annotations

import copy
import json
import math
import pathlib
import re
import shutil

import torch

E4M3 = torch.float8_e4m3fn
MAX = 448.0
# a decoder layer's linear weight, in a checkpoint or (base_layer) in a PEFT model
LINEAR = re.compile(r"(?:base_model\.model\.)?(model\.layers\.\d+\.(?:self_attn|mlp)\.\w+_proj)"
                    r"(?:\.base_layer)?\.weight")


def quant_rows(w: torch.Tensor, scale_dtype=torch.float32):
    """(q [N, K], scale [N, 1]): scale = max |row| / 448 (in scale_dtype), q = w / scale."""
    s = (w.float().abs().amax(1, keepdim=True) / MAX).to(scale_dtype)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (w.float() / s.float()).clamp(-MAX, MAX).to(E4M3), s


def quant_tensor(w: torch.Tensor, scale_dtype=torch.float32):
    """(q, scale [1]): one scale for the whole tensor."""
    s = (w.float().abs().max() / MAX).reshape(1).to(scale_dtype)
    return (w.float() / s.float()).clamp(-MAX, MAX).to(E4M3), s


def quant_blocks(w: torch.Tensor, block: tuple[int, int], scale_dtype=torch.float32):
    """(q, scale [ceil(N / bn), ceil(K / bk)]): one scale per bn x bk block (the last ones
    partial)."""
    n, k = w.shape
    bn, bk = block
    s = torch.empty(math.ceil(n / bn), math.ceil(k / bk))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            s[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float().abs().max() / MAX
    s = s.to(scale_dtype)
    return (w.float() / expand(s, n, k, block)).clamp(-MAX, MAX).to(E4M3), s


def expand(s: torch.Tensor, n: int, k: int, block: tuple[int, int] | None) -> torch.Tensor:
    """A scale tensor as [N, K] float32 (per tensor, per row or per block)."""
    s = s.float()
    if block is None:
        return s.reshape(-1, 1).expand(n, k) if s.numel() > 1 else s.reshape(1, 1).expand(n, k)
    return s.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def dequant(q: torch.Tensor, s: torch.Tensor, block=None) -> torch.Tensor:
    return q.float() * expand(s, *q.shape, block)


def write_quantized(src: pathlib.Path, dst: pathlib.Path, qconfig: dict, quantize) -> dict:
    """A copy of checkpoint src in dst whose linear weights are quantize(name, w) -> {suffix:
    tensor} (the weight's own tensors: "weight", "weight_scale", ...), config.json given
    quantization_config; returns {module: dequantized weight [N, K] float32} via the "ref"
    entry quantize adds."""
    from safetensors.torch import load_file, save_file
    dst.mkdir(parents=True)
    tensors, refs = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        m = LINEAR.fullmatch(name)
        if m is None:
            tensors[name] = t
            continue
        parts = quantize(name, t)
        refs[m.group(1)] = parts.pop("ref")
        tensors.update({f"{m.group(1)}.{suffix}": v for suffix, v in parts.items()})
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "generation_config.json"):
        if (src / f).exists():
            shutil.copy(src / f, dst / f)
    return refs


def with_base_weights(model, weights: dict):
    """A copy of the HF model whose decoder linear weights are weights[module] (or fn(w) for
    every one when weights is a function)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            m = LINEAR.fullmatch(name)
            if m is not None:
                p.copy_(weights(p) if callable(weights) else weights[m.group(1)])
    return model.eval()


def with_token_inputs(model, skip: str = ""):
    """The model with each decoder linear's input quantized per token (a row of its last
    dimension: quant_rows) and scaled back before the base weight multiplies it, W8A8 with
    dynamic activation scales: a forward pre-hook on the linear itself, so the PEFT LoRA that
    later wraps it (calling it as its base_layer) still reads the unquantized input. skip: a
    regex of the linears' names left unquantized (served from bf16 weights)."""
    def hook(_module, args):
        x = args[0]
        flat = x.reshape(-1, x.shape[-1])
        return (dequant(*quant_rows(flat)).to(x.dtype).reshape(x.shape), *args[1:])
    for name, module in model.named_modules():
        if (isinstance(module, torch.nn.Linear) and LINEAR.fullmatch(name + ".weight")
                and not (skip and re.fullmatch(skip, name))):
            module.register_forward_pre_hook(hook)
    return model


def peft_on(base, adapter_dirs: dict) -> dict:
    """{name: PEFT model of the adapter in its directory over a copy of base}."""
    from peft import PeftModel
    return {n: PeftModel.from_pretrained(copy.deepcopy(base), str(d)).eval()
            for n, d in adapter_dirs.items()}


def compressed_tensors_config(weights: dict | list[dict], ignore=("lm_head",)) -> dict:
    """llm-compressor's config.json entry: one config group per weights args (each targets
    the Linear layers its `targets` names), inputs dynamic per token (FP8-Dynamic)."""
    groups = {}
    for i, w in enumerate(weights if isinstance(weights, list) else [weights]):
        w = dict(w)
        targets = w.pop("targets", ["Linear"])
        groups[f"group_{i}"] = {
            "targets": targets, "output_activations": None,
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                  "dynamic": True, "strategy": "token", "group_size": None,
                                  "observer": None},
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                        "group_size": None, "actorder": None, "observer": "minmax", **w}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "global_compression_ratio": 1.5,
            "ignore": list(ignore), "kv_cache_scheme": None, "config_groups": groups}
