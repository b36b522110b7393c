"""Torch references of the weight-only FP8 GEMM (kernels.fp8_gemm): the weight's dequantization
and the GEMM over it, with the same signature as the kernel's wrapper."""
from __future__ import annotations

import torch


def dequant(q: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in dtype from q (float8_e4m3fn [N, K]) and scale (float32 [N, ceil(K / group)]):
    W[n, k] = float32(q[n, k]) * scale[n, k // group], rounded once to dtype."""
    if scale.shape[1] > 1:
        scale = scale.repeat_interleave(group, dim=1)[:, :q.shape[1]]
    return q.to(torch.float32).mul_(scale).to(dtype)


def quantize_x_tiles(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """x [M, K] as the kernel's act_fp8 form sees it, float32: each row's K tiles of block_k
    columns quantized to e4m3 with their own scale, max|x| / 448 over the tile, and scaled
    back."""
    m, k = x.shape
    pad = -k % block_k
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(m, -1, block_k)
    s = xf.abs().amax(dim=2, keepdim=True).div(448.0).clamp(min=1e-12)
    xq = (xf / s).to(torch.float8_e4m3fn).float() * s
    return xq.view(m, -1)[:, :k]


def qdq_rows(x: torch.Tensor) -> torch.Tensor:
    """x quantized per row as quantize_rows_ref does and scaled back, in x's dtype: what a W8A8
    GEMM multiplies (the reference and CPU path of per-token activation quantization)."""
    xq, s = quantize_rows_ref(x)
    return xq.float().mul_(s).to(x.dtype)


def fp8_gemm_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int,
                 bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                 config=None, out: torch.Tensor | None = None,
                 x_scale: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(x @ dequant(q, scale, group).T + bias + residual) in float32, rounded once to x's dtype:
    x [M, K], q [N, K], bias [N], residual [M, N] -> [M, N] (into `out` when given, which may be
    residual itself). config: the kernel's; with act_fp8, x as quantize_x_tiles makes it. An
    e4m3 x with its row scales x_scale [M, 1]: x times them, out_dtype out."""
    xf = x.float()
    if x_scale is not None:
        xf = xf * x_scale
    elif config is not None and config.act_fp8:
        xf = quantize_x_tiles(x, config.block_k)
    y = xf @ dequant(q, scale, group, torch.float32).t()
    if bias is not None:
        y += bias.float()
    if residual is not None:
        y += residual.float()
    if out is None:
        return y.to(x.dtype if x_scale is None else out_dtype)
    return out.copy_(y)


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]), one scale a row: max|x[m]| / 448 (a
    zero row: tiny, so it quantizes to zeros), in torch ops. Divided by a tensor of 448s, not
    the number: CUDA torch turns division by a Python number into multiplication by its
    reciprocal, which 1 / 448 is not exactly (one ulp off in about half of the rows)."""
    xf = x.to(torch.float32, copy=True)         # never x itself (an fp32 x: divided in place)
    amax = xf.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12)
    s = amax.div_(torch.full_like(amax, 448.0))
    return xf.div_(s).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn), s
