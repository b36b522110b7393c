"""FP8 linear weights (W8A8, or weight-only W8A16): the weight object the model's GEMMs go
through, the quantizer of a bf16 checkpoint at load, and the reading of published FP8 checkpoints
(services.worker.model.quant_scheme says which).

One representation for every source: `Fp8Weight` holds q, float8_e4m3fn [N, K], and scale,
float32 [N, G], each scale covering `group` consecutive columns of its row:

    W[n, k] = float32(q[n, k]) * scale[n, k // group]

- per output channel (quantized at load; compressed-tensors "channel"): G = 1, group = K;
- per tensor (compressed-tensors "tensor", transformers fp8 without a block size): the one
  scale repeated over the rows, G = 1;
- per group (compressed-tensors "group"): as stored, [N, ceil(K / g)];
- per block of bn x bk (transformers fp8 `weight_scale_inv`, compressed-tensors "block"): each
  block row's scales repeated over its bn rows, [N, ceil(K / bk)], group = bk.

Every conversion is exact (scales are widened to float32 and repeated, never recomputed), so a
published checkpoint computes what its own dequantization gives, and fused weights (q/k/v,
gate/up: `cat_rows`) stay FP8 whatever their parts' row counts, which block scales alone could
not (a k projection of 320 rows is not a whole number of 128-row blocks).

With `tokens` set (--quantization fp8, alias fp8-dynamic: Fp8Scheme.activations "token") the
weight's input is quantized to e4m3 per token (row) on every path, W8A8: on CUDA
`kernels.fp8_linear.fp8_linear_dynamic` (the row quantizer, then the kernel on e4m3 x e4m3 up to 32
rows, _scaled_mm above, on the same e4m3 rows), elsewhere the input quantized and dequantized per
row by the same rule (`kernels.fp8_gemm_ref.qdq_rows`) before dequantize-then-GEMM. The LoRA beside
it reads the unquantized input either way. Where a kernel of ours makes the input on CUDA (the
RMSNorms before q/k/v and gate/up, the MLP's gate before down) it writes the e4m3 rows itself, in
the same launch (kernels.fused_quant; `input_rows` says where): the input then comes as a
`Quantized`, x with those rows, and qlinear quantizes nothing (the o projection's input,
attention's output, is still quantized by its own launch).

Otherwise (fp8-weight-only, or a published checkpoint under auto) the activations stay in the model
dtype: `qlinear(x, w)` is F.linear for a plain weight and, for an Fp8Weight, on CUDA
`kernels.fp8_linear.fp8_linear`: up to 256 rows the weight-only FP8 kernel (W read once as FP8, made
bf16 in registers, the scales applied in the kernel), above that the prefill path (torch._scaled_mm
with per-row activation scales where it serves the weight, else dequantize-then-GEMM). Elsewhere
`linear_by_dequant`, which dequantizes the weight to x's dtype and runs the ordinary GEMM: the
reference (CPU) path.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.fp8_linear import e4m3_device, fp8_linear, fp8_linear_dynamic
from kernels.fp8_gemm_ref import dequant, qdq_rows
from kernels.fused_quant import Rows, new_rows
from services.worker.model.kv_scales import is_kv_scale
from services.worker.model.quant_scheme import Fp8Scheme
from services.worker.model.spec import UnsupportedModel

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max                      # 448
# the decoder layers' linear weights: what is quantized at load, and kept FP8 when published
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")


class Fp8Weight:
    """A linear weight [N, K] in FP8 with float32 scales over column groups (module doc);
    tokens: its input is quantized per token too (W8A8)."""
    __slots__ = ("q", "scale", "group", "tokens")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, group: int, tokens: bool = False):
        if q.dtype != FP8 or q.dim() != 2:
            raise ValueError(f"Fp8Weight: q must be 2-D {FP8}, got {q.dtype} {tuple(q.shape)}")
        n, k = q.shape
        if scale.dtype != torch.float32 or tuple(scale.shape) != (n, math.ceil(k / group)):
            raise ValueError(f"Fp8Weight: scale must be float32 [{n}, ceil({k} / {group})], "
                             f"got {scale.dtype} {tuple(scale.shape)}")
        self.q, self.scale, self.group, self.tokens = q, scale, group, tokens

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    def dequant(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in dtype: q * scale in float32, rounded once to dtype."""
        return dequant(self.q, self.scale, self.group, dtype)

    def regroup(self, group: int) -> "Fp8Weight":
        """The same weight with scales over `group` columns (a divisor of this one's group,
        or any size when this one has one scale a row): the scales repeated, exactly."""
        k = self.q.shape[1]
        if self.scale.shape[1] == 1:
            reps = math.ceil(k / group)
        elif self.group % group == 0:
            reps = self.group // group
        else:
            raise ValueError(f"Fp8Weight: groups of {self.group} columns cannot be split into "
                             f"groups of {group}")
        scale = self.scale.repeat_interleave(reps, dim=1)[:, :math.ceil(k / group)]
        return Fp8Weight(self.q, scale.contiguous(), group, self.tokens)


Weight = torch.Tensor | Fp8Weight


@dataclass(frozen=True)
class Quantized:
    """A W8A8 linear's input x [T, K] (model dtype: what the LoRA reads) with its rows in
    e4m3, xq [T, K], and their scales, xs float32 [T, 1]: quantize_rows(x)'s bytes, written by
    the kernel that made x (input_rows)."""
    x: torch.Tensor
    xq: torch.Tensor
    xs: torch.Tensor


Activation = torch.Tensor | Quantized


def input_rows(w: Weight | None, like: torch.Tensor) -> Rows | None:
    """Buffers for the e4m3 rows (and scales) of w's input, [T, K] with T = like's rows, for
    its producer's launch to fill: for a W8A8 weight (tokens) on a CUDA device with e4m3
    conversions; else None (a plain or W8A16 weight, the CPU path: nothing changes)."""
    if not (isinstance(w, Fp8Weight) and w.tokens and e4m3_device(like.device)):
        return None
    return new_rows(like.shape[0], w.shape[1], like.device)


def with_rows(x: torch.Tensor, rows: Rows | None) -> Activation:
    """x as the next linear takes it: with the rows its producer filled (input_rows), or x."""
    return x if rows is None else Quantized(x, *rows)


def plain(x: Activation) -> torch.Tensor:
    """The model-dtype input (the LoRA's, a plain GEMM's)."""
    return x.x if isinstance(x, Quantized) else x


def qlinear(x: Activation, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ W.T (+ bias) -> [T, N] in x's dtype, W plain or FP8: W8A8 for a weight with
    tokens (x quantized per row on every path; a Quantized x's rows are used as they are),
    else W8A16 (on CUDA a prefill of more than 256 rows may quantize x per row for the FP8
    tensor cores: kernels.fp8_linear.fp8_prefill). The LoRA reads x as it is."""
    rows = (x.xq, x.xs) if isinstance(x, Quantized) else None
    x = plain(x)
    if isinstance(w, Fp8Weight):
        if w.tokens:
            if x.is_cuda:
                return fp8_linear_dynamic(x, w.q, w.scale, w.group, bias, rows)
            return F.linear(qdq_rows(x), w.dequant(x.dtype), bias)
        if x.is_cuda:
            return fp8_linear(x, w.q, w.scale, w.group, bias)
        return linear_by_dequant(x, w, bias)
    return F.linear(x, w, bias)


def linear_by_dequant(x: torch.Tensor, w: Fp8Weight,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8 GEMM as dequantize-then-GEMM: the CPU reference (not on CUDA's hot path)."""
    return F.linear(x, w.dequant(x.dtype), bias)


def quantize(w: torch.Tensor, name: str = "weight", tokens: bool = False) -> Fp8Weight:
    """W [N, K] -> FP8 with one scale per output channel: scale = max|W[n]| / 448 (float32),
    q = W / scale rounded to e4m3 (to nearest). A zero row keeps scale 1. NaN or Inf weights
    are refused naming the tensor."""
    amax = w.abs().amax(dim=1, keepdim=True).to(torch.float32)   # exact: a stored value
    if not bool(torch.isfinite(amax).all()):
        raise UnsupportedModel(f"{name}: NaN or Inf weights cannot be quantized")
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = w.to(torch.float32, copy=True).div_(scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(q, scale, w.shape[1], tokens)


def cat_rows(parts: list[Weight]) -> Weight:
    """The fused weight of parts stacked over their rows (q/k/v, gate/up): FP8 when every part
    is (their scales brought to a common group, exactly), else plain in the plain parts' dtype
    with the FP8 ones dequantized (a published checkpoint that left some of them unquantized)."""
    if not any(isinstance(p, Fp8Weight) for p in parts):
        return torch.cat(parts, 0).contiguous()
    if not all(isinstance(p, Fp8Weight) for p in parts):
        dtype = next(p.dtype for p in parts if not isinstance(p, Fp8Weight))
        return torch.cat([p.dequant(dtype) if isinstance(p, Fp8Weight) else p
                          for p in parts], 0).contiguous()
    grouped = [p for p in parts if p.scale.shape[1] > 1]
    if grouped:
        group = math.gcd(*(p.group for p in grouped))
        parts = [p.regroup(group) for p in parts]
    if len({p.tokens for p in parts}) > 1:
        raise ValueError("cat_rows: parts with and without per-token activations")
    return Fp8Weight(torch.cat([p.q for p in parts], 0), torch.cat([p.scale for p in parts], 0),
                     parts[0].group, parts[0].tokens)


# --- reading a checkpoint ---------------------------------------------------------------------

def convert(name: str, t: torch.Tensor, scheme: Fp8Scheme | None, dtype: torch.dtype,
            device: torch.device) -> Weight:
    """One checkpoint tensor as the loader keeps it until `pack`: FP8 values and their scales
    (float32) as stored, a decoder-layer linear weight quantized when the scheme says so at
    load (from its stored values), a layer's KV cache scale in float32 on the CPU (read once
    into a float: kv_scales), anything else in the model dtype."""
    if is_kv_scale(name):
        return t.to(torch.float32)
    if t.dtype == FP8:
        if scheme is None or scheme.source == "load":
            raise UnsupportedModel(f"tensor {name} is {FP8} but config.json has no FP8 "
                                   f"quantization_config")
        return t.to(device)
    if t.dtype.is_floating_point and t.element_size() == 1:
        raise UnsupportedModel(f"tensor {name} is {t.dtype}: only {FP8} weights are served")
    if scheme is None:
        return t.to(device=device, dtype=dtype)
    if scheme.scale_name and name.endswith("." + scheme.scale_name):
        return t.to(device=device, dtype=torch.float32)
    if scheme.source == "load" and LINEAR.fullmatch(name):
        return quantize(t.to(device), name, scheme.activations == "token")
    return t.to(device=device, dtype=dtype)


def pack(raw: dict, scheme: Fp8Scheme, dtype: torch.dtype) -> None:
    """In place, for a published FP8 checkpoint: each FP8 `X.weight` and its scales become one
    Fp8Weight when it is a decoder layer's linear weight, else (an embedding or lm_head the
    checkpoint quantized) the weight dequantized to the model dtype; all-zero weight zero
    points (symmetric scales) are dropped. A scale without its weight, or an FP8 weight without
    its scale, is refused naming the tensor."""
    if scheme.source == "load":
        return
    for key in [k for k in raw if k.endswith(".weight_zero_point")]:
        if bool(raw[key].count_nonzero()):
            raise UnsupportedModel(f"tensor {key}: non-zero zero points (asymmetric FP8) are "
                                   f"not supported")
        del raw[key]
    for key in [k for k, t in raw.items() if isinstance(t, torch.Tensor) and t.dtype == FP8]:
        scale_key = key.removesuffix("weight") + scheme.scale_name
        if not key.endswith(".weight") or scale_key not in raw:
            raise UnsupportedModel(f"tensor {key} is {FP8} without its {scheme.scale_name}")
        w = from_checkpoint(raw.pop(key), raw.pop(scale_key), scheme, key)
        raw[key] = w if LINEAR.fullmatch(key) else w.dequant(dtype)
    stray = sorted(k for k in raw if k.endswith("." + scheme.scale_name))
    if stray:
        raise UnsupportedModel(f"tensor {stray[0]} has no FP8 weight beside it")


def from_checkpoint(q: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme,
                    name: str) -> Fp8Weight:
    """A published FP8 weight [N, K] and its scales (one, [N] or [N, 1], [N, ceil(K / g)] of
    the scheme's group, [ceil(N / bn), ceil(K / bk)] of its block) as an Fp8Weight."""
    if q.dim() != 2:
        raise UnsupportedModel(f"tensor {name}: an FP8 weight is 2-D, got {tuple(q.shape)}")
    n, k = q.shape
    shape = tuple(scale.shape)
    tokens = scheme.activations == "token"
    if scale.numel() == 1:
        return Fp8Weight(q, scale.reshape(1, 1).expand(n, 1).contiguous(), k, tokens)
    if scheme.block:
        bn, bk = scheme.block
        if shape == (math.ceil(n / bn), math.ceil(k / bk)):
            return Fp8Weight(q, scale.repeat_interleave(bn, dim=0)[:n].contiguous(), bk, tokens)
    if scheme.group and shape == (n, math.ceil(k / scheme.group)):
        return Fp8Weight(q, scale.contiguous(), scheme.group, tokens)
    if shape in ((n,), (n, 1)):
        return Fp8Weight(q, scale.reshape(n, 1).contiguous(), k, tokens)
    raise UnsupportedModel(
        f"tensor {name}: scales of shape {list(shape)} do not fit weight [{n}, {k}] (one per "
        f"tensor, per row [{n}, 1]" + (f", per block {list(scheme.block)}" if scheme.block
                                       else "") +
        (f", per group of {scheme.group}" if scheme.group else "") + ")")
