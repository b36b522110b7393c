"""bench.engine.mixed_step's kernel kinds: each kernel a step launches counted where it belongs
(the LoRA kernels, cuBLAS and the FP8 GEMM, attention, norms and RoPE, the rest)."""
from __future__ import annotations

import pytest

from bench.engine.mixed_step import kind_of


@pytest.mark.parametrize("name,kind", [
    ("_sgmv_kernel", "lora"), ("_shrink_kernel", "lora"), ("_expand_kernel", "lora"),
    ("_one_launch_kernel", "lora"), ("_shrink_blocks_kernel", "lora"),
    ("nvjet_tst_192x64_64x5_1x2_h_bz_coopB_TNN", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x64x64", "gemm"),
    ("_fp8_gemm_kernel", "gemm"), ("_paged_attn_kernel", "attention"),
    ("_split_combine_kernel", "attention"), ("_rms_kernel", "norms"),
    ("_rope_kv_kernel", "norms"), ("_silu_mul_kernel", "norms"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
     "other"),
])
def test_kernels_are_counted_by_kind(name, kind):
    assert kind_of(name) == kind
