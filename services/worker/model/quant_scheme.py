"""Which FP8 weights a checkpoint holds, read from its config.json (torch-free: the worker's
config reads it at start; services.worker.model.fp8 does the tensors).

The decoder layers' linear weights are float8_e4m3fn with float scales; LoRA stays in the model
dtype and reads the unquantized activations. Three sources of such weights:

- `--quantization fp8` on a bf16 (or fp32) checkpoint: each decoder-layer linear weight is
  quantized at load with one scale per output channel (Fp8Scheme "load");
- compressed-tensors `float-quantized` (what llm-compressor writes; its FP8, FP8-Dynamic and
  FP8-Block schemes): `X.weight` e4m3 and `X.weight_scale` per tensor, per channel [N, 1], per
  group [N, K / g] or per block [N / bn, K / bk]. Dynamic input activations are served per
  token; static input scales (`input_scale` tensors) are refused;
- transformers' `quant_method: fp8` (FineGrainedFP8Config, DeepSeek-style):
  `X.weight` e4m3 and `X.weight_scale_inv` per block [ceil(N / bn), ceil(K / bk)] of
  `weight_block_size`, or one per tensor without a block size; W = weight * weight_scale_inv.

What the GEMMs compute is the mode's (Fp8Scheme.activations):
- `--quantization fp8` (alias `fp8-dynamic`): W8A8, as vLLM's `fp8` and llm-compressor's
  FP8_DYNAMIC: each decoder-layer linear's input quantized to e4m3 per token, dynamically (one
  scale a row, max|x| / 448), both operands FP8 on the tensor cores ("token"). On an H100 this
  is the faster form (bench/PERF_NOTES.md, the W8A8 step);
- `--quantization fp8-weight-only`: W8A16, the activations stay in the model dtype ("bf16");
- `auto`: a plain checkpoint unquantized; a published FP8 one as published: W8A8 where it
  declares dynamic input activations (compressed-tensors FP8-Dynamic, transformers' fp8, whose
  per-128-column groups are served as one scale a token), weight-only where it declares none.
Either applies to a checkpoint quantized at load and to a published one alike.

A compressed-tensors `kv_cache_scheme` (e4m3, one static scale per tensor: each layer's
`self_attn.k_scale` and `v_scale`, what llm-compressor's FP8 KV calibration writes) is read by
read_kv_scheme: the KV cache is then e4m3 with those scales (services.worker.model.kv_scales);
such a checkpoint may quantize nothing else (no config_groups: bf16 weights).

Any other scheme, and any field value that would change the maths, is refused naming the field
(`quantization_config.FIELD`). Fields that only describe how the checkpoint was made
(observers, compression ratios, versions) are not read.
"""
from __future__ import annotations

from dataclasses import dataclass

# EngineOptions.quantization; TOKEN_MODES quantize the linear inputs per token (W8A8)
QUANTIZATION_MODES = ("auto", "fp8", "fp8-dynamic", "fp8-weight-only")
TOKEN_MODES = ("fp8", "fp8-dynamic")
FP8_METHODS = ("compressed-tensors", "fp8")
DEFAULT_BLOCK = (128, 128)               # transformers' FineGrainedFP8Config.weight_block_size


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's FP8 weights come: `source` is "load" (quantized here, one scale per output
    channel), "compressed-tensors" or "fp8" (as published); `scale_name` the tensor beside each
    `X.weight` with its scales ("" when quantized at load); `block` (rows, columns) one scale
    covers in the block strategy, `group` the columns one covers in the group strategy (None:
    per channel or per tensor, told apart by the scale's shape); `activations` "bf16" (W8A16)
    or "token" (W8A8: the linear inputs quantized to e4m3 per token, dynamically)."""
    source: str
    scale_name: str = ""
    block: tuple[int, int] | None = None
    group: int | None = None
    activations: str = "bf16"


AT_LOAD = Fp8Scheme("load")


class QuantizationError(ValueError):
    """A quantization_config the worker does not serve (spec.load_spec makes it an
    UnsupportedModel naming the checkpoint)."""


def read_kv_scheme(cfg: dict) -> bool:
    """Whether a config.json's dict declares an FP8 KV cache with per-layer static scales (a
    compressed-tensors kv_cache_scheme; its fields checked, refused naming the field)."""
    q = cfg.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "compressed-tensors":
        return False
    kv = q.get("kv_cache_scheme")
    if not kv:
        return False
    where = "kv_cache_scheme."
    if not isinstance(kv, dict):
        raise _refuse(where[:-1], kv, "a KV cache scheme is an object")
    _float8(kv, where)
    _expect(kv, "strategy", where, ("tensor", None), "one scale per tensor (a layer's k_scale "
            "and v_scale)", "tensor")
    _expect(kv, "symmetric", where, (True,), "only symmetric scales (no zero points)", True)
    _expect(kv, "dynamic", where, (False,), "the checkpoint carries its k_scale and v_scale",
            False)
    return True


def read_scheme(cfg: dict) -> Fp8Scheme | None:
    """The FP8 scheme of a config.json's weights; None for an unquantized checkpoint (or one
    whose only quantization is its KV cache's: read_kv_scheme)."""
    if cfg.get("compression_config"):
        raise QuantizationError("compression_config (a sparseml checkpoint) is not supported; "
                                "lorafleet serves FP8 quantization_config only")
    q = cfg.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise QuantizationError("quantization_config must be an object")
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "fp8":
        return _transformers_fp8(q)
    raise QuantizationError(
        f"quantization_config.quant_method {method!r} is not supported; lorafleet serves FP8 "
        f"weights: {' or '.join(repr(m) for m in FP8_METHODS)} (or a bf16 checkpoint with "
        f"--quantization fp8)")


def _refuse(field: str, value, why: str) -> QuantizationError:
    return QuantizationError(f"quantization_config.{field} {value!r} is not supported: {why}")


def _expect(d: dict, field: str, where: str, allowed: tuple, why: str, default=None):
    value = d.get(field, default)
    if value not in allowed:
        raise _refuse(f"{where}{field}", value, why)
    return value


def _transformers_fp8(q: dict) -> Fp8Scheme:
    """transformers' FineGrainedFP8Config: weight_scale_inv per block, or per tensor."""
    _expect(q, "activation_scheme", "", ("dynamic",), "only dynamic activation scales "
            "(static input scales are not loaded)", default="dynamic")
    _expect(q, "fmt", "", ("e4m3",), "only e4m3 weights", default="e4m3")
    _expect(q, "scale_fmt", "", ("float",), "only float block scales", default="float")
    _expect(q, "expert_dtype", "", ("fp8",), "only fp8 weights", default="fp8")
    # absent: transformers' default, 128 x 128 blocks; null: one scale per tensor
    block = q.get("weight_block_size", DEFAULT_BLOCK)
    if block is not None:
        block = _pair(block, "weight_block_size")
    # its activation scheme is dynamic (checked above): served per token (DeepSeek's recipe
    # quantizes per 128-column group of a token; one scale a token is the coarser form)
    return Fp8Scheme("fp8", "weight_scale_inv", block=block, activations="token")


def _pair(value, field: str) -> tuple[int, int]:
    """A block shape: [rows, columns] (or compressed-tensors' older "RxC" string)."""
    if isinstance(value, str) and "x" in value:
        value = value.split("x")
    try:
        rows, cols = (int(v) for v in value)
    except (TypeError, ValueError):
        raise _refuse(field, value, "a block is [rows, columns]") from None
    if rows < 1 or cols < 1:
        raise _refuse(field, value, "a block is [rows, columns] of positive sizes")
    return rows, cols


def _compressed_tensors(q: dict) -> Fp8Scheme | None:
    """compressed-tensors float-quantized: weight_scale per tensor, channel, group or block;
    None where it quantizes the KV cache only (read_kv_scheme)."""
    for field in ("sparsity_config", "transform_config"):
        if q.get(field):
            raise _refuse(field, q[field], "lorafleet loads FP8 weights only")
    if q.get("kv_cache_scheme") and not q.get("config_groups"):
        _expect(q, "format", "", (None, "dense", "float-quantized"), "a KV-cache-only "
                "checkpoint stores its weights dense")
        return None
    _expect(q, "format", "", ("float-quantized",), "only float-quantized (FP8) weights")
    _expect(q, "quantization_status", "", (None, "compressed"), "the weights must be stored "
            "compressed (float8)")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse("config_groups", groups, "a float-quantized checkpoint names its groups")
    blocks, sizes, inputs = set(), set(), set()
    for name, group in groups.items():
        where = f"config_groups.{name}."
        if not isinstance(group, dict):
            raise _refuse(where[:-1], group, "a group is an object")
        _expect(group, "format", where, (None, "float-quantized"), "only float-quantized")
        if group.get("output_activations"):
            raise _refuse(f"{where}output_activations", group["output_activations"],
                          "outputs are not quantized")
        inputs.add(_inputs(group.get("input_activations"), f"{where}input_activations."))
        block, size = _weights(group.get("weights"), f"{where}weights.")
        blocks |= {block} - {None}
        sizes |= {size} - {None}
    if len(blocks) > 1 or len(sizes) > 1:
        raise _refuse("config_groups", sorted(blocks or sizes), "one block_structure and one "
                      "group_size per checkpoint")
    # W8A8 where every group quantizes its inputs (FP8-Dynamic), else weight-only
    return Fp8Scheme("compressed-tensors", "weight_scale", block=next(iter(blocks), None),
                     group=next(iter(sizes), None),
                     activations="token" if inputs == {True} else "bf16")


def _float8(args: dict, where: str) -> None:
    _expect(args, "type", where, ("float",), "only float (FP8) quantization")
    _expect(args, "num_bits", where, (8,), "only 8-bit floats (e4m3)")


def _weights(w, where: str) -> tuple[tuple[int, int] | None, int | None]:
    """A group's weight arguments; returns its (block, group size) when it has one."""
    if not isinstance(w, dict):
        raise _refuse(where[:-1], w, "a float-quantized group quantizes its weights")
    _float8(w, where)
    _expect(w, "symmetric", where, (True,), "only symmetric scales (no zero points)", True)
    _expect(w, "dynamic", where, (False,), "weights carry their scales", False)
    _expect(w, "actorder", where, (None, False), "no activation ordering (g_idx)")
    strategy, size = w.get("strategy"), w.get("group_size")
    if strategy is None:                      # as compressed-tensors infers it
        strategy = "tensor" if size is None else "channel" if size == -1 else "group"
    if strategy in ("tensor", "channel"):
        return None, None
    if strategy == "group":
        if not isinstance(size, int) or size < 1:
            raise _refuse(f"{where}group_size", size, "the group strategy needs a size >= 1")
        return None, size
    if strategy == "block":
        return _pair(w.get("block_structure"), f"{where}block_structure"), None
    raise _refuse(f"{where}strategy", strategy, "weights per tensor, channel, group or block")


def _inputs(a, where: str) -> bool:
    """A group's input activations: none (weight-only: False), or dynamic FP8 (True: served
    per token, whatever the declared strategy)."""
    if a is None:
        return False
    if not isinstance(a, dict):
        raise _refuse(where[:-1], a, "input activations are an object or null")
    _float8(a, where)
    _expect(a, "dynamic", where, (True,), "only dynamic activation scales (static "
            "input_scale tensors are not loaded)", False)
    return True
