"""Torch references for paged attention over the engine's KV block tables.

KV cache layout: k_cache, v_cache [num_blocks, block_size, H_kv, D]. Token p of sequence s lives
in block block_tables[s, p // block_size] at offset p % block_size; slot = block * block_size +
offset. GQA: query head h reads kv head h // (H_q / H_kv).
"""
from __future__ import annotations

import torch

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0


def write_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scale: tuple[float, float] = (1.0, 1.0)) -> None:
    """Store this step's keys and values: k_cache.view(-1, H_kv, D)[slot_mapping[t]] = k[t].

    Shapes: k, v [T, H_kv, D]; slot_mapping int64 [T]; a slot of -1 (padding rows) is skipped.
    An e4m3 cache (torch.float8_e4m3fn) stores k / k_scale and v / v_scale (kv_scale: the
    layer's, a checkpoint's calibrated scales or 1.0), clamped to +-448 and rounded to nearest
    even, as vLLM's `--kv-cache-dtype fp8` stores them; a cache of another dtype ignores them.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = kv_stored(k[keep], k_cache.dtype, kv_scale[0])
    v_cache.view(-1, *v_cache.shape[2:])[slots] = kv_stored(v[keep], v_cache.dtype, kv_scale[1])


def kv_stored(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as a cache of `dtype` stores it: in e4m3, x / scale (fp32, correctly rounded) clamped
    to +-448 first (torch's conversion makes larger values NaN); else plain conversion."""
    if dtype == FP8:
        x = x.float() / torch.tensor(float(scale), dtype=torch.float32, device=x.device)
        return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor,
                        scale: float, max_context: int, window: int = 0,
                        softcap: float = 0.0,
                        kv_scale: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Causal attention of each query row over its own sequence's cached keys and values.

    Semantics: for row t with s = q_seq[t], p = q_pos[t], w0 = max(0, p + 1 - window) with a
    sliding window (window > 0; transformers' `kv_idx > q_idx - sliding_window`), else 0:
        out[t, h] = softmax(cap(scale * q[t, h] @ K_s[w0:p+1, h // g].T)) @ V_s[w0:p+1, h // g]
    where K_s, V_s are sequence s's cached rows (this step's rows already written), and
    cap(x) = softcap * tanh(x / softcap) with a softcap > 0 (Gemma's), else x.
    Decode rows and chunked-prefill rows are the same case: a row attends to every position up to
    its own. Rows with q_seq < 0 (padding) produce zeros.

    Shapes: q [T, H_q, D]; k_cache, v_cache [NB, BS, H_kv, D] in q's dtype or e4m3 (read
    back as q's dtype, exactly, then times kv_scale's k_scale and v_scale, before the math);
    block_tables int32 [S, MB];
    q_seq, q_pos int32 [T]; max_context: an upper bound on p + 1 (a host int, for sizing).
    Returns [T, H_q, D] in q's dtype. Computed in fp32, in chunks of rows to bound memory.
    """
    t_rows, h_q, d = q.shape
    bs, h_kv = k_cache.shape[1], k_cache.shape[2]
    group = h_q // h_kv
    n_blk = min(block_tables.shape[1], (max_context + bs - 1) // bs)
    length = n_blk * bs
    out = torch.zeros_like(q)
    positions = torch.arange(length, device=q.device)
    chunk = max(1, (1 << 22) // max(1, length * h_kv * d))
    for lo in range(0, t_rows, chunk):
        hi = min(t_rows, lo + chunk)
        seq = q_seq[lo:hi].long()
        valid = seq >= 0
        tables = block_tables[seq.clamp(min=0), :n_blk].long()          # [t, n_blk]
        k = k_cache[tables].reshape(hi - lo, length, h_kv, d).to(q.dtype).float()  # [t, L, ..]
        v = v_cache[tables].reshape(hi - lo, length, h_kv, d).to(q.dtype).float()
        if k_cache.dtype == FP8:
            k, v = k * kv_scale[0], v * kv_scale[1]
        qq = q[lo:hi].float().view(hi - lo, h_kv, group, d)              # [t, H_kv, g, D]
        scores = torch.einsum("tkgd,tlkd->tkgl", qq, k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        mask = positions[None, :] > q_pos[lo:hi, None].long()            # [t, L]
        if window:
            mask |= positions[None, :] <= q_pos[lo:hi, None].long() - window
        scores.masked_fill_(mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("tkgl,tlkd->tkgd", probs, v).reshape(hi - lo, h_q, d)
        out[lo:hi] = torch.where(valid[:, None, None], o, 0).to(q.dtype)
    return out
