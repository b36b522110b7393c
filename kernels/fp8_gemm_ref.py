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


def fp8_gemm_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int,
                 bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                 config=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """(x @ dequant(q, scale, group).T + bias + residual) in float32, rounded once to x's dtype:
    x [M, K], q [N, K], bias [N], residual [M, N] -> [M, N] (into `out` when given, which may be
    residual itself). config: unused (the kernel's)."""
    y = x.float() @ dequant(q, scale, group, torch.float32).t()
    if bias is not None:
        y += bias.float()
    if residual is not None:
        y += residual.float()
    if out is None:
        return y.to(x.dtype)
    return out.copy_(y)
