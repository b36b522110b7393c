"""Paged attention over the engine's KV block tables (see kernels.attention_ref for layouts)."""
from __future__ import annotations

from kernels.attention_ref import paged_attention_ref, write_kv_ref


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """k_cache.view(-1, H_kv, D)[slot_mapping] = k (and v); slots < 0 skipped."""
    write_kv_ref(k_cache, v_cache, k, v, slot_mapping)


def paged_attention(q, k_cache, v_cache, block_tables, q_seq, q_pos, scale, max_context):
    """Causal attention of each row over its sequence's cache; see paged_attention_ref."""
    return paged_attention_ref(q, k_cache, v_cache, block_tables, q_seq, q_pos, scale, max_context)
