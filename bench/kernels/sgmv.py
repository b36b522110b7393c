"""LoRA kernel benchmark: ours (kernels.sgmv_triton) vs vLLM's Triton lora_shrink + lora_expand vs a
per-adapter cuBLAS loop vs per-token gather + bmm, next to the dense base matmul x @ W.

    python -m bench.kernels.sgmv --out DIR [--vllm-src .peers/vllm_lora_ops] [--quick]

Op: y[T, H] += s * (x[T, H] @ A_i.T) @ Bt_i for the rows of adapter i, bf16, hidden H = 4096; tokens
spread evenly over n adapters drawn from a pool of 128. Kernel times are medians of CUDA-graph
replays under triton.testing.do_bench (L2 flushed before each replay). Each impl is checked once per
shape against an fp32 reference. Bandwidth = useful bytes (x, y read + written, the n adapters'
weights) / time, next to a device-to-device copy measured in the same run.
Writes DIR/kernels-h200.json, DIR/kernels-h200.md and DIR/kernels-h200.png (if matplotlib).
"ours" is what the engine's eager steps run (kernels.sgmv.sgmv with the host tables: split-K at
decode sizes, fused above, cuBLAS pairs for one adapter of rank >= 64); captured decode graphs
run the kernels only (the "fused"/"split" columns, as kernels.sgmv_choice.use_split picks).
"ours_fused" and "ours_split" are the two kernels on every shape.

--vllm-src is a folder holding vLLM's lora_shrink_op.py, lora_expand_op.py, kernel_utils.py and
utils.py (from vllm/lora/ops/triton_ops/, or vllm/runtime/modeling/lora/ops/triton_ops/ in newer
trees); their `vllm.*` imports are stubbed (bench/kernels/vllm_ops.py), so the rest of vLLM
need not be installed.
Plumbing check without a GPU (small shapes; fp16 because the interpreter cannot multiply bf16):
    TRITON_INTERPRET=1 python -m bench.kernels.sgmv --out /tmp/b --device cpu --hidden 64 \
        --dtype fp16 --shapes 16:8:2,32:20:3 --vllm-src .peers/vllm_lora_ops
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch

from bench.kernels.sgmv_cases import (POOL_SLOTS, TOL, impl_fn, make_problem, make_weights,
                                      reference)
from bench.kernels.vllm_ops import load_vllm
from bench.lib.timing import copy_tbps, time_us

FULL = [(r, t, n) for r in (16, 64) for t in (1, 16, 64, 256, 1024, 4096)
        for n in (1, 8, 32, 128) if n <= t]
QUICK = [(16, 1, 1), (16, 64, 8), (64, 1024, 32)]
# ours_nopdl: "ours" launched without programmatic dependent launch (kernels.pdl);
# vllm_pdl: vLLM's kernels with their PDL path on (vLLM takes it only with its dual-stream flag)
IMPLS = ("ours", "ours_nopdl", "ours_fused", "ours_split", "vllm", "vllm_pdl", "loop", "gather")


def lora_bytes(p, elem):
    return elem * (p["t"] * p["hidden"] * 3 + p["n"] * p["rank"] * 2 * p["hidden"])


def base_bytes(p, elem):
    return elem * (2 * p["t"] * p["hidden"] + p["hidden"] ** 2)


def measure(name, probs, device, vllm, args):
    """One row: median µs of one call per graph, and per call in a chain over all the problems
    (each with its own weights and inputs, so every call reads cold memory after the L2 flush);
    the error of one run of the first problem from y0 against the fp32 reference."""
    p = probs[0]
    row = {"impl": name, "T": p["t"], "n": p["n"], "rank": p["rank"], "median_us": None,
           "chain_us": None, "max_err": None, "ok": False}
    try:
        fns = []
        for i, q in enumerate(probs):
            if name == "base":
                out = torch.empty_like(q["y0"])
                fns.append(lambda q=q, out=out: torch.mm(q["x"], q["w"], out=out))
            else:
                out = q["y0"].clone()
                fns.append(impl_fn(name, q, out, vllm))
            if i == 0:
                fns[0]()
                ref = p["x"].float() @ p["w"].float() if name == "base" else reference(p)
                err = (out.float() - ref).abs()
                row["max_err"] = float(err.max())
                row["ok"] = bool((err / (1 + ref.abs())).max() <= TOL)
        row["median_us"] = round(time_us(fns[0], device, args.warmup_ms, args.rep_ms), 2)
        if len(fns) > 1:
            row["chain_us"] = round(time_us(fns, device, args.warmup_ms, args.rep_ms), 2)
    except Exception as exc:                  # keep going: one failing impl must not stop the run
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return row


def run(args):
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    status = {"ours": "ok", "ours_nopdl": "ok", "ours_fused": "ok", "ours_split": "ok",
              "vllm": "ok", "vllm_pdl": "ok"}
    vllm = load_vllm(args.vllm_src)
    if isinstance(vllm, str):
        status["vllm"], vllm = "skipped: " + vllm, None
        status["vllm_pdl"] = status["vllm"]
    from kernels import pdl
    if not pdl.enabled(device):
        for key in ("ours_nopdl", "vllm_pdl"):
            status[key] = "skipped: no programmatic dependent launch on this device"
    if device.type == "cpu" and not interpreted:
        for key in ("ours", "ours_fused", "ours_split", "vllm"):
            status[key] = "skipped: CPU without TRITON_INTERPRET=1"
    impls = [i for i in IMPLS if status.get(i, "ok") == "ok"]
    shapes = args.shapes or (QUICK if args.quick else FULL)
    t_start, rows, base_cache = time.time(), [], {}
    header = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "triton": _triton_version(),
              "cuda": torch.version.cuda, "hidden": args.hidden, "dtype": args.dtype,
              "pool_slots": POOL_SLOTS, "impls": status, "tolerance": TOL,
              "method": "median of CUDA-graph replays, triton.testing.do_bench, L2 flushed",
              "chain": args.chain}
    copy_gib = args.copy_gib if device.type == "cuda" else min(args.copy_gib, 1 / 16)
    header["copy_tbps"] = copy_tbps(device, copy_gib, args.warmup_ms, args.rep_ms)
    if device.type == "cuda":       # what this harness measures for a graph of one tiny kernel
        one = torch.zeros(1, device=device)
        header["graph_floor_us"] = round(time_us(lambda: one.add_(1), device, args.warmup_ms,
                                                 args.rep_ms), 2)
    print(f"device copy: {header['copy_tbps']:.2f} TB/s; impls: {status}", flush=True)
    elem = torch.finfo(dtype).bits // 8
    gen = torch.Generator(device=device).manual_seed(0)
    weights = {}
    with torch.inference_mode():
        for rank, t, n in shapes:
            if time.time() - t_start > args.budget_s:
                print(f"time budget reached; skipping r={rank} T={t} n={n}", flush=True)
                header.setdefault("skipped_shapes", []).append([rank, t, n])
                continue
            if vllm is not None:               # its pointer cache is keyed by data_ptr only
                vllm[2]._LORA_A_PTR_DICT.clear()
                vllm[2]._LORA_B_PTR_DICT.clear()
            if rank not in weights:
                weights.clear()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                weights[rank] = [make_weights(args.hidden, rank, dtype, device, gen)
                                 for _ in range(args.chain)]
            probs = [make_problem(w, args.hidden, rank, t, n, dtype, device, gen)
                     for w in weights[rank]]
            p = probs[0]
            floor = lora_bytes(p, elem) / (header["copy_tbps"] * 1e12) * 1e6
            if t not in base_cache:
                base_cache[t] = measure("base", probs, device, vllm, args)
            shape_rows = [dict(base_cache[t], rank=rank, n=n)]
            shape_rows += [measure(name, probs, device, vllm, args) for name in impls]
            for row in shape_rows:
                row["floor_us"] = round(floor, 2)
                nbytes = base_bytes(p, elem) if row["impl"] == "base" else lora_bytes(p, elem)
                if row["median_us"]:
                    row["tbps"] = round(nbytes / (row["median_us"] * 1e-6) / 1e12, 3)
                    row["copy_frac"] = round(row["tbps"] / header["copy_tbps"], 3)
            rows += shape_rows
            print(" ".join(f"{r['impl']}={r['median_us']}{'' if r['ok'] else '!'}"
                           for r in shape_rows), f"<- r={rank} T={t} n={n}", flush=True)
            del p, probs
            if device.type == "cuda":
                torch.cuda.empty_cache()
    header["wall_s"] = round(time.time() - t_start, 1)
    return header, rows


def _triton_version():
    try:
        import triton
        return triton.__version__
    except ImportError:
        return None


# ----------------------------------------------------------------------------------------------
def _ratio(num, den):
    return f"{num / den:.2f}" if num and den else "–"


def write_markdown(path, header, rows):
    by = {}
    for r in rows:
        by.setdefault((r["rank"], r["T"], r["n"]), {})[r["impl"]] = r
    chain = header.get("chain", 1)

    def cell(r, key="median_us"):
        if not r or r.get(key) is None:
            return "–"
        return f"{r[key]:.1f}" + ("" if r["ok"] else " ✗")

    def val(d, impl, key):
        return (d.get(impl) or {}).get(key)

    lines = [f"# LoRA kernels on {header['gpu']} ({header['date']})", "",
             f"torch {header['torch']}, triton {header['triton']}, CUDA {header['cuda']}; "
             f"hidden {header['hidden']}, {header['dtype']}; device copy "
             f"{header['copy_tbps']:.2f} TB/s (eager); {header['method']}.", "",
             "Impls: " + "; ".join(f"{k}: {v}" for k, v in header["impls"].items()), "",
             "Median µs per call (✗ = wrong result). floor = useful bytes / copy bandwidth; "
             "%copy = our achieved bandwidth as a share of the copy; best = the faster of vLLM "
             "and the cuBLAS loop.", ""]
    if header.get("remeasured"):
        re_ = header["remeasured"]
        lines += [f"Shapes re-run on {re_['date']} (every impl, same card): "
                  + ", ".join(f"r={r} T={t} n={n}" for r, t, n in re_["shapes"])
                  + f" - {re_['why']}.", ""]
    lines += [f"After the run: {note}" for note in header.get("notes", [])]
    if header.get("notes"):
        lines.append("")
    if chain > 1:
        lines += [f"## Chained: {chain} calls back to back in one graph, per call", "",
                  "As kernels run inside the engine's decode graph: each call has its own "
                  "weights and inputs (cold after the L2 flush), and the graph launch is shared.",
                  "ours is launched with programmatic dependent launch where the device has it; "
                  "no PDL is the same without; vLLM PDL is vLLM's kernels with their PDL path "
                  "(off by default in vLLM).", "",
                  "| r | T | n | base | floor | ours | vLLM | loop | ours/vLLM | ours/best "
                  "| ours %copy | fused | split | no PDL | vLLM PDL |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for (rank, t, n), d in by.items():
            ours, vl, lp = (val(d, i, "chain_us") for i in ("ours", "vllm", "loop"))
            best = min(x for x in (vl, lp) if x) if (vl or lp) else None
            floor = next(iter(d.values()))["floor_us"]
            frac = f"{100 * floor / ours:.0f}%" if ours else "–"
            lines.append(
                f"| {rank} | {t} | {n} | {cell(d.get('base'), 'chain_us')} | {floor:.1f} | "
                f"{cell(d.get('ours'), 'chain_us')} | {cell(d.get('vllm'), 'chain_us')} | "
                f"{cell(d.get('loop'), 'chain_us')} | {_ratio(ours, vl)} | {_ratio(ours, best)} "
                f"| {frac} | {cell(d.get('ours_fused'), 'chain_us')} | "
                f"{cell(d.get('ours_split'), 'chain_us')} | "
                f"{cell(d.get('ours_nopdl'), 'chain_us')} | "
                f"{cell(d.get('vllm_pdl'), 'chain_us')} |")
        lines.append("")
    lines += ["## One call per graph", "",
              "A graph of one trivial kernel measures "
              f"{header.get('graph_floor_us', float('nan')):.1f} µs here: every figure in this "
              "table includes that fixed cost.", "",
              "| r | T | n | base | floor | ours | vLLM | loop | gather | ours/vLLM | ours/best "
              "| ours %copy | fused | split |", "|---|---|---|---|---|---|---|---|---|---|---|---|"
              "---|---|"]
    for (rank, t, n), d in by.items():
        ours, vl, lp = (val(d, i, "median_us") for i in ("ours", "vllm", "loop"))
        best = min(x for x in (vl, lp) if x) if (vl or lp) else None
        frac = f"{100 * d['ours']['copy_frac']:.0f}%" if d.get("ours", {}).get("copy_frac") \
            else "–"
        floor = next(iter(d.values()))["floor_us"]
        lines.append(f"| {rank} | {t} | {n} | {cell(d.get('base'))} | {floor:.1f} | "
                     f"{cell(d.get('ours'))} | {cell(d.get('vllm'))} | {cell(d.get('loop'))} | "
                     f"{cell(d.get('gather'))} | {_ratio(ours, vl)} | {_ratio(ours, best)} | "
                     f"{frac} | {cell(d.get('ours_fused'))} | {cell(d.get('ours_split'))} |")
    errors = [f"- {r['impl']} r={r['rank']} T={r['T']} n={r['n']}: {r['error']}"
              for r in rows if r.get("error")]
    if errors:
        lines += ["", "Errors:", *errors]
    if header.get("skipped_shapes"):
        lines += ["", f"Skipped for time: {header['skipped_shapes']}"]
    path.write_text("\n".join(lines) + "\n")


def write_plot(path, rows):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ranks = sorted({r["rank"] for r in rows})
    fig, axes = plt.subplots(1, len(ranks), figsize=(7 * len(ranks), 4.5), squeeze=False)
    for ax, rank in zip(axes[0], ranks):
        shapes = sorted({(r["T"], r["n"]) for r in rows if r["rank"] == rank})
        for impl in ("base", *IMPLS):
            pts = {(r["T"], r["n"]): r["median_us"] for r in rows
                   if r["rank"] == rank and r["impl"] == impl and r["median_us"]}
            if pts:
                ax.plot(range(len(shapes)), [pts.get(s) for s in shapes], marker="o", label=impl)
        floors = {(r["T"], r["n"]): r["floor_us"] for r in rows if r["rank"] == rank}
        ax.plot(range(len(shapes)), [floors[s] for s in shapes], "k--", label="floor")
        ax.set_xticks(range(len(shapes)), [f"{t}/{n}" for t, n in shapes], rotation=60)
        ax.set_yscale("log")
        ax.set_title(f"rank {rank}")
        ax.set_xlabel("T / n adapters")
        ax.set_ylabel("µs (median)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _parse_shapes(text):
    return [tuple(int(v) for v in item.split(":")) for item in text.split(",")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--vllm-src", help="folder with vLLM's lora ops files (lora_shrink_op.py, ...)")
    ap.add_argument("--quick", action="store_true", help="3 shapes, a smoke test")
    ap.add_argument("--shapes", type=_parse_shapes, help="r:T:n,... instead of the sweep")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--warmup-ms", type=float, default=25)
    ap.add_argument("--rep-ms", type=float, default=100)
    ap.add_argument("--copy-gib", type=float, default=2.0)
    ap.add_argument("--budget-s", type=float, default=300, help="stop starting new shapes after")
    ap.add_argument("--chain", type=int, default=8,
                    help="problems per shape (own weights each), timed back to back in one graph")
    args = ap.parse_args()
    header, rows = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels-h200.json").write_text(json.dumps({"header": header, "rows": rows},
                                                           indent=1))
    write_markdown(args.out / "kernels-h200.md", header, rows)
    plotted = write_plot(args.out / "kernels-h200.png", rows)
    print(f"wrote {args.out}/kernels-h200.json, .md{', .png' if plotted else ''} "
          f"in {header['wall_s']} s", flush=True)


if __name__ == "__main__":
    main()
