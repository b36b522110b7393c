"""kernels/columns_rope.py: column LoRA's q/k/v expand with rope and the KV write in one launch,
under the Triton interpreter, against the two launches it replaces (expand_columns, then
rope_write_kv_) and against their torch references: GQA and MHA heads, a head dim whose half is
not a power of two, base-only segments (rope and cache write, no LoRA), a slot without a column
block, adapters that skip a slice, rows without a cache slot, repeated positions (a prefill run)
and empty padded segments. (A child process: the interpreter must be on before triton loads.)"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name: (n_q, n_kv, head dim, [(rows, slot)], column block of each slot (-1: none), ranks, dtype)
CASES = {
    "gqa_fp32": (4, 2, 32, [(3, 0), (2, -1), (4, 1), (1, 2)], [1, 0, -1], [16, 4, 8],
                 torch.float32),
    "mha_bf16": (2, 2, 32, [(5, 1), (3, 0), (2, -1)], [2, 0], [8, 16], torch.bfloat16),
    "gqa_d24_fp32": (2, 1, 24, [(2, -1), (6, 0)], [0], [3], torch.float32),
}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def build(n_q, n_kv, d, segs, cols, ranks, dtype):
    from test_sgmv_split import tables
    t_rows = sum(n for n, _ in segs)
    slices = (0, n_q * d, (n_q + n_kv) * d, (n_q + 2 * n_kv) * d)
    c = tables(t_rows, 64, slices, ranks, segs, dtype)
    a_off, b_off, ranks_t, scales, _, seg_start, seg_slot, _ = c["args"]
    pool, x = c["pool"], c["x"]
    v_cols = torch.zeros(t_rows, (max(cols) + 1) * 3 * 16 + 8)[:, 5:].to(dtype)   # a view
    for s, col in enumerate(cols):
        for j in range(3):
            if col >= 0 and a_off[j, s] >= 0:
                r, ao = int(ranks_t[s]), int(a_off[j, s])
                a = pool[ao:ao + r * 64].view(r, 64).float()
                v_cols[:, (col * 3 + j) * 16:(col * 3 + j) * 16 + r] = (x.float() @ a.T).to(dtype)
    max_pos, bs, nb = 40, 4, 8
    freqs = torch.outer(torch.arange(max_pos).float(), torch.rand(d // 2) + 0.1)
    positions = torch.randint(0, max_pos, (t_rows,))
    positions[1:4] = torch.tensor([7, 7, 8])            # a prefill run, a repeated position
    slot_mapping = torch.randperm(nb * bs)[:t_rows]
    slot_mapping[2] = -1                                # a row without a cache slot
    return dict(y=c["y"], v_cols=v_cols, col=torch.tensor(cols, dtype=torch.int32), pool=pool,
                b_off=b_off, ranks=ranks_t, scales=scales, slices=slices, seg_start=seg_start,
                seg_slot=seg_slot, n_q=n_q, n_kv=n_kv, d=d, cos=freqs.cos().to(dtype),
                sin=freqs.sin().to(dtype), positions=positions, slot_mapping=slot_mapping,
                caches=(torch.zeros(nb, bs, n_kv, d, dtype=dtype),
                        torch.zeros(nb, bs, n_kv, d, dtype=dtype)))


def run_fused(c, impl):
    from kernels.columns_rope import columns_rope_write_kv_
    y, kc, vc = c["y"].clone(), c["caches"][0].clone(), c["caches"][1].clone()
    columns_rope_write_kv_(y, c["v_cols"], c["col"], c["pool"], c["b_off"], c["ranks"],
                           c["scales"], c["slices"], c["seg_start"], c["seg_slot"], c["n_q"],
                           c["n_kv"], c["cos"], c["sin"], c["positions"], kc, vc,
                           c["slot_mapping"], impl=impl, align=8)
    return y[:, :c["n_q"] * c["d"]], kc, vc


def run_two_launches(c, lora: bool = True):
    """expand_columns (the split kernel) then rope_write_kv_ (its Triton kernel)."""
    from kernels.fused import rope_write_kv_
    from kernels.sgmv_split import expand_columns
    y, kc, vc = c["y"].clone(), c["caches"][0].clone(), c["caches"][1].clone()
    if lora:
        expand_columns(y, c["v_cols"], c["col"], c["pool"], c["b_off"], c["ranks"], c["scales"],
                       c["slices"], c["seg_start"], c["seg_slot"], 16, align=8)
    t, nq, nkv, d = y.shape[0], c["n_q"], c["n_kv"], c["d"]
    q = y[:, :nq * d].view(t, nq, d)
    k = y[:, nq * d:(nq + nkv) * d].view(t, nkv, d)
    v = y[:, (nq + nkv) * d:].view(t, nkv, d)
    rope_write_kv_(q, k, v, c["cos"], c["sin"], c["positions"], kc, vc, c["slot_mapping"],
                   impl="triton")
    return y[:, :nq * d], kc, vc


def check(name: str) -> dict:
    spec = CASES[name]
    c = build(*spec)
    fused = run_fused(c, "triton")
    ref = run_fused(c, "torch")
    if c["d"] // 2 & (c["d"] // 2 - 1):     # rope_write_kv_'s kernel wants a power-of-two half
        two = ref
        c0 = dict(c, v_cols=torch.zeros_like(c["v_cols"]))
        no_lora = run_fused(c0, "torch")
    else:
        two = run_two_launches(c)
        no_lora = run_two_launches(c, lora=False)
    err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(fused, two))
    err_ref = max(float((a.float() - b.float()).abs().max()) for a, b in zip(fused, ref))
    lora = max(float((a.float() - b.float()).abs().max()) for a, b in zip(fused, no_lora))
    return {"case": name, "err": err, "err_ref": err_ref, "lora": lora,
            "tol": TOL[spec[-1]]}


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, *CASES], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["case"]: r for r in map(json.loads, proc.stdout.splitlines())}


@pytest.mark.parametrize("name", list(CASES))
def test_columns_rope_matches_the_two_launches(interpreted, name):
    r = interpreted[name]
    assert r["err"] <= r["tol"] and r["err_ref"] <= 10 * r["tol"], r
    assert r["lora"] > 10 * r["tol"], r           # the LoRA is there to be lost


def test_columns_rope_checks_its_layout():
    from kernels.columns_rope import columns_rope_write_kv_
    c = build(*CASES["gqa_fp32"])
    args = (c["v_cols"], c["col"], c["pool"], c["b_off"], c["ranks"], c["scales"])
    with pytest.raises(ValueError, match="slices"):
        columns_rope_write_kv_(c["y"], *args, (0, 64, 96, 160), c["seg_start"], c["seg_slot"],
                               4, 2, c["cos"], c["sin"], c["positions"], *c["caches"],
                               c["slot_mapping"])
    with pytest.raises(ValueError, match="impl"):
        columns_rope_write_kv_(c["y"], *args, c["slices"], c["seg_start"], c["seg_slot"], 4, 2,
                               c["cos"], c["sin"], c["positions"], *c["caches"],
                               c["slot_mapping"], impl="cuda")


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_columns_rope_compiles_with_vector_loads_and_fits():
    """For sm_90 with PDL at head dim 128: adapter weights, q/k/v, angles and cache rows in
    vector loads and stores, and four programs an SM (the grid the wrapper launches)."""
    from kernels.columns_rope import _columns_rope_kernel
    from test_pdl import KERNELS
    from test_sgmv import _ptxas_usage, compile_for_sm90
    types, consts = KERNELS["columns_rope._columns_rope_kernel"]
    kernel = compile_for_sm90(_columns_rope_kernel, types, dict(consts, USE_PDL=True),
                              num_stages=1)
    ptx = kernel.asm["ptx"]
    assert "ld.global.b16" not in ptx and "st.global.b16" not in ptx
    regs, _ = _ptxas_usage(kernel)
    assert 4 * ((regs + 7) // 8 * 8) * 32 * 4 <= 65536, regs


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))
    for case_name in sys.argv[1:]:
        print(json.dumps(check(case_name)), flush=True)
