"""The synthetic models and adapters every benchmark uses: the model shapes (Llama-2-7B, a small
GPU shape with the 7B's heads, the embedded demo model's) as Hugging Face config dicts, the 7B's
ModelSpec, random base weights, and the one random PEFT adapter maker. torch and the worker's
modules are imported where tensors or specs are made, so importing this stays light."""
from __future__ import annotations

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")       # the adapters' default targets

SHAPES = {
    # Llama-2-7B: hidden 4096, intermediate 11008, 32 layers, 32 heads (MHA), vocab 32000
    "7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
           "vocab_size": 32000, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"},
    # a small GPU shape with the 7B's head size, vocabulary and context (GPU tests: the same
    # kernels' code paths in seconds): hidden 1024, 4 layers, 8 heads, 4,096 positions
    "small": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128,
              "vocab_size": 32000, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"},
    # the embedded demo model's shape: hidden 128, 4 layers, 4 query heads over 2 KV heads
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "vocab_size": 1024, "max_position_embeddings": 512, "torch_dtype": "float32"},
}


def model_config(shape: str) -> dict:
    """A Llama checkpoint's config.json for one of SHAPES."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2, **SHAPES[shape]}


def llama7b_spec(layers: int = 32):
    """The worker's ModelSpec of model_config("7b") (`layers` of its 32 layers)."""
    from services.worker.model.spec import ModelSpec
    c = model_config("7b")
    return ModelSpec(architecture=c["architectures"][0], vocab_size=c["vocab_size"],
                     hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
                     num_layers=layers, num_heads=c["num_attention_heads"],
                     num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                     rms_norm_eps=c["rms_norm_eps"], rope_theta=c["rope_theta"],
                     rope_scaling=None, max_position=c["max_position_embeddings"],
                     tie_word_embeddings=c["tie_word_embeddings"], qkv_bias=False,
                     eos_token_ids=(c["eos_token_id"],), bos_token_id=c["bos_token_id"],
                     torch_dtype=c["torch_dtype"], name="llama-2-7b-shaped-random")


def module_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """PEFT target -> (in, out) features, from a config dict."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q = cfg["num_attention_heads"] * hd
    kv = (cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) * hd
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def adapter_tensors(model, rank: int, seed: int, *, targets=TARGETS, device="cpu",
                    std: float = 0.01, dtype=None) -> dict:
    """A random LoRA adapter, PEFT-named A/B tensors for `targets` of every layer: A [rank, in]
    and B [out, rank], N(0, std^2) drawn in that order from one generator seeded `seed` on
    `device` (float32, then `dtype` if given). model: a ModelSpec or a config dict."""
    import torch
    if isinstance(model, dict):
        shapes, layers = module_shapes(model), model["num_hidden_layers"]
    else:
        shapes, layers = {m: model.in_out(m) for m in targets}, model.num_layers
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for layer in range(layers):
        for m in targets:
            parent = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            stem = f"base_model.model.model.layers.{layer}.{parent}.{m}"
            k, n = shapes[m]
            a = torch.randn(rank, k, generator=g, device=device) * std
            b = torch.randn(n, rank, generator=g, device=device) * std
            out[f"{stem}.lora_A.weight"] = a if dtype is None else a.to(dtype)
            out[f"{stem}.lora_B.weight"] = b if dtype is None else b.to(dtype)
    return out


def random_weights(spec, device, dtype) -> dict:
    """The engine's weight dict (fused qkv and gate_up, norms of ones) for `spec`, std 0.02."""
    import torch
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, std=0.02):
        t = torch.randn(*shape, generator=g, device=device, dtype=torch.float32)
        return (t * std).to(dtype)
    h, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size
    layers = [{"in_norm": torch.ones(h, device=device, dtype=dtype),
               "post_norm": torch.ones(h, device=device, dtype=dtype),
               "qkv": rnd(q + 2 * kv, h), "o": rnd(h, q), "gate_up": rnd(2 * i, h),
               "down": rnd(h, i)} for _ in range(spec.num_layers)]
    return {"embed": rnd(spec.vocab_size, h), "norm": torch.ones(h, device=device, dtype=dtype),
            "lm_head": rnd(spec.vocab_size, h), "layers": layers}


def weight_bytes(weights: dict) -> int:
    n = sum(t.numel() * t.element_size() for k, t in weights.items() if k != "layers")
    return n + sum(t.numel() * t.element_size() for layer in weights["layers"]
                   for t in layer.values())


class NullTokenizer:
    """The benches measure token throughput; text is not produced."""
    def decode(self, ids, skip_special_tokens=True):
        return ""
