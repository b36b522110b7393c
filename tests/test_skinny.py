"""The decode GEMM with the LoRA expand in its epilogue (kernels/skinny.py) against F.linear +
the SGMV torch reference, under the Triton interpreter: with and without split K (the last
program of a tile sums the partials and the counters come back to zero), bias, q/k/v-like slices
with ranks that differ per adapter and per slice, untargeted slices, base-only and padded
segments, rows in several row tiles. (A child process: the interpreter must be on before triton
loads.) On GPU (marked gpu): the Llama-2-7B decode shapes in bf16 against an fp32 reference."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parent.parent


def problem(M, K, slices, ranks_list, seg_sizes, dtype, device="cpu", skip=True, seed=0):
    """x, W and a pool of adapters; adapter s skips slice j when (s + j) % 3 == 2 (if skip)."""
    g = torch.Generator().manual_seed(seed)
    parts, off, n_slots, ns = [], 0, len(ranks_list), len(slices) - 1
    a_off = torch.full((ns, n_slots), -1, dtype=torch.int64)
    b_off = a_off.clone()
    for s, r in enumerate(ranks_list):
        for j in range(ns):
            if skip and (s + j) % 3 == 2:
                continue
            n = slices[j + 1] - slices[j]
            for table, size in ((a_off, r * K), (b_off, r * n)):
                table[j, s] = off
                pad = (-(off + size)) % 8
                parts += [torch.randn(size, generator=g) * 0.1, torch.zeros(pad)]
                off += size + pad
    starts, slots = [0], []
    for size, sl in seg_sizes:
        starts.append(starts[-1] + size)
        slots.append(sl)
    assert starts[-1] == M
    d = torch.device(device)
    return dict(
        x=(torch.randn(M, K, generator=g)).to(d, dtype),
        w=(torch.randn(slices[-1], K, generator=g) / K ** 0.5).to(d, dtype),
        bias=(torch.randn(slices[-1], generator=g)).to(d, dtype),
        pool=torch.cat(parts).to(d, dtype), a_off=a_off.to(d), b_off=b_off.to(d),
        ranks=torch.tensor(ranks_list, dtype=torch.int32, device=d),
        scales=(torch.rand(n_slots, generator=g) + 0.5).to(d),
        slice_starts=tuple(slices),
        seg_start=torch.tensor(starts + [M] * 2, dtype=torch.int32, device=d),   # 2 padded
        seg_slot=torch.tensor(slots + [-1] * 2, dtype=torch.int32, device=d),
        max_rank=max(ranks_list))


def run_case(p, cfg, with_bias, with_lora):
    from kernels.sgmv_ref import sgmv_ref
    from kernels.skinny import LoraArgs, linear_lora
    names = ("pool", "a_off", "b_off", "ranks", "scales", "slice_starts", "seg_start",
             "seg_slot", "max_rank")
    bias = p["bias"] if with_bias else None
    ref = F.linear(p["x"].float(), p["w"].float(), None if bias is None else bias.float())
    if with_lora:
        f = {k: (v.float() if k == "pool" else v) for k, v in p.items() if k in names}
        ref = sgmv_ref(ref, p["x"].float(), *(f[k] for k in names))
    lora = LoraArgs(*(p[k] for k in names)) if with_lora else None
    out = linear_lora(p["x"], p["w"], bias, lora, cfg)
    if with_lora:    # the case must be one where a missing delta would show
        base = F.linear(p["x"].float(), p["w"].float(), None if bias is None else bias.float())
        assert (ref - base).abs().max() > 0.05 * ref.abs().max()
    return (out.float() - ref).abs().max().item() / ref.abs().max().item()


# (M, K, slices, ranks, segments (rows, slot))
CASES = [
    (10, 96, (0, 32, 64, 96), [1, 8, 16, 13], [(3, 0), (1, 2), (4, -1), (2, 3)]),
    (37, 128, (0, 64), [4, 32], [(20, 1), (17, 0)]),
    (5, 256, (0, 64, 128), [16, 2], [(2, 0), (3, 1)]),
    (20, 200, (0, 48), [8, 4], [(3, 0), (17, 1)]),
    (40, 64, (0, 32, 64), [16, 16, 8], [(13, 2), (10, -1), (17, 0)]),     # 24 masked rows
]


def test_skinny_matches_reference_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok") == 4 * len(CASES) + 2, proc.stdout


def test_pick_config_splits_k_only_for_few_column_tiles():
    from kernels.skinny import pick_config
    assert pick_config(64, 12288, 4096).split_k == 1         # 192 column tiles fill the card
    assert pick_config(64, 4096, 4096).split_k > 1           # 64 tiles: split K
    assert pick_config(64, 4096, 11008).split_k > 1


@pytest.mark.gpu
def test_skinny_llama_shapes_on_gpu():
    from kernels.skinny import MAX_ROWS, pick_config
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for m in (1, 16, 64, MAX_ROWS):
        for n, k, slices in ((12288, 4096, (0, 4096, 8192, 12288)), (4096, 4096, (0, 4096)),
                             (4096, 11008, (0, 4096))):
            segs = [(m // 2, 0), (m - m // 2, 1)] if m > 1 else [(1, 1)]
            p = problem(m, k, slices, [16, 8], segs, torch.bfloat16, "cuda", skip=False)
            for lora in (False, True):
                err = run_case(p, pick_config(m, n, k), True, lora)
                assert err < 2e-2, (m, n, k, lora, err)


if __name__ == "__main__":
    from kernels.skinny import SkinnyConfig, _counters
    for M, K, slices, ranks, segs in CASES:
        p = problem(M, K, slices, ranks, segs, torch.float32)
        for split in (1, 3):
            cfg = SkinnyConfig(block_n=16, block_k=32, split_k=split, stages=1)
            for with_bias, with_lora in ((False, False), (True, True)):
                err = run_case(p, cfg, with_bias, with_lora)
                assert err < 1e-4, (M, K, split, with_lora, err)
                print("ok", M, K, split, with_lora, err)
    assert int(_counters(torch.device("cpu")).abs().sum()) == 0     # counters reset themselves
    print("ok counters")
    p = problem(12, 96, (0, 32, 64, 96), [1, 8, 16, 13], [(3, 0), (1, 2), (6, 3), (2, 1)],
                torch.bfloat16)
    err = run_case(p, SkinnyConfig(block_n=32, block_k=32, split_k=2, stages=1), True, True)
    assert err < 2e-2, err
    print("ok bf16", err)
