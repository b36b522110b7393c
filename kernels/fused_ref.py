"""The torch semantics of the fused elementwise kernels (kernels.fused): what each launch
computes, the path off CUDA, and the tests' references. kernels.fused re-exports them."""
from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """w * (x / sqrt(mean(x^2) + eps)) in fp32, cast back as Hugging Face does. x [T, H]."""
    return w * (x.float() * inv_rms_ref(x, eps)).to(x.dtype)


def add_rms_norm_ref(h: torch.Tensor, delta: torch.Tensor, w: torch.Tensor,
                     eps: float, delta_norm: torch.Tensor | None = None) -> torch.Tensor:
    """h += delta (in place; with delta_norm: h += rms_norm(delta, delta_norm)); return
    rms_norm(h)."""
    h += delta if delta_norm is None else rms_norm_ref(delta, delta_norm, eps)
    return rms_norm_ref(h, w, eps)


def inv_rms_ref(h: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm's row factor of h [T, H]: 1 / sqrt(mean(h^2) + eps), fp32 [T, 1]."""
    hf = h.float()
    return torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)


def scale_rows_ref(x: torch.Tensor, rms: tuple[torch.Tensor, float]) -> torch.Tensor:
    """x [T, ...] times the row factor of rms = (h, eps), rounded to x's dtype (a new tensor)."""
    f = inv_rms_ref(*rms).view(-1, *([1] * (x.dim() - 1)))
    return (x.float() * f).to(x.dtype)


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             positions: torch.Tensor) -> None:
    """In place, rotate-half convention: x = x * c + rotate_half(x) * s at each row's position.
    q [T, Hq, D], k [T, Hk, D] (rows may be strided views); cos, sin [max_pos, D/2]."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    for x in (q, k):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].clone(), x[..., half:].clone()
        x[..., :half] = x1 * c - x2 * s
        x[..., half:] = x2 * c + x1 * s


def qk_norm_ref(q: torch.Tensor, k: torch.Tensor, qk_norm: tuple) -> None:
    """In place, each head of q [T, Hq, D] and k [T, Hk, D] through an RMSNorm over D:
    qk_norm = (q weight [D], k weight [D], eps) (Qwen3's and Gemma 3's q_norm and k_norm)."""
    wq, wk, eps = qk_norm
    q.copy_(rms_norm_ref(q, wq, eps))
    k.copy_(rms_norm_ref(k, wk, eps))


ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}


def silu_mul_ref(gu: torch.Tensor, rms: tuple[torch.Tensor, float] | None = None,
                 act: str = "silu") -> torch.Tensor:
    """gu [T, 2I] = [gate | up] -> act(gate) * up [T, I] (act: silu, or gelu_pytorch_tanh:
    GeGLU); with rms = (h, eps) gu is first scaled by h's row factor (folded norms)."""
    if rms is not None:
        gu = scale_rows_ref(gu, rms)
    gate, up = gu.chunk(2, dim=-1)
    if act == "gelu_pytorch_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    return torch.nn.functional.silu(gate) * up
