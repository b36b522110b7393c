"""A published FP8 KV cache through the services as processes: the store, the worker and the
router serve the tiny model with a compressed-tensors kv_cache_scheme and per-layer scales
(tests/test_kv_scales.py's checkpoint form); the worker says it keeps its KV cache in e4m3 with
the checkpoint's scales, and a request on each demo adapter and on the base gets the greedy
tokens the same engine gives in process."""
from __future__ import annotations

import shutil

import pytest
import torch

from services.client.client import LorafleetClient
from tests.conftest import Stack
from tests.support import DEMO_ADAPTERS, MODEL_DIR
from tests.test_kv_scales import add_kv_scales

pytestmark = pytest.mark.slow
SCALES = [(0.6875, 1.375), (2.5, 0.4375), (0.3125, 3.25), (1.125, 0.8125)]
PROMPT = [5, 17, 42, 9, 77, 3]
NEW = 12


def in_process(model, adapter: str) -> list[int]:
    from services.worker.adapters.layout import staged_from_peft_dir
    from services.worker.config import EngineOptions
    from services.worker.engine.sequence import Sequence, Stopping
    from services.worker.startup.factory import build_engine
    built = build_engine(model, EngineOptions(device="cpu", dtype="float32"))
    assert built.engine.runner.kv_cache[0][0].dtype == torch.float8_e4m3fn
    slot = (built.pool.place(adapter, staged_from_peft_dir(DEMO_ADAPTERS / adapter, built.spec))
            if adapter else -1)
    out: list[int] = []
    done: list[bool] = []
    built.engine.submit(Sequence("r", PROMPT, slot=slot, stopping=Stopping(
        max_new_tokens=NEW, ignore_eos=True)), lambda ev: (out.extend(ev.token_ids),
                                                        ev.stop and done.append(True)))
    while not done:
        built.engine.step()
    return out


def test_the_services_serve_a_published_fp8_kv_cache_with_its_scales(tmp_path):
    model = tmp_path / "kv-model"
    shutil.copytree(MODEL_DIR, model)
    add_kv_scales(model, SCALES)
    stack = Stack(model, DEMO_ADAPTERS, tmp_path)
    try:
        got = {}
        with LorafleetClient(stack.router.addr, timeout=60) as c:
            for adapter in ["", *sorted(p.name for p in DEMO_ADAPTERS.iterdir())]:
                r = c.generate(adapter=adapter, prompt_ids=PROMPT, max_new_tokens=NEW,
                               ignore_eos=True, temperature=0)
                got[adapter] = list(r.token_ids)
        assert "KV cache in FP8 (e4m3) with the checkpoint's scales" in stack.workers[0].log()
    finally:
        stack.terminate()
    for adapter, tokens in got.items():
        assert tokens == in_process(model, adapter), adapter
