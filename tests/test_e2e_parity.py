"""Through the running services, every request of a concurrent mixed-adapter load gets exactly
the tokens transformers + PEFT greedy generate gives it alone."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from services.client.client import LorafleetClient
from tests.conftest import Stack
from tests.hf_fixtures import ADAPTER_SPECS

pytestmark = pytest.mark.slow


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_concurrent_mixed_adapters_match_peft(hf_ckpt, tmp_path):
    root, base, peft_models = hf_ckpt
    stack = Stack(root / "base", root / "adapters", tmp_path,
                  worker_args=["--kv-cache-bytes", "8MiB", "--block-size", "8"])
    try:
        g = torch.Generator().manual_seed(3)
        jobs = []
        for i, name in enumerate([*ADAPTER_SPECS, "", *ADAPTER_SPECS, ""] * 2):
            prompt = torch.randint(2, 256, (2 + 7 * (i % 6),), generator=g).tolist()
            ref = peft_models[name] if name else base
            jobs.append((name, prompt, hf_greedy(ref, prompt, 10)))
        with LorafleetClient(stack.router.addr) as client:
            def run(job):
                name, prompt, _ = job
                return client.generate(adapter=name, prompt_ids=prompt, max_new_tokens=10)
            with ThreadPoolExecutor(len(jobs)) as pool:
                results = list(pool.map(run, jobs))
        for (name, prompt, expected), resp in zip(jobs, results):
            assert list(resp.token_ids) == expected, (name, prompt)
            assert resp.adapter_id == name
    finally:
        assert all(code == 0 for code in stack.terminate())
