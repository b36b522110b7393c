"""The published config.json fields of the full-size shapes the engine benchmarks build with
random weights (bench.engine.families, bench.engine.fp8, bench.kernels.gemm_layouts)."""

# the published config.json fields (the text model's, for Gemma 3) of each shape
CONFIGS = {
    "qwen3-8b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                 "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "vocab_size": 151936, "max_position_embeddings": 40960,
                 "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                 "tie_word_embeddings": False, "attention_bias": False,
                 "use_sliding_window": False, "sliding_window": None,
                 "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16"},
    "gemma-3-12b": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                    "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
                    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
                    "query_pre_attn_scalar": 256, "vocab_size": 262208,
                    "max_position_embeddings": 131072, "sliding_window": 1024,
                    "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
                    "rope_local_base_freq": 10000.0,
                    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                    "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
                    "final_logit_softcapping": None, "attn_logit_softcapping": None,
                    "tie_word_embeddings": True, "attention_bias": False,
                    "bos_token_id": 2, "eos_token_id": [1, 106], "torch_dtype": "bfloat16"},
    # Llama-2-7B: the serving benchmarks' shape (bench.engine.fp8's FP8 and bf16 rows)
    "llama-7b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                 "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
                 "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
                 "hidden_act": "silu", "tie_word_embeddings": False,
                 "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"},
    # Llama-3-70B: issue 46's FP8 base on one H200 (its bf16 weights, 141 GB, fit no one card)
    "llama-70b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                  "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                  "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
                  "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                  "hidden_act": "silu", "tie_word_embeddings": False,
                  "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16"},
}
