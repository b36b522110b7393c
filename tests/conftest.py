"""Shared fixtures: a random HF checkpoint with PEFT adapters, and the stack on loopback.

torch, transformers and peft are imported inside the fixtures that need them, so the
torch-free tests (policies, scenarios, configs) run where torch is not installed."""
from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest

# One intra-op thread for torch (OpenMP, BLAS) in the test processes and in what they start:
# `make test` runs two pytest processes on two cores, so torch's second thread (one per core
# by default) has no core of its own, and OpenMP's waiting threads spin on the core the other
# process needs (the engine tests took twice the CPU for the same work). The CPU workers run
# one thread already (--cpu-threads 1). An OMP_NUM_THREADS set outside wins.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


@pytest.fixture(scope="session")
def hf_ckpt(tmp_path_factory):
    """(root, base model, {name: peft model}); root/base and root/adapters/<name> on disk."""
    from tests.hf_fixtures import ADAPTER_SPECS, make_adapter, make_base
    root = tmp_path_factory.mktemp("hf")
    base = make_base(root / "base")
    peft_models = {n: make_adapter(base, root / "adapters", n, seed=i + 1)
                   for i, n in enumerate(ADAPTER_SPECS)}
    return root, base, peft_models


def write_lora(path: pathlib.Path, base_config: dict, rank: int = 4, seed: int = 0,
               targets=("q_proj", "v_proj"), std: float = 0.05) -> pathlib.Path:
    """A PEFT LoRA adapter written directly (adapter_config.json + safetensors, no peft import):
    random A and B for `targets` in every layer of the base whose config.json is base_config."""
    import torch
    from safetensors.torch import save_file
    hidden = base_config["hidden_size"]
    head_dim = hidden // base_config["num_attention_heads"]
    kv = base_config.get("num_key_value_heads") or base_config["num_attention_heads"]
    inter = base_config["intermediate_size"]
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv * head_dim),
              "v_proj": (hidden, kv * head_dim), "o_proj": (hidden, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}          # module: (in, out)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(base_config["num_hidden_layers"]):
        for m in targets:
            parent = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            stem = f"base_model.model.model.layers.{layer}.{parent}.{m}"
            fan_in, fan_out = shapes[m]
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * std
            tensors[f"{stem}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * std
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
        "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}))
    return path


@pytest.fixture(scope="session")
def hf_tiny():
    """(tokenizer, model): the embedded tiny model in transformers, fp32, the reference the
    served one is checked against (its chat template included)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from tests.support import MODEL_DIR
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, torch_dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="session")
def lora_fleet(tmp_path_factory):
    """(base dir, adapters dir): the tiny random Llama and 50 rank-4 adapters a00..a49."""
    from tests.hf_fixtures import make_base
    root = tmp_path_factory.mktemp("fleet")
    make_base(root / "base")
    config = json.loads((root / "base" / "config.json").read_text())
    for i in range(50):
        write_lora(root / "adapters" / f"a{i:02d}", config, seed=i + 1)
    return root / "base", root / "adapters"


@pytest.fixture(scope="session")
def long_context(tmp_path_factory):
    """(base dir, adapters dir): a tiny base with a 4096-token context (long generations) and
    adapters "long" and "other"."""
    from tests.hf_fixtures import make_base
    root = tmp_path_factory.mktemp("longctx")
    make_base(root / "base", max_position_embeddings=4096)
    config = json.loads((root / "base" / "config.json").read_text())
    write_lora(root / "adapters" / "long", config, seed=7)
    write_lora(root / "adapters" / "other", config, seed=8)
    return root / "base", root / "adapters"


class Stack:
    """adapter-store + workers + router as processes; terminate() drains them all.

    env: extra environment for every process (e.g. S3 credentials)."""

    def __init__(self, model: pathlib.Path, adapters: pathlib.Path, log_dir: pathlib.Path,
                 workers: int = 1, worker_args=(), router_args=(), store_args=(), env=None):
        from tests.support import Service      # lazily: GPU-only runs lack grpc_health
        started = []                            # stopped again if a later one fails to start
        try:
            self.store = Service("adapter_store", ["--adapters-dir", str(adapters), "--model",
                                                   str(model), "--db", ":memory:", *store_args],
                                 log_dir, env=env)
            started.append(self.store)
            self.store.wait()
            self.workers = [Service("worker", ["--model", str(model), "--store",
                                               self.store.addr, "--device", "cpu",
                                               *worker_args], log_dir, env=env)
                            for _ in range(workers)]
            started += self.workers
            for w in self.workers:
                w.wait()
            wflags = [x for w in self.workers for x in ("--worker", w.addr)]
            self.router = Service("router", ["--store", self.store.addr, *wflags,
                                             *router_args], log_dir, env=env)
            started.append(self.router)
            self.router.wait()
        except BaseException:
            for service in reversed(started):
                service.kill()
            raise

    @property
    def services(self):
        return [self.router, *self.workers, self.store]

    def terminate(self) -> list[int]:
        return [s.terminate() for s in self.services]


class ResidencyWatch:
    """Follows one worker's WatchResidency stream on a thread: the latest load and per-adapter
    residency, for tests that check what a worker holds and runs."""

    def __init__(self, addr: str):
        import threading
        import grpc
        from services.common.gen.lorafleet.v1 import worker_pb2 as wpb, worker_pb2_grpc
        self._chan = grpc.insecure_channel(addr)
        self._call = worker_pb2_grpc.WorkerStub(self._chan).WatchResidency(
            wpb.WatchResidencyRequest(watcher="test"))
        self.load = wpb.WorkerLoad()
        self.adapters: dict = {}
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        import grpc
        try:
            for update in self._call:
                with self._cond:
                    if update.snapshot:
                        self.adapters = {}
                    for a in update.adapters:
                        if a.tier == 0 and not a.loading:      # TIER_UNSPECIFIED: removed
                            self.adapters.pop(a.id, None)
                        else:
                            self.adapters[a.id] = a
                    self.load = update.load
                    self._cond.notify_all()
        except grpc.RpcError:
            pass

    def gpu_resident(self) -> set[str]:
        with self._cond:
            return {a.id for a in self.adapters.values() if a.tier == 1}   # GPU

    def rows(self, adapter_id: str) -> int:
        a = self.adapters.get(adapter_id)
        return 0 if a is None else a.running + a.waiting

    def wait(self, predicate, timeout: float = 10.0) -> None:
        """Block until predicate(self) holds (AssertionError after timeout)."""
        import time
        end = time.monotonic() + timeout
        with self._cond:
            while not predicate(self):
                left = end - time.monotonic()
                assert left > 0, f"timed out: load {self.load}, adapters {list(self.adapters)}"
                self._cond.wait(min(left, 0.2))

    def close(self) -> None:
        self._call.cancel()
        self._chan.close()


@pytest.fixture(scope="session")
def observed(tmp_path_factory):
    """tests/observed.py's Observed: one stack with /metrics, traces and the HTTP gateway,
    after a small mixed run; shared by the metrics, dashboard, trace and status-page tests."""
    from tests.observed import Observed
    obs = Observed(tmp_path_factory.mktemp("observed"))
    yield obs
    assert all(code == 0 for code in obs.close())
