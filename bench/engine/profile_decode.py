"""Where a decode step's GPU time goes: torch.profiler over eager decode steps of the
Llama-7B-shaped engine (fewer layers: per-layer costs are what matter), kernels by total time.

    python -m bench.engine.profile_decode --layers 4 --batch 64 --distinct 32
"""
from __future__ import annotations

import argparse
import sys

import torch

from bench.engine.build import decode_engine


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--distinct", type=int, default=32)
    a = p.parse_args()
    eng = decode_engine(a.layers, a.batch, a.distinct, cuda_graphs=False, max_new=40)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
