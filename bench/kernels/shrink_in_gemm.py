"""Would the LoRA shrink cost less as extra columns of the base GEMM? (A premise check.)

Decode at batch T with n rank-r adapters on q/k/v (or o): today a layer runs the cuBLAS GEMM,
then the SGMV shrink and expand (two Triton launches). The alternative: the batch's adapters'
A matrices sit as extra columns beside the base weight ([K, N + n*slices*r], the [K, N] layout
the engine already uses), so one cuBLAS GEMM yields both x @ W and every x @ A_i, and only the
expand remains. Measured here as CUDA-graph chains over `--layers` layers (each its own weights,
so every call reads cold memory), per layer:

  base        y = x @ W                                   (no LoRA)
  base+sgmv   y = x @ W; sgmv_split(y, x, ...)            (today)
  ext         out = x @ [W | A_1 .. A_n]                  (the wider GEMM alone)
  ext+expand  out = x @ [W | A...]; the SGMV expand of one K partial (what remains)
  ext+expand_columns  out = x @ [W | A...]; expand_columns reading v from out's extra
              columns (the engine's column LoRA, services/worker/model/lora_columns.py)
  row         y = [x | v] @ [W ; Bt_1 .. Bt_n]            (o only: the K-extended GEMM alone)
  row+shrink_blocks/pPwW  kernels.shrink_blocks writes each row's scaled x @ A.T into its
              adapter's block of v (P rank parts a row, W warps a program), then the GEMM
              above: the o LoRA
              with no expand launch (x and v are views of one [T, K + n * 16] buffer, as the
              attention's output would be)

    python -m bench.kernels.shrink_in_gemm [--rows 64] [--adapters 32] [--rank 16] [--groups o]
                                   [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

from bench.lib.timing import time_us
from kernels.sgmv_choice import rank_tile
from kernels.shrink_blocks import RB, shrink_blocks
from kernels.sgmv_split import (Shrunk, expand, expand_columns, pick_split_config,
                                sgmv_split)

GROUPS = {"qkv": (4096, [0, 4096, 8192, 12288]), "o": (4096, [0, 4096])}
ALIGN = 8    # every pool offset below is a multiple of r x 4096: the engine pool's promise


def layer(k, slices, t, n, r, dev, gen):
    n_out, n_sl = slices[-1], len(slices) - 1
    dt = torch.bfloat16
    w = (torch.randn(k, n_out + n * n_sl * r, generator=gen, device=dev) / k ** 0.5).to(dt)
    per = r * k + r * (n_out // n_sl)
    pool = (torch.randn(n * n_sl * per, generator=gen, device=dev) * 0.05).to(dt)
    idx = torch.arange(n, device=dev)
    a_off = torch.stack([(idx * n_sl + j) * per for j in range(n_sl)])        # [slices, n]
    lens = [t // n + (i < t % n) for i in range(n)]
    starts = [0]
    for ln in lens:
        starts.append(starts[-1] + ln)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    return dict(w=w, n_out=n_out, pool=pool, a_off=a_off, b_off=a_off + r * k,
                ranks=torch.full((n,), r, dtype=torch.int32, device=dev),
                scales=torch.full((n,), 2.0, dtype=torch.float32, device=dev),
                seg_start=i32(starts), seg_slot=i32(list(range(n))),
                x=torch.randn(t, k, generator=gen, device=dev).to(dt),
                v=torch.zeros(1, n_sl, t, max(16, r), dtype=torch.float32, device=dev),
                **(row_weights(k, n_out, t, n, dev, gen) if n_sl == 1 else {}))


def row_weights(k, n_out, t, n, dev, gen) -> dict:
    """The row variants' [K + n * RB, N] weight and [T, K + n * RB] buffer (x, then v)."""
    return dict(wk=(torch.randn(k + n * RB, n_out, generator=gen, device=dev) / k ** 0.5).to(
        torch.bfloat16), buf=torch.randn(t, k + n * RB, generator=gen, device=dev).to(
        torch.bfloat16))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--groups", default=",".join(GROUPS), help="which of " + ",".join(GROUPS))
    ap.add_argument("--out", type=pathlib.Path)
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    t, n, r = a.rows, a.adapters, a.rank
    rows = []
    for g, (k, slices) in GROUPS.items():
        if g not in a.groups.split(","):
            continue
        ls = [layer(k, slices, t, n, r, dev, gen) for _ in range(a.layers)]
        cfg = pick_split_config(t, r)
        n_sl = len(slices) - 1

        def base(p):
            return lambda: torch.mm(p["x"], p["w"][:, :p["n_out"]])

        def base_sgmv(p):
            def run():
                y = torch.mm(p["x"], p["w"][:, :p["n_out"]])
                sgmv_split(y, p["x"], p["pool"], p["a_off"], p["b_off"], p["ranks"],
                           p["scales"], slices, p["seg_start"], p["seg_slot"], r, align=ALIGN)
            return run

        def ext(p):
            return lambda: torch.mm(p["x"], p["w"])

        def ext_expand(p):
            sh = Shrunk(p["v"], 4 * 132, cfg.block_m, max(16, 1 << (n - 1).bit_length()))

            def run():
                out = torch.mm(p["x"], p["w"])
                expand(out[:, :p["n_out"]], sh, p["pool"], p["b_off"], p["ranks"],
                       p["scales"], slices, p["seg_start"], p["seg_slot"], r, cfg, align=ALIGN)
            return run

        def ext_expand_cols(p):
            col = torch.arange(n, dtype=torch.int32, device=dev)    # slot s: column block s

            def run():
                out = torch.mm(p["x"], p["w"])
                expand_columns(out[:, :p["n_out"]], out[:, p["n_out"]:], col, p["pool"],
                               p["b_off"], p["ranks"], p["scales"], slices, p["seg_start"],
                               p["seg_slot"], r, cfg, align=ALIGN)
            return run

        def row(p):
            return lambda: torch.mm(p["buf"], p["wk"])

        def row_shrink(parts, warps=2, block_k=256):
            def make(p):
                col = torch.arange(n, dtype=torch.int32, device=dev)
                k_ = p["x"].shape[1]

                def run():
                    shrink_blocks(p["buf"][:, k_:], p["buf"][:, :k_], p["pool"], p["a_off"][0],
                                  p["ranks"], p["scales"], col, p["seg_start"], p["seg_slot"],
                                  parts=parts, num_warps=warps, block_k=block_k)
                    torch.mm(p["buf"], p["wk"])
                return run
            return make

        variants = [("base", base), ("base+sgmv", base_sgmv), ("ext", ext),
                    ("ext+expand", ext_expand)]
        if r == rank_tile(r):        # the column layout: blocks of the rank tile
            variants.append(("ext+expand_columns", ext_expand_cols))
        if g == "o" and r <= RB:
            variants += [("row", row)] + [
                (f"row+shrink_blocks/p{q}w{w}k{bk}", row_shrink(q, w, bk))
                for q, w, bk in ((4, 4, 4096), (16, 4, 4096), (16, 2, 4096), (16, 8, 4096), (8, 4, 4096),
                                 (8, 8, 4096), (4, 8, 4096), (16, 4, 2048), (16, 4, 1024),
                                 (4, 2, 256))]
        for name, mk in variants:
            us = time_us([mk(p) for p in ls], dev, 50, 300)
            rows.append({"group": g, "variant": name, "T": t, "n": n, "rank": r,
                         "extra_cols": n * n_sl * r, "us_per_layer": round(us, 2)})
            print(f"{g:4s} {name:18s} {us:7.2f} us a layer", flush=True)
        del ls
        torch.cuda.empty_cache()
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "shrink-in-gemm-h200.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
             "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
