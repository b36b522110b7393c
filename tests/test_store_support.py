"""Helpers for the adapter-store tests (no tests here): a tiny base config, PEFT-shaped adapters
written with numpy + safetensors (no torch), and a small client for the store's gRPC API.
"""
from __future__ import annotations

import hashlib
import json
import pathlib

import grpc
import numpy as np
from safetensors.numpy import save, save_file

from services.common.gen.lorafleet.v1 import adapter_store_pb2 as pb, adapter_store_pb2_grpc

# A Llama-shaped base small enough to write adapters for in microseconds.
BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128}
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_base(folder: pathlib.Path) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(BASE))
    return path


def peft_config(**overrides) -> dict:
    """adapter_config.json as PEFT 0.21 writes it for a LoRA on a Llama."""
    cfg = {
        "alora_invocation_tokens": None, "alpha_pattern": {}, "arrow_config": None,
        "auto_mapping": None, "base_model_name_or_path": None, "bias": "none",
        "corda_config": None, "ensure_weight_tying": False, "eva_config": None,
        "exclude_modules": None, "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "kasa_config": None, "layer_replication": None,
        "layers_pattern": None, "layers_to_transform": None, "loftq_config": {},
        "lora_alpha": 8, "lora_bias": False, "lora_dropout": 0.0, "lora_ga_config": None,
        "megatron_config": None, "megatron_core": "megatron.core", "modules_to_save": None,
        "monteclora_config": None, "peft_type": "LORA", "peft_version": "0.21.2",
        "qalora_group_size": 16, "r": 4, "rank_pattern": {}, "revision": None,
        "target_modules": ["q_proj", "v_proj"], "target_parameters": None,
        "task_type": "CAUSAL_LM", "trainable_token_indices": None, "use_bdlora": None,
        "use_dora": False, "use_qalora": False, "use_rslora": False, "velora_config": None}
    cfg.update(overrides)
    return cfg


def in_out(module: str) -> tuple[int, int]:
    h, i, q, kv = 64, 128, 64, 32
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[module]


def key(layer: int, module: str, part: str) -> str:
    parent = "self_attn" if module in MODULES[:4] else "mlp"
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{part}.weight"


def lora_tensors(r: int = 4, targets=("q_proj", "v_proj"), layers=(0, 1), seed: int = 0,
                 dtype=np.float32) -> dict[str, np.ndarray]:
    """PEFT-named A [r, in] and B [out, r] tensors for every targeted module of every layer."""
    rng = np.random.default_rng(seed)
    out = {}
    for layer in layers:
        for module in targets:
            fan_in, fan_out = in_out(module)
            out[key(layer, module, "A")] = rng.standard_normal((r, fan_in)).astype(dtype)
            out[key(layer, module, "B")] = rng.standard_normal((fan_out, r)).astype(dtype)
    return out


def write_adapter(folder: pathlib.Path, config: dict | None = None,
                  tensors: dict | None = None, blob: bytes | None = None) -> pathlib.Path:
    """A PEFT adapter directory; `blob` replaces the safetensors file's bytes verbatim."""
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    if blob is not None:
        (folder / "adapter_model.safetensors").write_bytes(blob)
    elif tensors is not None:
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def good_adapter(folder: pathlib.Path, seed: int = 0, **config) -> pathlib.Path:
    cfg = peft_config(**config)
    return write_adapter(folder, cfg, lora_tensors(cfg["r"], cfg["target_modules"], seed=seed))


def safetensors_bytes(tensors: dict) -> bytes:
    return save(tensors)


def split(blob: bytes) -> tuple[dict, bytes]:
    """(header dict, data section) of a safetensors blob."""
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def join(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def bf16_blob(tensors: dict[str, np.ndarray]) -> bytes:
    """A safetensors blob of BF16 tensors (float32 truncated to its top 16 bits), written by hand
    since numpy has no bfloat16."""
    header, chunks, offset = {}, [], 0
    for name in sorted(tensors):
        bits = (tensors[name].astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(bits)]}
        chunks.append(bits)
        offset += len(bits)
    return join(header, b"".join(chunks))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class StoreClient:
    """Blocking client for the store's gRPC API, with error capture."""

    def __init__(self, addr: str):
        self.channel = grpc.insecure_channel(addr)
        self.stub = adapter_store_pb2_grpc.AdapterStoreStub(self.channel)

    def register(self, adapter_id: str, source: str, owner: str = "", aliases=(),
                 replace: bool = False, timeout: float = 10.0):
        return self.stub.Register(pb.RegisterRequest(
            id=adapter_id, source=source, owner=owner, aliases=list(aliases), replace=replace),
            timeout=timeout).adapter

    def resolve(self, name: str, tenant: str = ""):
        return self.stub.Resolve(pb.ResolveRequest(name=name, tenant=tenant), timeout=5).adapter

    def list(self, tenant: str = "", all_tenants: bool = False):
        return list(self.stub.List(pb.ListRequest(tenant=tenant, all_tenants=all_tenants),
                                   timeout=5).adapters)

    def delete(self, adapter_id: str) -> None:
        self.stub.Delete(pb.DeleteRequest(id=adapter_id), timeout=5)

    def fetch(self, adapter_id: str, version: str = "", timeout: float = 10.0, metadata=None):
        """(header, blob, sha256) of one Fetch stream, checking its framing."""
        chunks = list(self.stub.Fetch(pb.FetchRequest(id=adapter_id, version=version),
                                      timeout=timeout, metadata=metadata))
        assert chunks[0].WhichOneof("part") == "header"
        assert chunks[-1].WhichOneof("part") == "sha256"
        assert all(c.WhichOneof("part") == "data" for c in chunks[1:-1])
        return chunks[0].header, b"".join(c.data for c in chunks[1:-1]), chunks[-1].sha256

    def stats(self):
        return self.stub.Stats(pb.StoreStatsRequest(), timeout=5)

    def error(self, call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
        """Run call expecting an RpcError; return (code, details)."""
        try:
            call(*args, **kwargs)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        raise AssertionError(f"{call.__name__}{args} succeeded; expected an error")

    def close(self) -> None:
        self.channel.close()
