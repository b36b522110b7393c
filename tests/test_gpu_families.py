"""On a CUDA device, each new family through the Triton kernels (q/k norms in the rope launch,
GeGLU, windows in paged attention, per-row dynamic RoPE angles), CUDA-graph decode and mixed
steps and the warm-up: a mixed batch of three PEFT adapters and the base, with prompts past the
windows and the original RoPE length, gives transformers + PEFT's greedy tokens (fp32), and
nothing compiles after the warm-up. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from services.worker.adapters.layout import staged_from_peft_dir
from services.worker.engine.sequence import Sequence, Stopping
from services.worker.config import EngineOptions
from services.worker.startup.factory import build_engine
from tests.family_fixtures import hf_greedy, make_family
from tests.test_engine_parity import run_all

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("name", ["qwen3", "phi3-window", "gemma3", "qwen2-dynamic",
                                  "qwen3-yarn", "mistral-window"])
def test_family_on_gpu_matches_peft_and_compiles_nothing_after_the_warm_up(name, tmp_path):
    from kernels import compile_watch
    from services.worker.startup.warmup import Warmup
    root, base, peft = make_family(tmp_path, name, seed=len(name))
    opts = EngineOptions(device="cuda", dtype="float32", kv_cache_bytes=64 << 20,
                         block_size=16, max_batch_tokens=64, max_running=16, pool_slots=16,
                         graph_max_rank=32, graph_mixed_tokens=64)
    built = build_engine(root / "base", opts)
    built.pool.warm_up()                 # as the worker's start does (services/worker/app.py)
    Warmup(built.engine, built.pool, built.spec, 64, max_rank=32, max_running=16).run()
    late: list[str] = []
    compile_watch.install(late.append)
    slots = {a: built.pool.place(a, staged_from_peft_dir(root / "adapters" / a, built.spec))
             for a in peft}
    g = torch.Generator().manual_seed(len(name))
    seqs, expected = [], {}
    for i, adapter in enumerate([*peft, None, *peft, None]):
        ids = torch.randint(2, 256, (10 + 11 * i,), generator=g).tolist()
        rid = f"req{i}-{adapter}"
        seqs.append(Sequence(rid, ids, slot=slots[adapter] if adapter else -1,
                             stopping=Stopping(max_new_tokens=8, ignore_eos=True)))
        expected[rid] = hf_greedy(peft[adapter] if adapter else base, ids, 8)
    got, _ = run_all(built.engine, seqs)
    assert got == expected
    assert not late, late
