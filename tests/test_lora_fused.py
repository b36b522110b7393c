"""The LoRA expand fused into its consumers (kernels/lora_fused.py): residual add + RMSNorm,
SiLU-gate and rope + KV write each take a pending delta from the split shrink and must give what
the separate expand followed by the plain consumer gives. Mixed ranks, adapters that leave a
slice out, base-only and padded segments, GQA heads, a padding row with KV slot -1. Under the
Triton interpreter in a child process; on GPU (marked gpu) the same checks in bf16."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def pool_for(K, slices, ranks_list, g, dtype, device, skip=True):
    """Adapter pool with one blob per (adapter, slice); adapter s skips slice j when
    (s + j) % 3 == 2."""
    parts, off, ns = [], 0, len(slices) - 1
    a_off = torch.full((ns, len(ranks_list)), -1, dtype=torch.int64)
    b_off = a_off.clone()
    for s, r in enumerate(ranks_list):
        for j in range(ns):
            if skip and (s + j) % 3 == 2:
                continue
            n = slices[j + 1] - slices[j]
            for table, size in ((a_off, r * K), (b_off, r * n)):
                table[j, s] = off
                pad = (-(off + size)) % 8
                parts += [torch.randn(size, generator=g) * 0.3, torch.zeros(pad)]
                off += size + pad
    return (torch.cat(parts).to(device, dtype), a_off.to(device), b_off.to(device),
            torch.tensor(ranks_list, dtype=torch.int32, device=device),
            (torch.rand(len(ranks_list), generator=g) + 0.5).to(device))


def segments(seg_sizes, T, device):
    starts, slots = [0], []
    for size, sl in seg_sizes:
        starts.append(starts[-1] + size)
        slots.append(sl)
    assert starts[-1] == T
    return (torch.tensor(starts + [T] * 2, dtype=torch.int32, device=device),     # 2 padded
            torch.tensor(slots + [-1] * 2, dtype=torch.int32, device=device))


def pending(x, slices, lora, segs, max_rank):
    from kernels.lora_fused import LoraDelta
    from kernels.sgmv_split import SplitConfig, shrink
    pool, a_off, b_off, ranks, scales = lora
    cfg = SplitConfig(block_m=16, block_n=32, k_chunk=32)      # several K chunks
    part = shrink(x, pool, a_off, ranks, *segs, len(slices) - 1, max_rank, cfg)
    return LoraDelta(part, pool, a_off, b_off, ranks, scales, slices, *segs, max_rank)


def check(device: str, dtype: torch.dtype, tol: float) -> int:
    from kernels import fused
    g = torch.Generator().manual_seed(1)
    T, K = 9, 64
    segs = segments([(3, 0), (2, -1), (1, 2), (3, 1)], T, device)
    ranks = [16, 5, 8]
    x = torch.randn(T, K, generator=g).to(device, dtype)
    checks = 0

    def both(slices, run):
        """run(lora) with the fused consumer, and with the delta expanded first."""
        lora = pool_for(K, slices, ranks, g, dtype, device)
        got = run(pending(x, slices, lora, segs, max(ranks)))
        return got, lora

    # residual add + norm (the o or down projection: one slice)
    H = 96
    d0 = torch.randn(T, H, generator=g).to(device, dtype)
    h0 = torch.randn(T, H, generator=g).to(device, dtype)
    w = torch.randn(H, generator=g).to(device, dtype)
    lora = pool_for(K, (0, H), ranks, g, dtype, device)
    h1, d1 = h0.clone(), d0.clone()
    out1 = fused.add_rms_norm(h1, d1, w, 1e-5, impl="triton",
                              lora=pending(x, (0, H), lora, segs, max(ranks)))
    h2, d2 = h0.clone(), d0.clone()
    pending(x, (0, H), lora, segs, max(ranks)).apply_(d2)
    assert (d2.float() - d0.float()).abs().max() > 0.1       # the delta is not negligible
    out2 = fused.add_rms_norm(h2, d2, w, 1e-5, impl="triton")
    torch.testing.assert_close(h1, h2, atol=tol, rtol=tol)
    torch.testing.assert_close(out1, out2, atol=tol, rtol=tol)
    checks += 1

    # SiLU-gate (the gate/up projection: two slices)
    inter = 40
    gu0 = torch.randn(T, 2 * inter, generator=g).to(device, dtype)
    lora = pool_for(K, (0, inter, 2 * inter), ranks, g, dtype, device)
    got = fused.silu_mul(gu0.clone(), impl="triton",
                         lora=pending(x, (0, inter, 2 * inter), lora, segs, max(ranks)))
    gu2 = gu0.clone()
    pending(x, (0, inter, 2 * inter), lora, segs, max(ranks)).apply_(gu2)
    torch.testing.assert_close(got, fused.silu_mul(gu2, impl="triton"), atol=tol, rtol=tol)
    checks += 1

    # rope + KV write (q/k/v: three slices; GQA 4 q heads, 2 kv heads, head dim 16)
    nq, nkv, D = 4, 2, 16
    slices = (0, nq * D, (nq + nkv) * D, (nq + 2 * nkv) * D)
    lora = pool_for(K, slices, ranks, g, dtype, device)
    qkv0 = torch.randn(T, slices[-1], generator=g).to(device, dtype)
    pos = torch.tensor([0, 3, 9, 2, 30, 7, 1, 5, 11], device=device)
    cos = torch.randn(64, D // 2, generator=g).to(device, dtype)
    sin = torch.randn(64, D // 2, generator=g).to(device, dtype)
    slot_map = torch.tensor([0, 5, -1, 9, 2, 14, 3, 7, 12], device=device)    # one padding row
    results = []
    for fuse in (True, False):
        qkv = qkv0.clone()
        kc = torch.full((4, 4, nkv, D), float("nan"), device=device, dtype=dtype)
        vc = kc.clone()
        q, k, v = (qkv[:, a:b].view(T, -1, D) for a, b in zip(slices, slices[1:]))
        p = pending(x, slices, lora, segs, max(ranks))
        if not fuse:
            p.apply_(qkv)
            p = None
        fused.rope_write_kv_(q, k, v, cos, sin, pos, kc, vc, slot_map, impl="triton", lora=p)
        results.append((qkv[:, :slices[2]], kc, vc))      # q and k rotated; the caches
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=10 * tol, rtol=10 * tol, equal_nan=True)
    assert results[0][1].isnan().sum() == results[1][1].isnan().sum() > 0   # slot -1: untouched
    checks += 1
    return checks


def test_lora_fused_consumers_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok") == 2, proc.stdout


@pytest.mark.gpu
def test_lora_fused_consumers_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert check("cuda", torch.bfloat16, 2e-2) == 3


if __name__ == "__main__":
    for dt, tol in ((torch.float32, 1e-4), (torch.float16, 2e-3)):
        print("ok", dt, check("cpu", dt, tol))
