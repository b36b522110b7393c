"""Fused elementwise kernels for the decoder layer: RMSNorm (with the residual add), rotary
embedding of q and k in place (optionally after an RMSNorm over each head, and with the
KV-cache write of k and v), and the MLP's gate (SiLU, or GELU-tanh for GeGLU). On CUDA each is
one Triton launch; elsewhere the torch expressions of kernels.fused_ref, which are also their
semantics.

Folded norms (`rms=(h, eps)` on rope_write_kv_ and silu_mul): a model whose norm weights are folded
into the next GEMM's weight (services.worker.model.norms) feeds that GEMM the residual h itself and
leaves the row factor 1 / sqrt(mean(h^2) + eps) to the consumer, since norm(h) @ W = factor * (h @
(g * W)) row by row. The consumer computes the factor from h's row and scales its input by it
(rounded to the input's dtype, as a GEMM output would be) before its own work, so a decoder layer
needs no norm launch.

W8A8 inputs (`rows=(xq, xs)` on rms_norm, add_rms_norm, silu_mul and gate_mul): the launch also
writes its output's rows in e4m3 with their scales, the bytes kernels.fp8_tiles.quantize_rows
would make of the output, for an FP8 GEMM that quantizes its input per token (kernels.fused_quant).

Why: inside a CUDA-graph decode step each tiny torch op is still a kernel of ~2-3 µs; unfused,
a Llama layer has ~45 of them, which costs more than streaming its weights at batch 64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fused_ref import (ACTS, add_rms_norm_ref, inv_rms_ref,  # noqa: F401 (re-exported)
                              qk_norm_ref, rms_norm_ref, rope_ref, scale_rows_ref,
                              silu_mul_ref)
from kernels.fp8_tiles import (kv_fp8_args, kv_scale_args, kv_value, quantize_rows,
                               store_e4m3_row)
from kernels.fused_quant import Rows, rows_args, rows_ref, silu_rows_launch
from kernels.pdl import launch_args, wait_then_release


# ---------------------------------------------------------------- Triton kernels
@triton.jit
def _inv_rms_of(xf, H, eps):
    """The RMSNorm's factor 1 / sqrt(mean(x^2) + eps) of a row held as fp32 xf (H values; the
    rest of the block zeros)."""
    return 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)


@triton.jit
def _inv_rms(h_ptr, row, stride_h, H, eps, BLOCK_HID: tl.constexpr):
    """The RMSNorm's factor of one row of h, read from memory."""
    cols = tl.arange(0, BLOCK_HID)
    x = tl.load(h_ptr + row * stride_h + cols, mask=cols < H, other=0.0).to(tl.float32)
    return _inv_rms_of(x, H, eps)


@triton.jit
def _rms_kernel(h_ptr, d_ptr, w_ptr, dw_ptr, out_ptr, H, stride_h, stride_d, stride_o, eps,
                q_ptr, s_ptr, stride_q, ADD: tl.constexpr, NORM_D: tl.constexpr,
                BLOCK: tl.constexpr, QUANT: tl.constexpr, UPCAST: tl.constexpr,
                USE_PDL: tl.constexpr):
    """One row: (h += delta;) out = norm(h); with QUANT also out's row in e4m3 and its scale
    (the `rows` of rms_norm and add_rms_norm), from the registers that hold it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)    # a weight: before the wait
    if NORM_D:
        dw = tl.load(dw_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    wait_then_release(USE_PDL)
    x = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0)
    if ADD:
        d = tl.load(d_ptr + row * stride_d + cols, mask=ok, other=0.0)
        df = d.to(tl.float32)
        if NORM_D:      # the delta's own norm first (Gemma's output norms), rounded as apart
            dn = (df * _inv_rms_of(df, H, eps)).to(h_ptr.dtype.element_ty).to(tl.float32)
            df = (dn * dw).to(h_ptr.dtype.element_ty).to(tl.float32)
        x = (x.to(tl.float32) + df).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = _inv_rms_of(xf, H, eps)
    normed = (xf * inv).to(h_ptr.dtype.element_ty).to(tl.float32)
    y = (normed * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=ok)
    if QUANT:
        store_e4m3_row(y, ok, q_ptr + row * stride_q + cols, s_ptr + row, UPCAST)


@triton.jit
def _head_norm(x1, x2, hs, n_q, qn_ptr, kn_ptr, qk_eps, HALF: tl.constexpr):
    """An RMSNorm over each head (halves x1, x2 [BLOCK_H, HALF]): q's weight for heads below
    n_q, k's for the others. As rms_norm_ref: normed rows rounded to x's dtype, then times w."""
    ds = tl.arange(0, HALF)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    ms = (tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) / (2 * HALF)
    r = (1.0 / tl.sqrt(ms + qk_eps))[:, None]
    is_q = (hs < n_q)[:, None]
    w1 = tl.where(is_q, tl.load(qn_ptr + ds)[None, :], tl.load(kn_ptr + ds)[None, :])
    w2 = tl.where(is_q, tl.load(qn_ptr + HALF + ds)[None, :], tl.load(kn_ptr + HALF + ds)[None, :])
    dt = x1.dtype
    x1 = ((x1f * r).to(dt).to(tl.float32) * w1.to(tl.float32)).to(dt)
    x2 = ((x2f * r).to(dt).to(tl.float32) * w2.to(tl.float32)).to(dt)
    return x1, x2


@triton.jit
def _rotate_row(x_ptr, cos_ptr, sin_ptr, pos_ptr, row, stride_row, stride_head, h0, n_heads,
                h_ptr, stride_h, H, eps, qn_ptr, kn_ptr, n_q, qk_eps, HALF: tl.constexpr,
                BLOCK_H: tl.constexpr, RMS: tl.constexpr, BLOCK_HID: tl.constexpr,
                QK_NORM: tl.constexpr, USE_PDL: tl.constexpr):
    """Rotate heads h0 .. h0 + BLOCK_H (of n_heads) of one row of x in place; returns the
    rotated halves [BLOCK_H, HALF] (in x's dtype), the head indices, their mask and the row's
    factor. With RMS the heads are first scaled by the row factor of h (folded norms; else the
    factor is 1). With QK_NORM each head then goes through its RMSNorm (_head_norm). Under PDL
    the position and its angles (a step input and a table) and h are read before the wait (h
    was written two or more kernels back: the GEMM before this one reads it), x after it."""
    pos = tl.load(pos_ptr + row).to(tl.int64)
    hs = h0 + tl.arange(0, BLOCK_H)
    ds = tl.arange(0, HALF)
    ok = (hs < n_heads)[:, None]
    c = tl.load(cos_ptr + pos * HALF + ds).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * HALF + ds).to(tl.float32)[None, :]
    f = 1.0
    if RMS:
        f = _inv_rms(h_ptr, row, stride_h, H, eps, BLOCK_HID)
    wait_then_release(USE_PDL)
    base = x_ptr + row * stride_row + hs[:, None] * stride_head + ds[None, :]
    x1 = tl.load(base, mask=ok, other=0.0)
    x2 = tl.load(base + HALF, mask=ok, other=0.0)
    if RMS:
        x1 = (x1.to(tl.float32) * f).to(x_ptr.dtype.element_ty)
        x2 = (x2.to(tl.float32) * f).to(x_ptr.dtype.element_ty)
    if QK_NORM:
        x1, x2 = _head_norm(x1, x2, hs, n_q, qn_ptr, kn_ptr, qk_eps, HALF)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    y1 = (x1 * c - x2 * s).to(x_ptr.dtype.element_ty)
    y2 = (x2 * c + x1 * s).to(x_ptr.dtype.element_ty)
    tl.store(base, y1, mask=ok)
    tl.store(base + HALF, y2, mask=ok)
    return y1, y2, hs, ok, f


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, stride_row, stride_head, n_heads,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    _rotate_row(x_ptr, cos_ptr, sin_ptr, pos_ptr, tl.program_id(0).to(tl.int64), stride_row,
                stride_head, 0, n_heads, x_ptr, 0, 0, 1.0, x_ptr, x_ptr, 0, 1.0, HALF, BLOCK_H,
                False, 1, False, USE_PDL)


@triton.jit
def _rope_kv_kernel(x_ptr, v_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, h_ptr,
                    qn_ptr, kn_ptr, stride_row, stride_v, n_q, n_heads, kv_elems, stride_h, H,
                    eps, qk_eps, k_scale, v_scale, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_V: tl.constexpr, RMS: tl.constexpr, BLOCK_HID: tl.constexpr,
                    QK_NORM: tl.constexpr, USE_PDL: tl.constexpr, KV_FP8: tl.constexpr = False,
                    UPCAST: tl.constexpr = False):
    """One row (program_id 0), or part program_id 1 of it: rotate its q and k heads (side by
    side in x) in place, and write the rotated k and its v to the cache slot (none when the
    slot is negative; KV_FP8: an e4m3 cache of k / k_scale and v / v_scale,
    kernels.fp8_tiles.kv_value). Part p takes heads
    p * BLOCK_H .. and v elements p * BLOCK_V ... With RMS, q, k and v are first scaled by h's
    row factor (folded norms; each part computes it); with QK_NORM q and k heads go through
    their RMSNorms before the rotation."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)     # a step input: before the PDL wait
    y1, y2, hs, ok, f = _rotate_row(x_ptr, cos_ptr, sin_ptr, pos_ptr, row, stride_row, 2 * HALF,
                                    part * BLOCK_H, n_heads, h_ptr, stride_h, H, eps, qn_ptr,
                                    kn_ptr, n_q, qk_eps, HALF, BLOCK_H, RMS, BLOCK_HID, QK_NORM,
                                    USE_PDL)
    ds = tl.arange(0, HALF)
    if slot >= 0:
        kh = hs - n_q                                 # k head index; negative for q heads
        k_ok = ok & (kh >= 0)[:, None]
        kbase = kc_ptr + slot * kv_elems + kh[:, None] * (2 * HALF) + ds[None, :]
        kdt = kc_ptr.dtype.element_ty
        tl.store(kbase, kv_value(y1, kdt, KV_FP8, UPCAST, k_scale), mask=k_ok)
        tl.store(kbase + HALF, kv_value(y2, kdt, KV_FP8, UPCAST, k_scale), mask=k_ok)
        vs = part * BLOCK_V + tl.arange(0, BLOCK_V)
        v_ok = vs < kv_elems
        vv = tl.load(v_ptr + row * stride_v + vs, mask=v_ok)
        if RMS:
            vv = (vv.to(tl.float32) * f).to(v_ptr.dtype.element_ty)
        tl.store(vc_ptr + slot * kv_elems + vs,
                 kv_value(vv, vc_ptr.dtype.element_ty, KV_FP8, UPCAST, v_scale), mask=v_ok)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, h_ptr, inter, stride_gu, stride_o, stride_h, H, eps,
                     q_ptr, s_ptr, stride_q, BLOCK: tl.constexpr, RMS: tl.constexpr,
                     BLOCK_HID: tl.constexpr, ACT: tl.constexpr, QUANT: tl.constexpr,
                     UPCAST: tl.constexpr, USE_PDL: tl.constexpr):
    """act(gate) * up for one row's column block (ACT 0: SiLU, 1: GELU with the tanh
    approximation, tanh(y) = 1 - 2 / (1 + exp(2y))); with RMS gate and up are first scaled by
    h's row factor (folded norms: every block of the row computes it, before the PDL wait: h
    was written two or more kernels back, the gate/up GEMM before this one reads it). With
    QUANT the block is the whole row (one program a row) and its e4m3 values and scale are
    written too (silu_mul's `rows`)."""
    row = tl.program_id(0).to(tl.int64)
    if RMS:
        f = _inv_rms(h_ptr, row, stride_h, H, eps, BLOCK_HID)
    wait_then_release(USE_PDL)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=ok, other=0.0)
    if RMS:
        g = (g.to(tl.float32) * f).to(gu_ptr.dtype.element_ty)
        u = (u.to(tl.float32) * f).to(gu_ptr.dtype.element_ty)
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    if ACT == 0:
        act = g / (1.0 + tl.exp(-g))
    else:
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = 0.5 * g * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * y)))
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    y = (act * u).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=ok)
    if QUANT:
        store_e4m3_row(y, ok, q_ptr + row * stride_q + cols, s_ptr + row, UPCAST)


# ---------------------------------------------------------------- dispatch
# Launch shapes: the rope + KV write launch in `parts` programs a row (each its share of the
# heads and of v), and the SiLU launch's column block. bench/fused_micro.py compares others.
ROPE_LAUNCH = {"parts": 1, "num_warps": 4}
SILU_LAUNCH = {"block": 1024, "num_warps": 4}


def _triton(x: torch.Tensor, impl: str) -> bool:
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be auto, triton or torch, got {impl!r}")
    return impl == "triton" or (impl == "auto" and x.is_cuda)


def rms_norm(x, w, eps: float, impl: str = "auto", rows: Rows | None = None):
    """rms_norm_ref(x, w, eps) in one launch; rows = (e4m3 [T, H], float32 [T, 1]): the
    output's rows also quantized into them, as kernels.fp8_tiles.quantize_rows would quantize
    the output (the next GEMM's W8A8 input), in the same launch."""
    if not _triton(x, impl):
        return rows_ref(rms_norm_ref(x, w, eps), rows)
    out = torch.empty_like(x)
    t, h = x.shape
    _rms_kernel[(t,)](x, x, w, w, out, h, x.stride(0), x.stride(0), out.stride(0), eps,
                      **rows_args(rows, out), ADD=False, NORM_D=False,
                      BLOCK=triton.next_power_of_2(h), num_warps=8 if h >= 4096 else 4,
                      **launch_args(x.device))
    return out


def add_rms_norm(h, delta, w, eps: float, impl: str = "auto",
                 delta_norm: torch.Tensor | None = None, rows: Rows | None = None):
    """h += delta, in place, and rms_norm(h) out, in one launch; with delta_norm, the delta
    normed first (h += rms_norm(delta, delta_norm)), as Gemma's output norms before their
    residual adds, still one launch; rows: as rms_norm's."""
    if not _triton(h, impl):
        return rows_ref(add_rms_norm_ref(h, delta, w, eps, delta_norm), rows)
    out = torch.empty_like(h)
    t, hid = h.shape
    norm_d = delta_norm is not None
    _rms_kernel[(t,)](h, delta, w, delta_norm if norm_d else w, out, hid, h.stride(0),
                      delta.stride(0), out.stride(0), eps, **rows_args(rows, out), ADD=True,
                      NORM_D=norm_d, BLOCK=triton.next_power_of_2(hid),
                      num_warps=8 if hid >= 4096 else 4, **launch_args(h.device))
    return out


def rope_(q, k, cos, sin, positions, impl: str = "auto") -> None:
    if not _triton(q, impl):
        return rope_ref(q, k, cos, sin, positions)
    t, _, d = q.shape
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("rope_: the head dimension must be contiguous")
    heads = q.shape[1] + k.shape[1]
    if (k.data_ptr() == q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size()
            and k.stride(0) == q.stride(0) and k.stride(1) == q.stride(1) == d):
        # q and k side by side in one qkv row (the engine's layout): one launch for both
        _rope_kernel[(t,)](q, cos, sin, positions, q.stride(0), d, heads, HALF=d // 2,
                           BLOCK_H=triton.next_power_of_2(heads), **launch_args(q.device))
        return None
    for x in (q, k):
        _rope_kernel[(t,)](x, cos, sin, positions, x.stride(0), x.stride(1), x.shape[1],
                           HALF=d // 2, BLOCK_H=triton.next_power_of_2(x.shape[1]),
                           **launch_args(x.device))
    return None


def _side_by_side(q, k, v) -> bool:
    """q, k, v heads packed in one row (the engine's qkv buffer), head dim contiguous."""
    d, es = q.shape[2], q.element_size()
    return (q.stride(2) == k.stride(2) == v.stride(2) == 1
            and q.stride(1) == k.stride(1) == v.stride(1) == d
            and q.stride(0) == k.stride(0) == v.stride(0)
            and k.data_ptr() == q.data_ptr() + q.shape[1] * d * es
            and v.data_ptr() == k.data_ptr() + k.shape[1] * d * es)


def _rms_args(rms, x: torch.Tensor) -> tuple:
    """Kernel arguments (h, stride, H, eps, RMS, BLOCK_HID) for rms = (h, eps) or None."""
    if rms is None:
        return x, 0, 0, 1.0, False, 1
    h, eps = rms
    if h.dim() != 2 or h.shape[0] != x.shape[0] or h.stride(1) != 1:
        raise ValueError(f"rms: h must be [T={x.shape[0]}, H] with unit column stride, got "
                         f"{tuple(h.shape)}")
    return h, h.stride(0), h.shape[1], float(eps), True, triton.next_power_of_2(h.shape[1])


def rope_write_kv_(q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping,
                   impl: str = "auto", rms: tuple[torch.Tensor, float] | None = None,
                   qk_norm: tuple | None = None,
                   kv_scale: tuple[float, float] = (1.0, 1.0)) -> None:
    """rope_(q, k, ...) then write_kv(k_cache, v_cache, k, v, slot_mapping): one launch on CUDA
    when q, k and v sit side by side in one row (the engine's qkv layout); otherwise the two
    ops. Shapes: q [T, Hq, D], k and v [T, Hk, D]; caches [NB, BS, Hk, D]; slot_mapping [T].
    rms = (h [T, H], eps): q and k are scaled in place by h's row factor before the rotation,
    and v on its way to the cache (v itself is left as it is): folded norms, see the module
    docstring. qk_norm = (q weight [D], k weight [D], eps): each q and k head through its
    RMSNorm (qk_norm_ref) before the rotation. kv_scale: the layer's (k_scale, v_scale) of an
    e4m3 cache (write_kv)."""
    from kernels.attention import write_kv
    if not _triton(q, impl) or not _side_by_side(q, k, v) or not (
            k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.shape[2:] == k.shape[1:] and v_cache.shape == k_cache.shape):
        if rms is not None:
            q.copy_(scale_rows_ref(q, rms))
            k.copy_(scale_rows_ref(k, rms))
            v = scale_rows_ref(v, rms)
        if qk_norm is not None:
            qk_norm_ref(q, k, qk_norm)
        rope_(q, k, cos, sin, positions, impl=impl)
        write_kv(k_cache, v_cache, k, v, slot_mapping, impl=impl, kv_scale=kv_scale)
        return None
    t, hq, d = q.shape
    if t == 0:
        return None
    kv_elems = k.shape[1] * d
    h, stride_h, hid, eps, on, block_hid = _rms_args(rms, q)
    parts, heads = ROPE_LAUNCH["parts"], hq + k.shape[1]
    qn, kn, qk_eps = qk_norm if qk_norm is not None else (q, q, 1.0)
    _rope_kv_kernel[(t, parts)](
        q, v, k_cache, v_cache, cos, sin, positions, slot_mapping, h, qn, kn, q.stride(0),
        v.stride(0), hq, heads, kv_elems, stride_h, hid, eps, float(qk_eps),
        *kv_scale_args(kv_scale, k_cache), HALF=d // 2,
        BLOCK_H=triton.next_power_of_2(triton.cdiv(heads, parts)),
        BLOCK_V=triton.next_power_of_2(triton.cdiv(kv_elems, parts)), RMS=on,
        BLOCK_HID=block_hid, QK_NORM=qk_norm is not None,
        num_warps=ROPE_LAUNCH["num_warps"], **kv_fp8_args(k_cache, q), **launch_args(q.device))
    return None


def silu_mul(gu, impl: str = "auto", rms: tuple[torch.Tensor, float] | None = None,
             act: str = "silu", rows: Rows | None = None):
    """act(gate) * up of gu [T, 2I] = [gate | up] (act: silu or gelu_pytorch_tanh); rms =
    (h [T, H], eps): gu scaled by h's row factor first (folded norms); rows: as rms_norm's,
    the launch then a program a row (kernels.fused_quant.SILU_ROWS_LAUNCH)."""
    if not _triton(gu, impl):
        return rows_ref(silu_mul_ref(gu, rms, act), rows)
    t, two_i = gu.shape
    inter = two_i // 2
    block, warps = SILU_LAUNCH["block"], SILU_LAUNCH["num_warps"]
    if rows is not None:
        block, warps = silu_rows_launch(inter)
        if block is None:                    # too wide for a program: two launches
            out = silu_mul(gu, impl, rms, act)
            quantize_rows(out, impl="triton", out=rows)
            return out
    out = torch.empty((t, inter), dtype=gu.dtype, device=gu.device)
    h, stride_h, hid, eps, on, block_hid = _rms_args(rms, gu)
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](
        gu, out, h, inter, gu.stride(0), out.stride(0), stride_h, hid, eps,
        **rows_args(rows, out), BLOCK=block, RMS=on, BLOCK_HID=block_hid, ACT=ACTS[act],
        num_warps=warps, **launch_args(gu.device))
    return out


def gate_mul(gu, act: str, impl: str = "auto", rms: tuple[torch.Tensor, float] | None = None,
             rows: Rows | None = None):
    """The MLP's act(gate) * up (silu_mul with the model's activation)."""
    return silu_mul(gu, impl=impl, rms=rms, act=act, rows=rows)
