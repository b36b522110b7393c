"""Shared fixtures: a random HF checkpoint with PEFT adapters, and the stack on loopback."""
from __future__ import annotations

import pathlib

import pytest

from tests.hf_fixtures import ADAPTER_SPECS, make_adapter, make_base


@pytest.fixture(scope="session")
def hf_ckpt(tmp_path_factory):
    """(root, base model, {name: peft model}); root/base and root/adapters/<name> on disk."""
    root = tmp_path_factory.mktemp("hf")
    base = make_base(root / "base")
    peft_models = {n: make_adapter(base, root / "adapters", n, seed=i + 1)
                   for i, n in enumerate(ADAPTER_SPECS)}
    return root, base, peft_models


class Stack:
    """adapter-store + workers + router as processes; terminate() drains them all."""

    def __init__(self, model: pathlib.Path, adapters: pathlib.Path, log_dir: pathlib.Path,
                 workers: int = 1, worker_args=(), router_args=(), store_args=()):
        from tests.support import Service      # lazily: GPU-only runs lack grpc_health
        self.store = Service("adapter_store", ["--adapters-dir", str(adapters), "--model",
                                               str(model), "--db", ":memory:", *store_args],
                             log_dir).wait()
        self.workers = [Service("worker", ["--model", str(model), "--store", self.store.addr,
                                           "--device", "cpu", *worker_args], log_dir)
                        for _ in range(workers)]
        for w in self.workers:
            w.wait()
        wflags = [x for w in self.workers for x in ("--worker", w.addr)]
        self.router = Service("router", ["--store", self.store.addr, *wflags, *router_args],
                              log_dir).wait()

    @property
    def services(self):
        return [self.router, *self.workers, self.store]

    def terminate(self) -> list[int]:
        return [s.terminate() for s in self.services]
