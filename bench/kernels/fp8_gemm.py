"""The weight-only FP8 GEMM (kernels.fp8_gemm) at decode sizes against torch._scaled_mm and bf16.

Per decoder GEMM of the 7B (Llama-2), Llama-3-8B and 70B shapes (docs/sizing.md) and per row
count M, µs a call and the weight-streaming rate of:

  fp8        our kernel, the configuration kernels.fp8_gemm_config picks (its label beside it);
  fp8_cvt    the same config with W's tile through Triton's e4m3 -> bf16 conversion (the
             conversion unit: F2FP + F2F an element) instead of the bit moves
             (kernels.fp8_tiles);
  fp8_xq     W8A8 as a decode path: x quantized per row (quantize_rows, one launch), then
             the kernel on e4m3 x e4m3 MMAs (x given quantized), both launches timed;
  fp8_a8     the same config with act_fp8: x quantized per K tile in the kernel, e4m3 MMAs
             (its error against the exact GEMM beside the fp8 one's);
  scaled_mm  torch._scaled_mm, rowwise scales, bf16 out, x already quantized (the GEMM alone);
  scaled_mm_t the same GEMM with its operands swapped (W @ x.T: M on cuBLAS's N side, where its
             heuristics pick other tiles for few rows), then made [M, N] again (.t().contiguous(),
             timed: the layers read it row-major); M a multiple of 16;
  prefill    kernels.fp8_linear.fp8_prefill: what a step above 256 rows runs (x quantized per row
             in one launch, then _scaled_mm), timed here to place the threshold (and as a
             decode path: W8A8 through cuBLAS);
  bf16       the bf16 weight through cuBLASLt in the worker's layout ([K, N] for q/k/v, o and
             gate/up, [N, K] for down: services.worker.model.transforms);
  floor      the FP8 weight's bytes (values + scales) over the measured copy bandwidth.

Each timing is a CUDA graph of 4 calls, each on its own weights (cold: the graph reads 4 weights
and do_bench flushes L2 between replays), median replay / 4 (bench.lib.timing.time_us).
Writes OUT/fp8-gemm-<card>.{json,md}.

--sweep instead times each picked configuration beside its neighbours (fp8_gemm_config
.neighbours: split, tile sides, warps, stages one step away; each checked against the picked
config's output) and writes OUT/fp8-gemm-sweep-<card>.{json,md}, the best per shape first, for
filling fp8_gemm_config.OVERRIDES or its TILES. It stops at --budget-s with what it has.
--xq sweeps the W8A8 form (x quantized, then the kernel: fp8-gemm-sweep-xq-<card>); --grid
times a grid around each picked BLOCK_M (fp8_gemm_config.grid) instead of the neighbours
(fp8-gemm-sweep[-xq]-grid-<card>).
--table prints the configurations picked for every shape (no GPU needed).

    python -m bench.kernels.fp8_gemm --out bench/results
    python -m bench.kernels.fp8_gemm --sweep --models 7b --out bench/results
    python -m bench.kernels.fp8_gemm --sweep --xq --grid --models 7b --rows 64 --budget-s 400
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from bench.lib.header import RESULTS, base_header, card_slug
from bench.lib.timing import copy_tbps, time_us
from kernels.fp8_gemm_config import BUCKETS, grid, neighbours, pick_config

COPIES = 4
MODELS = {  # hidden, intermediate, query heads, KV heads, head dim (docs/sizing.md)
    "7b": (4096, 11008, 32, 32, 128),
    "8b": (4096, 14336, 32, 8, 128),
    "70b": (8192, 28672, 64, 8, 128),
    "tiny": (128, 256, 4, 2, 32),      # --quick: the code paths on any device (CPU: the
}                                      # interpreter, TRITON_INTERPRET=1)
A8_TOL = 0.05                         # an act_fp8 config's error against the exact GEMM, at most
KN = ("qkv", "o", "gate_up")          # the worker's [K, N] bf16 weights; down stays [N, K]


def gemms(model: str) -> dict[str, tuple[int, int]]:
    """The model's decoder GEMMs, name -> (N, K)."""
    h, inter, heads, kv, hd = MODELS[model]
    return {"qkv": ((heads + 2 * kv) * hd, h), "o": (h, heads * hd),
            "gate_up": (2 * inter, h), "down": (h, inter)}


def fp8_weights(n: int, k: int, dev, bf16: str | None):
    """COPIES of (q, scale [N, 1], the bf16 weight in the worker's layout for GEMM `bf16`: [K, N]
    for those of KN, else [N, K]; None without)."""
    out = []
    for i in range(COPIES):
        g = torch.Generator(device=dev).manual_seed(i)
        w = torch.randn(n, k, generator=g, device=dev, dtype=torch.bfloat16).mul_(0.02)
        scale = w.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-12).div_(448.0)
        q = (w.float() / scale).clamp_(-448, 448).to(torch.float8_e4m3fn)
        if bf16 in KN:
            w = w.t().contiguous()
        out.append((q, scale, w if bf16 else None))
    return out


def rel_err(got: torch.Tensor, q, scale, x) -> float:
    ref = x.float() @ (q.float() * scale).t()
    return float((got.float() - ref).norm() / ref.norm().clamp(min=1e-30))


def w8a8(x, q, scale, group, config=None):
    """The W8A8 decode path: x quantized per row in one launch, then the kernel's XQ form."""
    from kernels.fp8_gemm import fp8_gemm
    from kernels.fp8_tiles import quantize_rows
    xq, sx = quantize_rows(x)
    return fp8_gemm(xq, q, scale, group, x_scale=sx, config=config)


def variants(name: str, ws, xs, m: int) -> dict:
    """name -> the COPIES calls of each variant at m rows (None where unavailable)."""
    from kernels.fp8_gemm import fp8_gemm
    from kernels.fp8_tiles import quantize_rows
    from kernels.fp8_linear import fp8_prefill, prefill_path, scaled_mm_rows
    k = xs[0].shape[1]
    picked = pick_config(m, ws[0][0].shape[0], k, 0, _sms(xs[0].device))
    a8, cvt = replace(picked, act_fp8=True), replace(picked, w_bits=False)
    out = {"fp8": [lambda i=i: fp8_gemm(xs[i], ws[i][0], ws[i][1], k) for i in range(COPIES)],
           "fp8_cvt": [lambda i=i: fp8_gemm(xs[i], ws[i][0], ws[i][1], k, config=cvt)
                       for i in range(COPIES)],
           "fp8_a8": [lambda i=i: fp8_gemm(xs[i], ws[i][0], ws[i][1], k, config=a8)
                      for i in range(COPIES)],
           "fp8_xq": [lambda i=i: w8a8(xs[i], ws[i][0], ws[i][1], k) for i in range(COPIES)]}
    if prefill_path(xs[0], ws[0][0], ws[0][1]) == "scaled_mm":
        xq = [quantize_rows(x) for x in xs]
        out["scaled_mm"] = [lambda i=i: torch._scaled_mm(
            xq[i][0], ws[i][0].t(), scale_a=xq[i][1], scale_b=ws[i][1].reshape(1, -1),
            out_dtype=torch.bfloat16) for i in range(COPIES)]
        out["prefill"] = [lambda i=i: fp8_prefill(xs[i], ws[i][0], ws[i][1], k)
                          for i in range(COPIES)]
        if m % 16 == 0:
            out["scaled_mm_t"] = [lambda i=i: scaled_mm_rows(
                xq[i][0], xq[i][1], ws[i][0], ws[i][1], torch.bfloat16, swap_max_rows=m)
                for i in range(COPIES)]
    if ws[0][2] is not None:
        if name in KN:
            out["bf16"] = [lambda i=i: torch.mm(xs[i], ws[i][2]) for i in range(COPIES)]
        else:
            out["bf16"] = [lambda i=i: F.linear(xs[i], ws[i][2]) for i in range(COPIES)]
    return out


def compare(a, dev, bw: float) -> list[dict]:
    if dev.type == "cuda":
        torch.backends.cuda.preferred_blas_library("cublaslt")    # as the worker runs bf16
    rows = []
    for model in a.models:
        for name, (n, k) in gemms(model).items():
            ws = fp8_weights(n, k, dev, bf16=name)
            nbytes = n * k + 4 * n
            for m in a.rows:
                xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(COPIES)]
                calls = variants(name, ws, xs, m)
                row = dict(model=model, gemm=name, M=m, N=n, K=k,
                           config=pick_config(m, n, k, 0, _sms(dev)).label(),
                           floor_us=round(nbytes / bw / 1e6, 2),
                           fp8_rel_err=rel_err(calls["fp8"][0](), ws[0][0], ws[0][1], xs[0]),
                           a8_rel_err=rel_err(calls["fp8_a8"][0](), ws[0][0], ws[0][1], xs[0]),
                           xq_rel_err=rel_err(calls["fp8_xq"][0](), ws[0][0], ws[0][1], xs[0]))
                for v in ("fp8", "fp8_cvt", "fp8_xq", "fp8_a8", "scaled_mm", "scaled_mm_t",
                          "prefill", "bf16"):
                    row[f"{v}_us"] = (round(time_us(calls[v], dev, a.warmup_ms, a.rep_ms), 2)
                                      if v in calls else None)
                row["fp8_tbps"] = round(nbytes / row["fp8_us"] / 1e6, 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del ws
            torch.cuda.empty_cache()
    return rows


def _sms(dev) -> int:
    from kernels.fp8_gemm import device_sms
    return device_sms(dev)


def sweep(a, dev, bw: float) -> list[dict]:
    from kernels.fp8_gemm import fp8_gemm
    rows, t0 = [], time.monotonic()
    for model in a.models:
        for name, (n, k) in gemms(model).items():
            ws = fp8_weights(n, k, dev, bf16=None)
            for m in a.rows:
                xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(COPIES)]
                picked = pick_config(m, n, k, 0, _sms(dev))
                call = w8a8 if a.xq else fp8_gemm        # --xq: the W8A8 decode path's configs
                base = call(xs[0], ws[0][0], ws[0][1], k, config=picked)
                space = grid(picked, 1 if a.xq else 2) if a.grid else neighbours(picked)
                for cfg in space:
                    if a.xq and (cfg.act_fp8 or not cfg.w_bits):    # moot for an e4m3 x
                        continue
                    if time.monotonic() - t0 > a.budget_s:
                        print(f"budget of {a.budget_s}s spent: stopping", flush=True)
                        return rows
                    got = call(xs[0], ws[0][0], ws[0][1], k, config=cfg)
                    ok = (rel_err(got, ws[0][0], ws[0][1], xs[0]) < A8_TOL if cfg.act_fp8
                          else bool(torch.allclose(got.float(), base.float(), rtol=2e-2,
                                                   atol=2e-2)))
                    us = time_us([lambda i=i, c=cfg: call(xs[i], ws[i][0], ws[i][1], k, config=c)
                                  for i in range(COPIES)], dev, a.warmup_ms, a.rep_ms)
                    row = dict(model=model, gemm=name, M=m, N=n, K=k, config=cfg.label(),
                               picked=cfg == picked, us=round(us, 2), ok=ok,
                               tbps=round((n * k + 4 * n) / us / 1e6, 2),
                               floor_us=round((n * k + 4 * n) / bw / 1e6, 2))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            del ws
            torch.cuda.empty_cache()
    return rows


def compare_md(head: dict, rows: list[dict]) -> list[str]:
    lines = [f"# Weight-only FP8 GEMM at decode sizes, {head['card']}, {head['date']}", "",
             f"commit {head['commit']}, torch {head['versions'].get('torch')}, triton "
             f"{head['versions'].get('triton')}; copy {head['copy_tbps']:.2f} TB/s. µs a call "
             "(CUDA graph of 4 calls on cold weights); floor = FP8 bytes / copy rate; "
             "bf16: cuBLASLt, the worker's layout; prefill: x quantized + _scaled_mm.", "",
             "| model | gemm | M | fp8 | fp8 / floor | TB/s | fp8_cvt | fp8_xq | xq / floor | "
             "fp8_a8 | scaled_mm | scaled_mm_t | prefill | bf16 | bf16 / fp8 | config | rel err "
             "| xq rel err | a8 rel err |", "|" + "---|" * 19]
    for r in rows:
        def f(v):
            return "-" if r.get(v) is None else f"{r[v]:.1f}"
        ratio = f"{r['bf16_us'] / r['fp8_us']:.2f}x" if r["bf16_us"] else "-"
        lines.append(f"| {r['model']} | {r['gemm']} | {r['M']} | {r['fp8_us']:.1f} | "
                     f"{r['fp8_us'] / r['floor_us']:.2f} | {r['fp8_tbps']:.2f} | "
                     f"{f('fp8_cvt_us')} | {f('fp8_xq_us')} | "
                     f"{r['fp8_xq_us'] / r['floor_us']:.2f} | {r['fp8_a8_us']:.1f} | "
                     f"{f('scaled_mm_us')} | {f('scaled_mm_t_us')} | {f('prefill_us')} | "
                     f"{f('bf16_us')} | {ratio} | "
                     f"{r['config']} | {r['fp8_rel_err']:.1e} | {r['xq_rel_err']:.1e} | "
                     f"{r['a8_rel_err']:.1e} |")
    return lines


def sweep_md(head: dict, rows: list[dict]) -> list[str]:
    lines = [f"# FP8 GEMM config sweep, {head['card']}, {head['date']}", "",
             f"commit {head['commit']}; µs a call; the picked config against the best of its "
             "neighbours (config = m BLOCK_M n BLOCK_N k BLOCK_K s SPLIT_K w warps st stages); "
             "`ok`: output within 2e-2 of the picked config's (an act_fp8 one, `a8`: within 5% "
             "of the exact GEMM, x being quantized).", "",
             "| model | gemm | M | picked | µs | best | µs | best / picked | floor µs |",
             "|" + "---|" * 9]
    shapes = dict.fromkeys((r["model"], r["gemm"], r["M"]) for r in rows)
    for key in shapes:
        got = [r for r in rows if (r["model"], r["gemm"], r["M"]) == key]
        pick = next(r for r in got if r["picked"])
        best = min((r for r in got if r["ok"]), key=lambda r: r["us"])
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {pick['config']} | {pick['us']:.1f} "
                     f"| {best['config']} | {best['us']:.1f} | {best['us'] / pick['us']:.2f} | "
                     f"{pick['floor_us']:.1f} |")
    bad = [r for r in rows if not r["ok"]]
    if bad:
        lines += ["", "Configs whose output differed: " + ", ".join(
            f"{r['model']} {r['gemm']} M={r['M']} {r['config']}" for r in bad)]
    return lines


def table() -> None:
    """The configurations picked on 132 SMs, per model, GEMM and bucket."""
    print("model gemm N K " + " ".join(f"M<={b}" for b in BUCKETS))
    for model in (m for m in MODELS if m != "tiny"):
        for name, (n, k) in gemms(model).items():
            print(model, name, n, k, " ".join(pick_config(b, n, k).label() for b in BUCKETS))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS)
    ap.add_argument("--models", default="7b,8b,70b", help="of " + ",".join(MODELS))
    ap.add_argument("--rows", default="1,16,64,128,256", help="row counts M")
    ap.add_argument("--sweep", action="store_true", help="time each picked config's neighbours")
    ap.add_argument("--grid", action="store_true", help="with --sweep: a grid of BLOCK_N, "
                    "BLOCK_K, split, warps and stages at each picked BLOCK_M "
                    "(fp8_gemm_config.grid) instead of the neighbours")
    ap.add_argument("--xq", action="store_true", help="the sweep over the W8A8 decode path "
                    "(x quantized per row, then the kernel on e4m3 x e4m3)")
    ap.add_argument("--table", action="store_true", help="print the picked configs and exit")
    ap.add_argument("--budget-s", type=float, default=480.0, help="the sweep's time budget")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, M 1 and 16: a smoke run")
    ap.add_argument("--device", default="cuda", help="cuda; cpu for --quick under "
                    "TRITON_INTERPRET=1")
    ap.add_argument("--warmup-ms", type=float, default=10.0)
    ap.add_argument("--rep-ms", type=float, default=40.0)
    a = ap.parse_args()
    if a.table:
        table()
        return 0
    a.models = ["tiny"] if a.quick else [m for m in a.models.split(",") if m]
    a.rows = [1, 16] if a.quick else [int(r) for r in a.rows.split(",")]
    dev = torch.device(a.device)
    bw = copy_tbps(dev, 0.25 if a.quick else 2.0, 25, 100)
    rows = sweep(a, dev, bw) if a.sweep else compare(a, dev, bw)
    head = dict(base_header(a.device), copy_tbps=round(bw, 3))
    kind = ("fp8-gemm-sweep-" + ("xq-" if a.xq else "") + ("grid-" if a.grid else "")
            if a.sweep else "fp8-gemm-")
    stem = kind + card_slug(head["card"], a.device)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{stem}.json").write_text(json.dumps(dict(header=head, rows=rows), indent=1))
    lines = (sweep_md if a.sweep else compare_md)(head, rows)
    (a.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
