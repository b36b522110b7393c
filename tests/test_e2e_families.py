"""The new families through the running services (issue 47): a tiny checkpoint of each and three
PEFT adapters in the store's --adapters-dir; a concurrent mixed load of every adapter and the
base gets through the router exactly the tokens transformers + PEFT greedy generate gives each
request alone. Prompts of 9 to 86 tokens: longer than Gemma 3's window (16; interleaved sliding
and global layers, q/k norms, GeGLU, final logit softcap), Mistral's (16) and Phi-3's (24; its
fused qkv_proj and gate_up_proj adapters sliced at placement), and than Qwen3's yarn RoPE's
original length (32). The same for Gemma 3's multimodal form
(Gemma3ForConditionalGeneration, served as its text model), whose adapters carry the vision
tower's LoRA tensors too: the store accepts them, the worker leaves those tensors unplaced."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from services.client.client import LorafleetClient
from tests.conftest import Stack
from tests.family_fixtures import hf_greedy, make_family

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", ["gemma3", "gemma3-mm", "qwen3-yarn", "phi3-window",
                                    "mistral-window"])
def test_mixed_adapters_through_the_stack_match_peft(tmp_path, family):
    root, base, peft = make_family(tmp_path / family, family, seed=3)
    g = torch.Generator().manual_seed(5)
    jobs = []
    for i, name in enumerate([*peft, "", *peft, ""]):
        prompt = torch.randint(2, 256, (9 + 11 * i,), generator=g).tolist()   # 9 .. 86 tokens
        jobs.append((name, prompt, hf_greedy(peft[name] if name else base, prompt, 8)))
    stack = Stack(root / "base", root / "adapters", tmp_path,
                  worker_args=["--kv-cache-bytes", "8MiB", "--block-size", "8"])
    try:
        with LorafleetClient(stack.router.addr) as client:
            def run(job):
                name, prompt, _ = job
                # the reference generates past EOS (hf_greedy): so do these
                return client.generate(adapter=name, prompt_ids=prompt, max_new_tokens=8,
                                       ignore_eos=True)
            with ThreadPoolExecutor(len(jobs)) as pool:
                results = list(pool.map(run, jobs))
        for (name, prompt, expected), resp in zip(jobs, results):
            assert list(resp.token_ids) == expected, (name, len(prompt))
            assert resp.adapter_id == name
    finally:
        assert all(code == 0 for code in stack.terminate())
