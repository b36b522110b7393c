"""Paged attention tests: the Triton kernels (under TRITON_INTERPRET=1, in one child process) and
the torch reference, both against torch SDPA over each row's gathered contiguous keys and values.

Batches mix decode rows, chunked-prefill runs, padding rows and contexts that end on, before and
after block boundaries, with GQA groups of 1, 2, 3 and 8.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels.attention_ref import paged_attention_ref, write_kv_ref  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}

# name: (dtype, H_q, H_kv, D, block size, rows_per_program, block_n, row layout)
CASES = {
    "mixed_gqa2_bf16": ("bf16", 4, 2, 32, 4, None, 64, "mixed"),
    "mixed_mha_fp16_runs4": ("fp16", 2, 2, 16, 16, 4, 16, "mixed"),
    "mixed_gqa3_fp32_d24": ("fp32", 6, 2, 24, 4, 1, 16, "mixed"),
    "decode_gqa8_fp16": ("fp16", 8, 1, 32, 16, None, 16, "decode"),
    "decode_mha_bf16_d24": ("bf16", 4, 4, 24, 16, None, 16, "decode"),   # tiles = KV blocks
    # T == S: the wrapper's decode path (decode_config's launch: with this few programs, the
    # context in parts); the "decode" cases above carry a padding row (T > S), which the
    # wrapper treats as prefill
    "step_mha_bf16": ("bf16", 4, 4, 32, 16, None, None, "decode_step"),
    "step_gqa4_fp16_bs4": ("fp16", 8, 2, 16, 4, None, None, "decode_step"),
    "step_mha_bf16_one_block_tiles": ("bf16", 4, 4, 32, 16, None, 16, "decode_step"),
    "prefill_runs_bf16": ("bf16", 4, 2, 16, 4, 8, 16, "prefill"),
    "odd_positions_fp32": ("fp32", 4, 1, 16, 4, 4, 16, "odd"),
}


def _rows(layout: str, lens: list[int]):
    """(q_seq, q_pos) rows: decode rows at len-1, prefill runs ending at len-1, padding rows."""
    if layout == "decode":
        rows = [(s, n - 1) for s, n in enumerate(lens)] + [(-1, 0)]
    elif layout == "decode_step":               # a row a sequence, as graphs replay: T == S
        rows = [(s, n - 1) for s, n in enumerate(lens)]
    elif layout == "prefill":
        rows = [(0, p) for p in range(lens[0])] + [(1, p) for p in range(lens[1] - 7, lens[1])]
    elif layout == "odd":                       # same sequence twice, gaps, repeated positions
        rows = [(0, 3), (0, 5), (0, 6), (1, 0), (0, 2), *[(2, 9)] * 6, (2, 10), (-1, 0), (1, 1)]
    else:
        rows = [(0, lens[0] - 1), (-1, 0)]
        rows += [(1, p) for p in range(lens[1] - 11, lens[1])]
        rows += [(2, lens[2] - 1), (3, lens[3] - 1)]
        rows += [(4, p) for p in range(0, lens[4])] + [(-1, 0), (5, lens[5] - 1)]
    return rows


def build_case(spec, seed: int = 0, device: str = "cpu"):
    dtype_name, h_q, h_kv, d, bs, _, _, layout = spec
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    lens = [1, 2 * bs + 3, bs, bs + 1, 5, 3 * bs - 1]          # around block boundaries
    if layout == "prefill":
        lens = [3 * bs + 2, 4 * bs]
    if layout == "odd":
        lens = [7, 2, 11]
    mb = max((n + bs - 1) // bs for n in lens) + 1
    nb = len(lens) * mb + 3
    perm = torch.randperm(nb, generator=gen)                     # scattered physical blocks
    wide = torch.cat([perm[:len(lens) * mb].view(len(lens), mb), torch.zeros(len(lens), 2,
                      dtype=torch.int64)], dim=1).to(torch.int32)
    block_tables = wide[:, :mb]                                  # strided rows, as the engine's
    k_cache = torch.randn(nb, bs, h_kv, d, generator=gen).to(dtype)
    v_cache = torch.randn(nb, bs, h_kv, d, generator=gen).to(dtype)
    rows = _rows(layout, lens)
    q = torch.randn(len(rows), h_q, d, generator=gen).to(dtype)
    dev = torch.device(device)
    return dict(q=q.to(dev), k_cache=k_cache.to(dev), v_cache=v_cache.to(dev),
                block_tables=block_tables.to(dev),
                q_seq=torch.tensor([s for s, _ in rows], dtype=torch.int32, device=dev),
                q_pos=torch.tensor([p for _, p in rows], dtype=torch.int32, device=dev),
                scale=d ** -0.5, max_context=max(lens), dtype=dtype)


def sdpa_reference(c, window: int = 0, softcap: float = 0.0):
    """Per row: gather K, V of positions 0..p of its sequence (p - window + 1..p with a
    window), run torch SDPA in fp32 (scores, tanh cap and softmax spelled out with a softcap)."""
    q, kc, vc, bt = (c[n].float().cpu() for n in ("q", "k_cache", "v_cache", "block_tables"))
    bs, h_kv = kc.shape[1], kc.shape[2]
    group = q.shape[1] // h_kv
    out = torch.zeros_like(q)
    for t, (s, p) in enumerate(zip(c["q_seq"].tolist(), c["q_pos"].tolist())):
        if s < 0:
            continue
        pos = torch.arange(max(0, p + 1 - window) if window else 0, p + 1)
        blocks = bt[s].long()[pos // bs]
        k = kc[blocks, pos % bs].repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = vc[blocks, pos % bs].repeat_interleave(group, dim=1).transpose(0, 1)
        if softcap:
            scores = torch.tanh(q[t][:, None] @ k.transpose(1, 2) * c["scale"] / softcap)
            out[t] = (torch.softmax(scores * softcap, -1) @ v)[:, 0]
        else:
            out[t] = F.scaled_dot_product_attention(q[t][:, None], k, v,
                                                    scale=c["scale"])[:, 0]
    return out


def _args(c):
    return (c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["q_seq"], c["q_pos"],
            c["scale"], c["max_context"])


def max_err(out, ref):
    return float((out.float().cpu() - ref).abs().max())


# the context cut into parts (flash-decoding): name -> (case, parts). 16-key tiles over
# contexts of up to 47 tokens, so that several parts hold keys: decode steps (MHA, GQA, a head
# dim of 24), a padding row, and prefill runs of 4 rows (rows masked out of a whole part)
SPLIT_CASES = {"step_mha_bf16_split2": ("step_mha_bf16_one_block_tiles", 2),
               "step_mha_bf16_split4": ("step_mha_bf16_one_block_tiles", 4),
               "decode_gqa8_fp16_split8": ("decode_gqa8_fp16", 8),
               "decode_mha_bf16_d24_split4": ("decode_mha_bf16_d24", 4),
               "mixed_mha_fp16_runs4_split2": ("mixed_mha_fp16_runs4", 2)}


# split_kinds: the mixed rows' decode rows in a launch of their own (decode_config's for S rows:
# with this few programs, the context in 8 parts; "one_part": its one-block launch forced),
# the runs in the prefill launch
KIND_CASES = {"mixed_gqa2_bf16_kinds": ("mixed_gqa2_bf16", None),
              "mixed_mha_fp16_runs4_kinds": ("mixed_mha_fp16_runs4", None),
              "mixed_gqa3_fp32_d24_kinds_one_part": ("mixed_gqa3_fp32_d24", "one_part")}


# sliding windows (Mistral's, Gemma 3's) and score softcapping: name -> (case, window, softcap,
# splits, split_kinds). Windows shorter and longer than a block, starting mid-tile; the context
# in parts with the window's tiles spread over them; prefill runs whose rows' windows differ
WINDOW_CASES = {"mixed_gqa2_bf16_window5": ("mixed_gqa2_bf16", 5, 0.0, 1, False),
                "mixed_gqa2_bf16_window6_kinds": ("mixed_gqa2_bf16", 6, 0.0, None, True),
                "prefill_runs_bf16_window7_cap": ("prefill_runs_bf16", 7, 2.0, 1, False),
                "step_mha_bf16_window13_split4": ("step_mha_bf16_one_block_tiles", 13, 0.0, 4,
                                                  False),
                "step_gqa4_fp16_window9": ("step_gqa4_fp16_bs4", 9, 0.0, None, False),
                "decode_gqa8_fp16_window20_split8": ("decode_gqa8_fp16", 20, 0.0, 8, False),
                "odd_positions_fp32_window3_cap": ("odd_positions_fp32", 3, 1.5, 1, False),
                "mixed_mha_fp16_runs4_window1": ("mixed_mha_fp16_runs4", 1, 0.0, 2, False)}


def run_window_case(name: str, device: str = "cpu") -> dict:
    from kernels.attention_triton import paged_attention_triton
    base, window, softcap, splits, kinds = WINDOW_CASES[name]
    spec = CASES[base]
    c = build_case(spec, seed=len(base), device=device)
    out = paged_attention_triton(*_args(c), rows_per_program=spec[5], block_n=spec[6],
                                 splits=splits, split_kinds=kinds, window=window,
                                 softcap=softcap)
    err = max_err(out, sdpa_reference(c, window, softcap))
    # the window must matter: the full-context answer differs
    full = max_err(out, sdpa_reference(c, 0, softcap))
    tol = TOL[c["dtype"]]
    return {"case": name, "err": err, "tol": tol, "ok": err <= tol and full > 10 * tol}


def run_kinds_case(name: str, device: str = "cpu") -> dict:
    from kernels import attention_triton as at
    base, override = KIND_CASES[name]
    spec = CASES[base]
    c = build_case(spec, seed=len(base), device=device)
    if override:
        at.DECODE_OVERRIDE.update(at.DECODE_CONFIG)
    try:
        out = at.paged_attention_triton(*_args(c), rows_per_program=spec[5], block_n=spec[6],
                                        splits=1 if spec[6] else None, split_kinds=True)
    finally:
        at.DECODE_OVERRIDE.clear()
    err, tol = max_err(out, sdpa_reference(c)), TOL[c["dtype"]]
    return {"case": name, "err": err, "tol": tol, "ok": err <= tol}


def run_triton_case(name: str, device: str = "cpu") -> dict:
    from kernels.attention_triton import paged_attention_triton
    if name in KIND_CASES:
        return run_kinds_case(name, device)
    if name in WINDOW_CASES:
        return run_window_case(name, device)
    base, splits = SPLIT_CASES.get(name, (name, None))
    spec = CASES[base]
    if splits is None and spec[6] is not None:
        splits = 1      # a case that names its tile runs unsplit; the others take decode_config's
    c = build_case(spec, seed=len(base), device=device)
    out = paged_attention_triton(*_args(c), rows_per_program=spec[5], block_n=spec[6],
                                 splits=splits)
    err, tol = max_err(out, sdpa_reference(c)), TOL[c["dtype"]]
    return {"case": name, "err": err, "tol": tol, "ok": err <= tol}


def run_write_kv_case(device: str = "cpu") -> dict:
    """Triton write_kv against the reference, then attention over what it wrote."""
    from kernels.attention import paged_attention, write_kv
    c = build_case(CASES["mixed_gqa2_bf16"], seed=3, device=device)
    t_rows, h_kv, d = 9, c["k_cache"].shape[2], c["k_cache"].shape[3]
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(t_rows, 3 * h_kv * d, generator=gen).to(device, c["dtype"])
    k, v = (qkv[:, i * h_kv * d:(i + 1) * h_kv * d].reshape(t_rows, h_kv, d) for i in (1, 2))
    n_slots = c["k_cache"].shape[0] * c["k_cache"].shape[1]
    slots = torch.randperm(n_slots, generator=gen)[:t_rows]
    slots[[2, 5]] = -1
    slots = slots.to(device)
    ref_k, ref_v = c["k_cache"].clone(), c["v_cache"].clone()
    write_kv_ref(ref_k, ref_v, k, v, slots)
    write_kv(c["k_cache"], c["v_cache"], k, v, slots, impl="triton")
    same = torch.equal(ref_k, c["k_cache"]) and torch.equal(ref_v, c["v_cache"])
    out = paged_attention(*_args(c), impl="triton")
    err = max_err(out, sdpa_reference(c))
    return {"case": "write_kv", "err": err, "tol": TOL[c["dtype"]],
            "ok": same and err <= TOL[c["dtype"]]}


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, *CASES, *SPLIT_CASES, *KIND_CASES,
                           *WINDOW_CASES, "write_kv"], env=env,
                          cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if rows and "skip" in rows[0]:
        pytest.skip(rows[0]["skip"])
    return {r["case"]: r for r in rows}


@pytest.mark.parametrize("name", [*CASES, *SPLIT_CASES, *KIND_CASES, *WINDOW_CASES,
                                  "write_kv"])
def test_triton_matches_sdpa(interpreted, name):
    assert interpreted[name]["ok"], interpreted[name]


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_sdpa(name):
    c = build_case(CASES[name], seed=len(name))
    assert max_err(paged_attention_ref(*_args(c)), sdpa_reference(c)) <= TOL[c["dtype"]]


@pytest.mark.parametrize("name", list(WINDOW_CASES))
def test_reference_window_and_softcap_match_sdpa(name):
    base, window, softcap = WINDOW_CASES[name][:3]
    c = build_case(CASES[base], seed=len(base))
    out = paged_attention_ref(*_args(c), window=window, softcap=softcap)
    assert max_err(out, sdpa_reference(c, window, softcap)) <= TOL[c["dtype"]]


def test_dispatch_and_checks():
    from kernels.attention import paged_attention
    from kernels.attention_triton import paged_attention_triton
    c = build_case(CASES["decode_gqa8_fp16"])
    assert torch.equal(paged_attention(*_args(c)), paged_attention_ref(*_args(c)))
    with pytest.raises(ValueError):
        paged_attention(*_args(c), impl="cuda")
    for bad in (dict(c, q_seq=c["q_seq"].long()), dict(c, k_cache=c["k_cache"].float()),
                dict(c, q=c["q"][:, :, :8])):
        with pytest.raises((TypeError, ValueError)):
            paged_attention_triton(*_args(bad))


# _paged_attn_kernel's and _split_combine_kernel's argument types (compile_for_sm90)
# (qk_scale, window, v_scale, then the strides and H_q)
ATTN_TYPES = (["*bf16"] * 4 + ["*i32"] * 3 + ["*fp32"] * 2 + ["i32"] * 4 + ["fp32", "i32", "fp32"]
              + ["i32"] * 11)
COMBINE_TYPES = ["*bf16", "*fp32", "*fp32", "*i32"] + ["i32"] * 4


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_kernels_compile_for_hopper():
    from test_sgmv import compile_for_sm90
    from kernels.attention_triton import _paged_attn_kernel, _split_combine_kernel
    from kernels.kv_write_triton import _write_kv_kernel
    types = ATTN_TYPES
    consts = dict(GROUP=4, GROUP_PAD=4, ROWS=16, D=128, D_PAD=128, BLOCK_N=64,
                  DOT_PREC="tf32", UPCAST=False, ALIGNED=False, SPLITS=1, USE_PDL=False,
                  ROW_KIND=0, SOFTCAP=0.0)
    assert compile_for_sm90(_paged_attn_kernel, types, consts).asm["cubin"]
    assert compile_for_sm90(_paged_attn_kernel, types, dict(consts, SOFTCAP=50.0)).asm["cubin"]
    # the context in 4 parts, and their combine; split_kinds' two launches
    assert compile_for_sm90(_paged_attn_kernel, types, dict(consts, SPLITS=4)).asm["cubin"]
    for kind in (0, 1):
        assert compile_for_sm90(_split_combine_kernel, COMBINE_TYPES,
                                dict(SPLITS=4, D=128, D_PAD=128, USE_PDL=True, ROW_KIND=kind),
                                num_warps=1).asm["cubin"]
    for kind in (1, 2):
        assert compile_for_sm90(_paged_attn_kernel, types, dict(consts, ROW_KIND=kind)
                                ).asm["cubin"]
    types = ["*bf16"] * 4 + ["*i64"] + ["i32"] * 3 + ["fp32"] * 2
    assert compile_for_sm90(_write_kv_kernel, types, dict(BLOCK=1024, USE_PDL=False)).asm["cubin"]


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("t_rows,h_kv,d", [(64, 32, 128), (16, 32, 128), (8, 32, 128),
                                           (4, 32, 128), (1, 32, 128), (64, 8, 128),
                                           (128, 4, 128), (64, 8, 256)])
def test_decode_configs_compile_for_hopper(t_rows, h_kv, d):
    """Each decode launch that decode_config picks compiles for sm_90 with PDL, for MHA and
    GQA heads of 128 and Gemma 3's 256, as the decode path launches it (16-token blocks:
    16-key tiles are ALIGNED)."""
    from test_sgmv import compile_for_sm90
    from kernels.attention_triton import _paged_attn_kernel, decode_config
    import triton
    group = (32 if d == 128 else 16) // h_kv
    cfg = decode_config(t_rows, h_kv, group, head_dim=d)
    types = ATTN_TYPES
    consts = dict(GROUP=group, GROUP_PAD=group, ROWS=triton.cdiv(16, group), D=d, D_PAD=d,
                  BLOCK_N=cfg["block_n"], DOT_PREC="tf32", UPCAST=False,
                  ALIGNED=cfg["block_n"] == 16, SPLITS=cfg.get("splits", 1), USE_PDL=True,
                  ROW_KIND=0, SOFTCAP=0.0)
    assert compile_for_sm90(_paged_attn_kernel, types, consts, num_stages=cfg["num_stages"],
                            num_warps=cfg["num_warps"]).asm["cubin"]


def test_decode_config_by_programs_and_group(monkeypatch):
    """The decode launch follows the H200 scans (bench/results/ab/attn-launch-scan*-h200.md), by
    programs (rows x KV heads, in 128-wide heads: attn-launch-scan-h100-q16-d256.md): one warp on one-block tiles from 1024, 32-key tiles on four
    warps from 512 (64-key with 8+ query heads a KV head), then the context in parts: one-block
    tiles in 4 above 128, 64-key tiles in 4 above 64, in 8 below; an override wins."""
    from kernels import attention_triton as at
    one, few, fewest = at.DECODE_CONFIG, at.FEW_PROGRAMS_CONFIG, at.FEWEST_PROGRAMS_CONFIG
    assert at.decode_config(64, 32, 1) is one and at.decode_config(32, 32, 1) is one
    assert at.decode_config(128, 8, 4) is one
    assert at.decode_config(16, 32, 1) is few and at.decode_config(64, 8, 4) is few
    assert at.decode_config(128, 4, 8) is fewest
    assert at.decode_config(8, 32, 1) is at.SPLIT_ONE_BLOCK_CONFIG
    assert at.decode_config(32, 8, 4) is at.SPLIT_ONE_BLOCK_CONFIG
    assert at.decode_config(64, 4, 8) is at.SPLIT_ONE_BLOCK_CONFIG
    assert at.decode_config(4, 32, 1) is at.SPLIT4_CONFIG
    assert at.decode_config(1, 32, 1) is at.SPLIT8_CONFIG
    assert at.decode_config(1, 1, 1) is at.SPLIT8_CONFIG
    assert at.SPLIT_ONE_BLOCK_CONFIG["block_n"] == 16 and at.SPLIT_ONE_BLOCK_CONFIG["splits"] == 4
    assert at.SPLIT4_CONFIG["splits"] == 4 and at.SPLIT8_CONFIG["splits"] == 8
    assert "splits" not in one and "splits" not in few and "splits" not in fewest
    # programs counted in 128-wide heads: Gemma-3-12B's 8 KV heads of 256 at batch 64 take the
    # one-warp launch (the H100 scan: 39.9 us against 45.6 for 32-key tiles on four warps)
    assert at.decode_config(64, 8, 2, head_dim=256) is one
    assert at.decode_config(64, 8, 2, head_dim=128) is few
    assert at.decode_config(32, 8, 2, head_dim=256) is few
    assert at.decode_config(64, 8, 4, head_dim=64) is few
    monkeypatch.setattr(at, "DECODE_OVERRIDE", {"block_n": 32, "num_warps": 2, "num_stages": 3})
    assert at.decode_config(64, 32, 1) == {"block_n": 32, "num_warps": 2, "num_stages": 3}


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", [*CASES, *SPLIT_CASES, *WINDOW_CASES])
def test_triton_on_gpu(name):
    r = run_triton_case(name, device="cuda")
    # On the GPU fp32 dots may use tf32 for P @ V; allow that.
    assert r["err"] <= max(r["tol"], 2e-3), r


@pytest.mark.gpu
@needs_cuda
def test_write_kv_on_gpu():
    assert run_write_kv_case(device="cuda")["ok"]


if __name__ == "__main__":                                      # child: interpreted cases
    from test_sgmv import interpreter_unsupported
    if (why := interpreter_unsupported()) is not None:
        print(json.dumps({"skip": why}))
        sys.exit(0)
    for case_name in sys.argv[1:]:
        result = run_write_kv_case() if case_name == "write_kv" else run_triton_case(case_name)
        print(json.dumps(result), flush=True)
