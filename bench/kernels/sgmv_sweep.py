"""Tile and launch-shape sweep for our SGMV kernels on the GPU: for every benchmark shape, time
each candidate config of the split kernel (kernels/sgmv_split.py) and the fused kernel
(kernels/sgmv_triton.py), chained as in bench/kernels/sgmv.py, and print the best few per shape
next to what `kernels.sgmv.sgmv` picks today and the cuBLAS per-adapter loop. The winners are
written into pick_split_config / pick_config by hand (with this run's output as the record).

    python -m bench.kernels.sgmv_sweep --out DIR [--decode-only | --large-only] [--chain 4]
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from bench.kernels.sgmv_cases import TOL, impl_fn, make_problem, make_weights, reference
from bench.lib.timing import time_us

DECODE = [(16, 1, 1), (16, 16, 8), (16, 64, 1), (16, 64, 8), (16, 64, 32), (16, 256, 8),
          (16, 256, 32), (16, 256, 128), (64, 16, 8), (64, 64, 1), (64, 64, 32), (64, 256, 32),
          (64, 256, 128)]
LARGE = [(r, t, n) for r in (16, 64) for t in (1024, 4096) for n in (1, 32)]


def candidates(t):
    from kernels.sgmv_split import SplitConfig
    from kernels.sgmv_triton import SgmvConfig, _sm_count
    sms = _sm_count(torch.cuda.current_device())
    out = []
    if t <= 512:
        for bm, bn, kc, one, warps in itertools.product((16, 32), (64, 128, 256, 512), (256, 512),
                                                        (True, False), (4, 8)):
            if bm == 32 and t < 256:
                continue
            out.append(("split", SplitConfig(block_m=bm, block_n=bn, k_chunk=kc, num_warps=warps,
                                             one_launch=one)))
    else:
        for bm, warps in itertools.product((32, 64, 128), (4, 8)):
            out.append(("fused", SgmvConfig(block_m=bm, block_n=128, block_k=128,
                                            num_programs=2 * sms, num_warps=warps,
                                            num_stages=4)))
        for bm, bn, kc, warps in itertools.product((64, 128), (128, 256), (512, 1024), (4, 8)):
            out.append(("split", SplitConfig(block_m=bm, block_n=bn, k_chunk=kc, num_warps=warps,
                                             one_launch=False)))
    return out


def call(kind, cfg, q, y):
    from kernels.sgmv import sgmv
    from kernels.sgmv_split import sgmv_split
    from kernels.sgmv_triton import sgmv_triton
    args = (y, q["x"], q["pool"], q["a_off"], q["b_off"], q["ranks"], q["scales"],
            [0, q["hidden"]], q["seg_start"], q["seg_slot"], q["rank"])
    if kind == "auto":
        return lambda: sgmv(*args, align=q["align"])
    if kind == "loop":                          # the kernel bench's cuBLAS loop, as is
        return impl_fn("loop", q, y, None)
    if kind == "split":
        return lambda: sgmv_split(*args, config=cfg, align=q["align"])
    return lambda: sgmv_triton(*args, config=cfg)


def time_config(kind, cfg, probs, a):
    p = probs[0]
    out = p["y0"].clone()
    f = call(kind, cfg, p, out)
    f()
    ref = reference(p)
    err = float(((out.float() - ref).abs() / (1 + ref.abs())).max())
    if not err <= TOL:
        return None, err
    fns = [call(kind, cfg, q, q["y0"].clone()) for q in probs]
    return time_us(fns, torch.device("cuda"), a.warmup_ms, a.rep_ms), err


def write_markdown(path: Path, doc: dict) -> None:
    """Per shape: what the dispatch picked at the time, the cuBLAS loop, and the best configs."""
    lines = [f"# SGMV config sweep, {doc['gpu']} ({doc['date']})", "",
             f"torch {doc['torch']}; hidden 4096, bf16; µs per call, {doc['chain']} calls chained "
             "in one CUDA graph (each with its own weights), L2 flushed before each replay. "
             + doc.get("note", ""), "",
             "| r | T | n | dispatch then | cuBLAS loop | best | best config | 2nd | 3rd |",
             "|---|---|---|---|---|---|---|---|---|"]
    for sh in doc["shapes"]:
        ok = sorted((r for r in sh["rows"] if r["chain_us"] and r["kind"] in ("split", "fused")),
                    key=lambda r: r["chain_us"])

        def cfg(r):
            c = r["config"]
            if r["kind"] == "fused":
                return f"fused m{c['block_m']} n{c['block_n']} w{c['num_warps']}"
            return (f"split m{c['block_m']} n{c['block_n']} k{c['k_chunk']} w{c['num_warps']}"
                    + (" 1-launch" if c["one_launch"] else ""))
        top = [f"{r['chain_us']:.1f} {cfg(r)}" for r in ok[:3]] + ["–"] * 3
        lines.append(f"| {sh['rank']} | {sh['T']} | {sh['n']} | {sh['auto_us']:.1f} | "
                     f"{sh['loop_us']:.1f} | {ok[0]['chain_us']:.1f} | {cfg(ok[0])} | {top[1]} | "
                     f"{top[2]} |")
    path.write_text("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument("--large-only", action="store_true")
    ap.add_argument("--chain", type=int, default=4)
    ap.add_argument("--warmup-ms", type=float, default=10)
    ap.add_argument("--rep-ms", type=float, default=40)
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--md-from", type=Path, help="only write the markdown of a sweep's JSON")
    a = ap.parse_args()
    if a.md_from:
        write_markdown(a.md_from.with_suffix(".md"), json.loads(a.md_from.read_text()))
        return
    shapes = (DECODE if not a.large_only else []) + (LARGE if not a.decode_only else [])
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    t0, results, weights = time.time(), [], {}
    with torch.inference_mode():
        for rank, t, n in shapes:
            if time.time() - t0 > a.budget_s:
                print(f"budget reached at r={rank} T={t} n={n}", flush=True)
                break
            if rank not in weights:
                weights.clear()
                torch.cuda.empty_cache()
                weights[rank] = [make_weights(4096, rank, torch.bfloat16, dev, gen)
                                 for _ in range(a.chain)]
            probs = [make_problem(w, 4096, rank, t, n, torch.bfloat16, dev, gen)
                     for w in weights[rank]]
            rows = []
            for kind, cfg in [("auto", None), ("loop", None)] + candidates(t):
                try:
                    us, err = time_config(kind, cfg, probs, a)
                except Exception as exc:                          # noqa: BLE001
                    us, err = None, f"{type(exc).__name__}: {str(exc)[:120]}"
                rows.append({"kind": kind, "config": cfg.__dict__ if cfg else None,
                             "chain_us": us, "err": err})
            ok = sorted((r for r in rows if r["chain_us"] and r["kind"] in ("split", "fused")),
                        key=lambda r: r["chain_us"])
            auto = next(r for r in rows if r["kind"] == "auto")["chain_us"]
            loop = next(r for r in rows if r["kind"] == "loop")["chain_us"]
            results.append({"rank": rank, "T": t, "n": n, "auto_us": auto, "loop_us": loop,
                            "rows": rows})
            best = " | ".join(f"{r['kind']} {r['chain_us']:.1f} {r['config']}" for r in ok[:3])
            bad = [r for r in rows if r["chain_us"] is None]
            print(f"r={rank} T={t} n={n}: auto {auto} loop {loop} || {best}"
                  + (f" || {len(bad)} failed, e.g. {bad[0]['err']}" if bad else ""), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "chain": a.chain, "shapes": results}
    (a.out / "sgmv-sweep-h200.json").write_text(json.dumps(doc, indent=1, default=str))
    write_markdown(a.out / "sgmv-sweep-h200.md", json.loads(json.dumps(doc, default=str)))
    print(f"wrote {a.out}/sgmv-sweep-h200.json in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
