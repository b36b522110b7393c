"""Paged attention over the engine's KV block tables (see kernels.attention_ref for layouts).

On CUDA tensors these run the Triton kernels (kernels.attention_triton); elsewhere the torch
references. `impl="triton"` forces the kernels (tests run them under TRITON_INTERPRET=1 on CPU);
`impl="torch"` forces the references.
"""
from __future__ import annotations

from kernels.attention_ref import paged_attention_ref, write_kv_ref


def _use_triton(impl: str, x) -> bool:
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be auto, triton or torch, got {impl!r}")
    return impl == "triton" or (impl == "auto" and x.is_cuda)


def write_kv(k_cache, v_cache, k, v, slot_mapping, impl: str = "auto",
             kv_scale: tuple[float, float] = (1.0, 1.0)):
    """k_cache.view(-1, H_kv, D)[slot_mapping] = k (and v); slots < 0 skipped. kv_scale: the
    layer's (k_scale, v_scale) of an e4m3 cache (see write_kv_ref)."""
    if _use_triton(impl, k_cache):
        from kernels.kv_write_triton import write_kv_triton  # deferred: CPU engines skip triton
        return write_kv_triton(k_cache, v_cache, k, v, slot_mapping, kv_scale)
    return write_kv_ref(k_cache, v_cache, k, v, slot_mapping, kv_scale)


def paged_attention(q, k_cache, v_cache, block_tables, q_seq, q_pos, scale, max_context,
                    impl: str = "auto", split_kinds: bool = False, out=None, window: int = 0,
                    softcap: float = 0.0, kv_scale: tuple[float, float] = (1.0, 1.0)):
    """Causal attention of each row over its sequence's cache; see paged_attention_ref
    (window > 0: a sliding window of that many positions; softcap > 0: scores capped).
    split_kinds: the kernels' launch choice for steps with prompt chunks (see
    paged_attention_triton; the same outputs). out: a [T, H_q, D] tensor (unit last stride,
    any row and head strides: a view into a wider buffer) to write into; returns it.
    kv_scale: the layer's (k_scale, v_scale) of an e4m3 cache, which holds K / k_scale and
    V / v_scale (ignored for a cache of the model dtype)."""
    if out is not None and (out.shape != q.shape or out.stride(2) != 1
                            or out.dtype != q.dtype):
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} with unit last stride, "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    if _use_triton(impl, q):
        from kernels.attention_triton import paged_attention_triton
        return paged_attention_triton(q, k_cache, v_cache, block_tables, q_seq, q_pos, scale,
                                      max_context, split_kinds=split_kinds, out=out,
                                      window=window, softcap=softcap, kv_scale=kv_scale)
    res = paged_attention_ref(q, k_cache, v_cache, block_tables, q_seq, q_pos, scale,
                              max_context, window, softcap, kv_scale)
    return res if out is None else out.copy_(res)
