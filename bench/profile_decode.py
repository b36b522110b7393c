"""Where a decode step's GPU time goes: torch.profiler over eager decode steps of the
Llama-7B-shaped engine (fewer layers: per-layer costs are what matter), kernels by total time.

    python bench/profile_decode.py --layers 4 --batch 64 --distinct 32
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from bench.e2e_gpu_bench import (_NullTokenizer, adapter_tensors, llama7b_spec,  # noqa: E402
                                 random_weights)
from services.worker.adapter_layout import build_layout  # noqa: E402
from services.worker.factory import EngineOptions, assemble  # noqa: E402
from services.worker.sequence import Sequence, Stopping  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--distinct", type=int, default=32)
    a = p.parse_args()
    dev = torch.device("cuda")
    spec = llama7b_spec(a.layers)
    opts = EngineOptions(device="cuda", dtype="bfloat16", kv_cache_bytes=4 << 30,
                         max_batch_tokens=8192, max_running=128, pool_bytes=2 << 30,
                         pool_slots=64, max_model_len=1024, cuda_graphs=False)
    built = assemble(spec, random_weights(spec, dev, torch.bfloat16), _NullTokenizer(), opts,
                     dev, torch.bfloat16)
    slots = [built.pool.place(f"a{i}", build_layout(adapter_tensors(spec, 16, i + 1, dev),
                                                    {"r": 16, "lora_alpha": 32}, spec,
                                                    torch.bfloat16)) for i in range(a.distinct)]
    eng = built.engine
    for i in range(a.batch):
        eng.submit(Sequence(f"r{i}", list(range(3, 131)), slot=slots[i % len(slots)],
                            stopping=Stopping(max_new_tokens=40, ignore_eos=True)), lambda e: 0)
    for _ in range(8):                                      # prefill + warm decode steps
        eng.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
