"""Pick the decode launch shape of the paged-attention kernel on this GPU: Llama-2-7B heads
(32 x 128, MHA), 64 sequences at ~192 tokens of context, bf16. Each config is checked against the
torch reference, then timed by CUDA-graph replay; the last line printed is the fastest correct
config as BLOCK_N,WARPS,STAGES (bench/engine/e2e.py --attn-config takes it).

    python -m bench.kernels.attn_tune
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch

from bench.lib.timing import timed
from kernels.attention_ref import paged_attention_ref
from kernels.attention_triton import paged_attention_triton


def case(batch=64, heads=32, dim=128, ctx=192, bs=16, dev="cuda"):
    g = torch.Generator(device=dev).manual_seed(0)
    blocks = batch * (ctx // bs + 1)
    k = torch.randn(blocks, bs, heads, dim, generator=g, device=dev).to(torch.bfloat16)
    v = torch.randn(blocks, bs, heads, dim, generator=g, device=dev).to(torch.bfloat16)
    tables = torch.randperm(blocks, generator=g, device=dev)[:batch * (ctx // bs + 1)]
    tables = tables.view(batch, -1).to(torch.int32).contiguous()
    q = torch.randn(batch, heads, dim, generator=g, device=dev).to(torch.bfloat16)
    pos = torch.randint(ctx - 40, ctx, (batch,), generator=g, device=dev).to(torch.int32)
    seq = torch.arange(batch, device=dev, dtype=torch.int32)
    return q, k, v, tables, seq, pos


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    q, k, v, tables, seq, pos = case()
    scale, ctx = 128 ** -0.5, tables.shape[1] * 16
    ref = paged_attention_ref(q.float(), k.float(), v.float(), tables, seq, pos, scale, ctx)
    best = None
    for bn, warps, stages in itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (1, 2, 3)):
        fn = lambda: paged_attention_triton(q, k, v, tables, seq, pos, scale, ctx,  # noqa: E731
                                            block_n=bn, num_warps=warps, num_stages=stages)
        try:
            err = (fn().float() - ref).abs().max().item()
            us = timed(fn)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
            print(f"{bn},{warps},{stages}: {type(exc).__name__}")
            continue
        ok = err < 5e-2
        print(f"{bn},{warps},{stages}: {us:7.2f} us  err {err:.3g}{'' if ok else '  WRONG'}",
              flush=True)
        if ok and (best is None or us < best[0]):
            best = (us, f"{bn},{warps},{stages}")
    kv_bytes = 2 * q.shape[0] * int(pos.float().mean() + 1) * 32 * 128 * 2
    print(f"KV bytes read ~{kv_bytes / 1e6:.0f} MB; best {best[0]:.1f} us")
    print(best[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
