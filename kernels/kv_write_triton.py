"""Triton KV writes: this step's keys and values into the paged caches (kernels.attention_ref's
write_kv_ref), in the model dtype or in e4m3 (x / the layer's scale, clamped and rounded:
kernels.fp8_tiles.kv_value)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_tiles import kv_fp8_args, kv_scale_args, kv_value
from kernels.pdl import launch_args, wait_then_release


@triton.jit
def _write_kv_kernel(k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, slot_ptr, stride_k, stride_v, n_elem,
                     k_scale, v_scale, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
                     KV_FP8: tl.constexpr = False, UPCAST: tl.constexpr = False):
    wait_then_release(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        i = tl.arange(0, BLOCK)
        for c in range(0, n_elem, BLOCK):
            ok = c + i < n_elem
            kk = tl.load(k_ptr + t.to(tl.int64) * stride_k + c + i, mask=ok)
            vv = tl.load(v_ptr + t.to(tl.int64) * stride_v + c + i, mask=ok)
            tl.store(k_cache_ptr + slot * n_elem + c + i,
                     kv_value(kk, k_cache_ptr.dtype.element_ty, KV_FP8, UPCAST, k_scale),
                     mask=ok)
            tl.store(v_cache_ptr + slot * n_elem + c + i,
                     kv_value(vv, v_cache_ptr.dtype.element_ty, KV_FP8, UPCAST, v_scale),
                     mask=ok)


def write_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, slot_mapping: torch.Tensor,
                    kv_scale: tuple[float, float] = (1.0, 1.0)) -> None:
    """k_cache.view(-1, H_kv, D)[slot_mapping[t]] = k[t] (and v); slots < 0 skipped. No syncs.
    An e4m3 cache stores k / kv_scale[0] and v / kv_scale[1] clamped to +-448 and rounded
    (kernels.attention_ref.write_kv_ref); a cache of the model dtype ignores kv_scale.

    Shapes: k, v [T, H_kv, D] (each row contiguous); caches [NB, BS, H_kv, D] contiguous;
    slot_mapping int64 [T].
    """
    t_rows, h_kv, d = k.shape
    if k_cache.shape[2:] != (h_kv, d) or v_cache.shape != k_cache.shape or v.shape != k.shape:
        raise ValueError(f"k/v {tuple(k.shape)} do not fit caches {tuple(k_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("caches must be contiguous")
    if k.stride(2) != 1 or k.stride(1) != d or v.stride(2) != 1 or v.stride(1) != d:
        raise ValueError("each row of k and v must be contiguous")
    if slot_mapping.shape != (t_rows,) or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError("slot_mapping must be int64 [T]")
    if t_rows == 0:
        return
    n_elem = h_kv * d
    _write_kv_kernel[(t_rows,)](k_cache, v_cache, k, v, slot_mapping, k.stride(0), v.stride(0),
                                n_elem, *kv_scale_args(kv_scale, k_cache),
                                BLOCK=min(4096, triton.next_power_of_2(n_elem)),
                                **kv_fp8_args(k_cache, k), **launch_args(k.device))
