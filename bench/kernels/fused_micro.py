"""Launch shapes of the decoder's elementwise launches after the GEMM that feeds them (H200).

Each case is a CUDA graph of `--chain` (GEMM, op) pairs at decode size, the way they follow each
other in a decode step, with PDL as the engine launches them; a graph of the GEMMs alone gives
the baseline, and the op's cost is the difference per pair:

  rope   the q/k/v GEMM ([T, 4096] x [4096, 12288]), then rope + KV write (kernels.fused.
         rope_write_kv_), plain or with the folded norm's factor (rms), in `parts` programs a
         row and `num_warps` warps (fused.ROPE_LAUNCH);
  silu   the gate/up GEMM ([T, 4096] x [4096, 22016]), then SiLU-gate (fused.silu_mul), plain
         or with the factor, column blocks of `block` and `num_warps` warps (fused.SILU_LAUNCH).

Llama-2-7B shapes, bf16, T = --rows (64). Writes fused-micro-h200.{json,md} under --out.

  python -m bench.kernels.fused_micro --out bench/results/ab
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import pathlib
import platform
import sys

import torch

from bench.lib.synthetic import SHAPES
from bench.lib.timing import time_us
from kernels import fused


def cases(args):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    c = SHAPES["7b"]
    t, hid, heads, d, inter = args.rows, *(c[k] for k in (
        "hidden_size", "num_attention_heads", "head_dim", "intermediate_size"))

    def rnd(*shape, std=1.0):
        return torch.randn(*shape, generator=g, device=dev).mul_(std).to(torch.bfloat16)
    h = rnd(t, hid)
    w_qkv = rnd(hid, 3 * heads * d, std=0.02)            # [K, N]: the worker's layout
    w_gu = rnd(hid, 2 * inter, std=0.02)
    qkv = torch.empty(t, 3 * heads * d, device=dev, dtype=torch.bfloat16)
    gu = torch.empty(t, 2 * inter, device=dev, dtype=torch.bfloat16)
    blocks = 64 * t // 16 + 8
    kc = torch.zeros(blocks, 16, heads, d, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    pos = torch.arange(100, 100 + t, device=dev)
    slots = torch.arange(t, device=dev) * 16 + 3
    cos = rnd(4096, d // 2)
    sin = rnd(4096, d // 2)
    q = qkv[:, :heads * d].view(t, heads, d)
    k = qkv[:, heads * d:2 * heads * d].view(t, heads, d)
    v = qkv[:, 2 * heads * d:].view(t, heads, d)

    def qkv_gemm():
        torch.mm(h, w_qkv, out=qkv)

    def gu_gemm():
        torch.mm(h, w_gu, out=gu)

    def rope(rms):
        return lambda: fused.rope_write_kv_(q, k, v, cos, sin, pos, kc, vc, slots,
                                            rms=(h, 1e-5) if rms else None)

    def silu(rms):
        return lambda: fused.silu_mul(gu, rms=(h, 1e-5) if rms else None)

    for rms, parts, warps in itertools.product((0, 1), (1, 2, 4), (4, 8)):
        yield ("rope", dict(rms=rms, parts=parts, num_warps=warps), qkv_gemm, rope(rms),
               lambda p=parts, w=warps: fused.ROPE_LAUNCH.update(parts=p, num_warps=w))
    for rms, block, warps in itertools.product((0, 1), (1024, 2048, 4096), (4, 8)):
        yield ("silu", dict(rms=rms, block=block, num_warps=warps), gu_gemm, silu(rms),
               lambda b=block, w=warps: fused.SILU_LAUNCH.update(block=b, num_warps=w))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results/ab")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--chain", type=int, default=16)
    args = p.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.preferred_blas_library("cublaslt")
    rows, alone = [], {}
    keep_rope, keep_silu = dict(fused.ROPE_LAUNCH), dict(fused.SILU_LAUNCH)
    for op, knobs, gemm, fn, setup in cases(args):
        setup()
        if op not in alone:
            alone[op] = time_us([gemm] * args.chain, dev, 25, 200)
        pair = time_us([gemm, fn] * args.chain, dev, 25, 200)
        row = {"op": op, **knobs, "pair_us": round(pair * 2, 2), "gemm_us": round(alone[op], 2),
               "op_us": round(pair * 2 - alone[op], 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    fused.ROPE_LAUNCH.update(keep_rope)
    fused.SILU_LAUNCH.update(keep_silu)
    import triton
    header = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "python": platform.python_version(),
              "rows": args.rows, "chain": args.chain}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fused-micro-h200.json").write_text(json.dumps({"header": header, "rows": rows},
                                                          indent=1))
    lines = [f"# Elementwise launches after their GEMM, {header['gpu']}, {header['date']}", "",
             f"torch {header['torch']}, triton {header['triton']}; {args.rows} rows, chains of "
             f"{args.chain} (GEMM, op) pairs in one graph; op = pair - GEMM alone.", "",
             "| op | rms | parts / block | warps | GEMM + op us | GEMM us | op us |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['rms']} | {r.get('parts', r.get('block'))} | "
                     f"{r['num_warps']} | {r['pair_us']} | {r['gemm_us']} | {r['op_us']} |")
    (out / "fused-micro-h200.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
