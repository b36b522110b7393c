"""services.worker.startup.precompile: the one-layer engines of its children (the same KV blocks,
the checkpoint's first layer only), warm-up shares that add up to the whole warm-up, real child
processes that finish their share, and the fingerprint a finished warm-up leaves in the kernel
cache (CPU: the children's graph forwards need CUDA and are not run here)."""
from __future__ import annotations

import dataclasses

import pytest

from services.worker.config import EngineOptions
from services.worker.model.checkpoint import read_checkpoint
from services.worker.startup import precompile
from services.worker.startup.factory import build_engine
from services.worker.startup.precompile import WarmShape
from services.worker.startup.warmup import Warmup
from tests.support import MODEL_DIR

OPTS = EngineOptions(max_batch_tokens=64, max_running=16, pool_bytes=16 << 20, pool_slots=8)
SHAPE = WarmShape(max_batch_tokens=64, max_rank=16, max_running=16, prefill_with_decode=24)


@pytest.fixture
def cache(tmp_path):
    from triton import knobs
    saved = knobs.cache.dir
    knobs.cache.dir = str(tmp_path / "kernels")
    yield tmp_path / "kernels"
    knobs.cache.dir = saved


def test_a_child_engine_has_the_first_layer_only_and_the_same_kv_blocks():
    import torch
    full = build_engine(MODEL_DIR, OPTS)
    layers = full.spec.num_layers
    assert layers > 1
    one = build_engine(MODEL_DIR, precompile.child_options(OPTS, layers), layers=1)
    assert one.spec.num_layers == 1 and len(one.engine.runner.model.w["layers"]) == 1
    assert one.engine.scheduler.blocks.num_blocks == full.engine.scheduler.blocks.num_blocks
    first = full.engine.runner.model.w["layers"][0]["qkv"]
    assert torch.equal(one.engine.runner.model.w["layers"][0]["qkv"], first)
    raw = read_checkpoint(MODEL_DIR, torch.float32, torch.device("cpu"), layers=1)
    assert any(k.startswith("model.layers.0.") for k in raw)
    assert not any(k.startswith("model.layers.1.") for k in raw)
    assert "model.embed_tokens.weight" in raw and "model.norm.weight" in raw


def test_the_warm_up_shares_add_up_to_the_whole_warm_up():
    built = build_engine(MODEL_DIR, dataclasses.replace(OPTS, max_prefill_with_decode=24))

    def steps(part: int, parts: int) -> int:
        return Warmup(built.engine, built.pool, built.spec, 64, max_rank=16, max_running=16,
                      prefill_with_decode=24, part=part, parts=parts).run().steps
    whole = steps(0, 1)
    shares = [steps(i, 3) for i in range(3)]
    assert all(shares) and sum(shares) == whole


def test_child_processes_run_their_shares_and_a_finished_warm_up_is_remembered(cache):
    digest = precompile.fingerprint(str(MODEL_DIR), OPTS, SHAPE)
    assert not precompile.is_warm(digest)
    (cache / "AAAA").mkdir(parents=True)                 # a kernel cached before the start
    children = precompile.Children(str(MODEL_DIR), OPTS, SHAPE, 2)
    (cache / "BBBB").mkdir()                             # one the children add
    assert children.wait(300) == 2
    assert (children.cached_before, children.compiled) == (1, 1)   # what the log reports
    precompile.mark_warm(digest)
    assert precompile.is_warm(digest)
    other = precompile.fingerprint(str(MODEL_DIR), OPTS, dataclasses.replace(SHAPE, max_rank=32))
    assert other != digest and not precompile.is_warm(other)
