"""The shrink into column blocks (kernels/shrink_blocks.py) under the Triton interpreter, against
its torch reference and against the LoRA it stands for: one GEMM over [x | out] and
[W ; each block's Bt] equals x @ W plus sgmv_ref's delta. Mixed ranks, a slot without a block,
an adapter that lacks the projection, base rows, long segments, rank parts, K in one pass and
in chunks, and out and x as views of one wider buffer (the rows after the last segment, a
captured graph's padding, get zeros in out and keep x). (Run in a child process: the
interpreter must be switched on before triton loads.)"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent

# (T, K, ranks, segments (rows, slot), column block of each slot (-1: none), a_off present)
CASES = [
    (12, 96, [1, 8, 16, 4], [(3, 0), (1, 2), (4, -1), (2, 3)], [2, -1, 0, 5],
     [True, True, True, True]),
    (23, 64, [16, 8], [(17, 0), (4, 1)], [1, 0], [True, False]),     # 17 rows: 5 row tiles
    (5, 200, [2], [(5, 0)], [3], [True]),
]


def tables(T, K, ranks, segs, cols, has_a, blocks=8, dtype=torch.float32):
    """A pool (offsets multiples of 8), a [T, K + blocks * 16] buffer holding x, the o-like
    projection's Bt of each slot, and the tables."""
    from kernels.shrink_blocks import RB
    torch.manual_seed(T * 100 + K)
    n_out = 24
    parts, off, a_off, bts = [], 0, [], []
    for r, has in zip(ranks, has_a):
        a_off.append(off if has else -1)
        size = r * K
        parts += [torch.randn(size) * 0.1, torch.zeros((-size) % 8)]
        off += size + (-size) % 8
        bts.append(torch.randn(r, n_out) * 0.1)
    starts, slots = [0], []
    for rows, slot in segs:
        starts.append(starts[-1] + rows)
        slots.append(slot)
    covered = starts[-1]
    buf = torch.randn(T + 2, K + blocks * RB).to(dtype)          # 2 rows no segment covers
    return dict(
        buf=buf, x=buf[:, :K], out=buf[:, K:], pool=torch.cat(parts).to(dtype), n_out=n_out,
        a_off=torch.tensor(a_off, dtype=torch.int64),
        ranks=torch.tensor(ranks, dtype=torch.int32),
        scales=torch.rand(len(ranks)) + 0.5,
        col_slot=torch.tensor(cols, dtype=torch.int32),
        seg_start=torch.tensor(starts + [covered] * 2, dtype=torch.int32),  # 2 padded
        seg_slot=torch.tensor(slots + [-1] * 2, dtype=torch.int32), bts=bts, covered=covered)


def run_case(T, K, ranks, segs, cols, has_a, parts, block_k=None):
    from kernels.shrink_blocks import RB, shrink_blocks, shrink_blocks_ref
    from kernels.sgmv_ref import sgmv_ref
    c = tables(T, K, ranks, segs, cols, has_a)
    args = (c["pool"], c["a_off"], c["ranks"], c["scales"], c["col_slot"], c["seg_start"],
            c["seg_slot"])
    before = c["buf"].clone()
    ref_buf = c["buf"].clone()
    shrink_blocks_ref(ref_buf[:, K:], ref_buf[:, :K], *args)
    shrink_blocks(c["out"], c["x"], *args, parts=parts, block_k=block_k)
    got = c["buf"]
    assert torch.equal(got[:, :K], before[:, :K]), "x was written"
    assert torch.equal(got[c["covered"]:, :K], before[c["covered"]:, :K])
    assert not got[c["covered"]:, K:].any(), "rows after the last segment are not zeros"
    assert not ref_buf[c["covered"]:, K:].any()
    err = (got - ref_buf).abs().max().item()
    assert err < 1e-4, ("kernel against reference", parts, err)
    # the row LoRA: [x | out] @ [W ; Bt of each block] = x @ W + the LoRA delta
    blocks = c["out"].shape[1] // RB
    w = torch.randn(K, c["n_out"]) * 0.1
    stack = torch.zeros(blocks * RB, c["n_out"])
    b_off = torch.full((1, len(ranks)), -1, dtype=torch.int64)
    pool = c["pool"].float()
    for s, (r, col) in enumerate(zip(ranks, cols)):
        if col >= 0:
            stack[col * RB:col * RB + r] = c["bts"][s]
            stack[col * RB + r:(col + 1) * RB] = 7.0     # rows past the rank: out is 0 there
        if col >= 0 and has_a[s]:                     # sgmv_ref reads Bt from the pool
            b_off[0, s] = len(pool)
            pool = torch.cat([pool, c["bts"][s].reshape(-1)])
    rows = slice(0, c["covered"])
    fused = got[rows].float() @ torch.cat([w, stack])
    only = torch.where(c["col_slot"][c["seg_slot"].clamp(min=0).long()] >= 0, c["seg_slot"], -1)
    want = sgmv_ref(c["x"][rows].float() @ w, c["x"][rows].float(), pool,
                    c["a_off"].view(1, -1), b_off, c["ranks"], c["scales"], [0, c["n_out"]],
                    c["seg_start"].clamp(max=c["covered"]), only.to(torch.int32), 16)
    err = (fused - want).abs().max().item()
    assert err < 1e-3, ("the GEMM over the blocks against sgmv_ref", parts, err)
    return err


def test_shrink_blocks_matches_reference_and_the_lora_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok") == len(CASES) * 3


def test_shrink_blocks_refuses_bad_shapes():
    from kernels.shrink_blocks import shrink_blocks
    c = tables(*CASES[0])
    args = (c["pool"], c["a_off"], c["ranks"], c["scales"], c["col_slot"], c["seg_start"],
            c["seg_slot"])
    with pytest.raises(ValueError, match="width"):
        shrink_blocks(c["out"][:, :40], c["x"], *args)
    with pytest.raises(ValueError, match="parts"):
        shrink_blocks(c["out"], c["x"], *args, parts=3)
    with pytest.raises(ValueError, match="rows"):
        shrink_blocks(c["out"][:5], c["x"], *args)
    with pytest.raises(ValueError, match="ranks"):
        shrink_blocks(c["out"], c["x"], c["pool"], c["a_off"], c["ranks"].long(),
                      *args[3:])


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("parts,pdl", [(1, False), (4, True), (16, True)])
def test_shrink_blocks_compiles_for_hopper(parts, pdl):
    """The kernel compiles for sm_90 (ptxas, no GPU), with the PDL wait as a decode graph
    launches it, at the engine's row-LoRA width (32 blocks)."""
    from test_sgmv import compile_for_sm90
    from kernels.shrink_blocks import RB, SEARCH, _shrink_blocks_kernel
    types = ["*bf16"] * 3 + ["*i64", "*i32", "*fp32", "*i32", "*i32", "*i32"] + ["i32"] * 4
    consts = dict(W=32 * RB, RB=RB, PARTS=parts, BLOCK_K=4096, SEARCH=SEARCH, USE_PDL=pdl)
    assert compile_for_sm90(_shrink_blocks_kernel, types, consts, num_warps=4).asm["cubin"]


if __name__ == "__main__":
    for case in CASES:
        for parts, block_k in ((1, 32), (4, None), (16, None)):   # K in chunks, and one pass
            print("ok", case[:2], parts, run_case(*case, parts=parts, block_k=block_k))
