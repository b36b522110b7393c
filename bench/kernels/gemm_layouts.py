"""Which weight layout cuBLAS serves fastest for the decode GEMMs of a Llama-2-7B layer (bf16; or
of a bench.engine.families shape: --model gemma-3-12b):
y = x @ W.T with W stored [N, K] (F.linear, as checkpoints store it) against W.T stored [K, N]
(torch.mm), at decode batch sizes; and the [N, K] weight split in halves of N or of K as one
batched GEMM (bmm_N2, bmm_K2: other cuBLAS tilings, e.g. more CTAs for down). Median of
CUDA-graph replays, each call on its own weights (cold), achieved bandwidth next to an eager
copy.

    python -m bench.kernels.gemm_layouts --out DIR [--blas cublas,cublaslt] [--names qkv,o]
        [--extra-n 0,512] [--extra-k 0,512] [--pad-ld 256,512] [--name gemm-layouts-h200]
        [--model gemma-3-12b]

--blas runs the sweep once per torch BLAS backend (torch.backends.cuda.preferred_blas_library);
rows carry the backend's name.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

from bench.lib.synthetic import SHAPES as MODELS
from bench.lib.timing import copy_tbps, time_us

_H, _I, _V = (MODELS["7b"][k] for k in ("hidden_size", "intermediate_size", "vocab_size"))
SHAPES = {"qkv": (3 * _H, _H), "o": (_H, _H), "gate_up": (2 * _I, _H), "down": (_H, _I),
          "lm_head": (_V, _H)}                     # the 7B's decode GEMMs, (N, K)


def shapes_of(model: str) -> dict:
    """The decode GEMMs (N, K) of "7b" or of a bench.engine.families config."""
    if model == "7b":
        return SHAPES
    from bench.lib.model_configs import CONFIGS
    c = CONFIGS[model]
    h, i = c["hidden_size"], c["intermediate_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i),
            "lm_head": (c["vocab_size"], h)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--batches", default="32,64,128")
    ap.add_argument("--blas", default="", help="backends to compare, e.g. cublas,cublaslt")
    ap.add_argument("--names", default="", help="only these GEMMs, e.g. qkv,o")
    ap.add_argument("--variants", default="", help="only these variants, e.g. mm_KN")
    ap.add_argument("--pad-ld", default="", help="also [K, N] views of wider [K, N + pad] "
                    "buffers (mm_KN_ld+pad: a leading dimension past N), e.g. 256,512")
    ap.add_argument("--extra-n", default="0", help="rows added to each weight's N, e.g. "
                    "0,256,512 (column LoRA's A blocks: 16 a rank-16 adapter and slice)")
    ap.add_argument("--extra-k", default="0", help="rows added to each weight's K, e.g. 0,512 "
                    "(the o expand inside the o GEMM: 16 rows of B a rank-16 adapter)")
    ap.add_argument("--name", default="gemm-layouts-h200", help="result file stem")
    ap.add_argument("--model", default="7b", help="7b, or a bench.lib.model_configs shape")
    a = ap.parse_args()
    shapes_all = shapes_of(a.model)
    backends = a.blas.split(",") if a.blas else [None]
    names = set(a.names.split(",")) if a.names else set(shapes_all)
    only = set(a.variants.split(",")) if a.variants else None
    dev = torch.device("cuda")
    bw = copy_tbps(dev, 2.0, 25, 100)
    rows = []
    extras = [int(e) for e in a.extra_n.split(",")]
    kextras = [int(e) for e in a.extra_k.split(",")]
    shapes = [(name + (f"+{e}" if e else "") + (f"+k{ek}" if ek else ""), (n + e, k + ek))
              for name, (n, k) in shapes_all.items() if name in names for e in extras
              for ek in kextras]
    for blas, (name, (n, k)) in ((b, item) for b in backends for item in shapes):
        if blas:
            torch.backends.cuda.preferred_blas_library(blas)
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(4)]
        wts = [w.t().contiguous() for w in ws]
        pads = [int(p) for p in a.pad_ld.split(",") if p]
        padded = {p: [torch.cat([wt, wt.new_zeros(k, p)], dim=1)[:, :n] for wt in wts]
                  for p in pads}
        for m in (int(b) for b in a.batches.split(",")):
            xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(4)]
            outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(4)]
            variants = {
                "linear_NK": [lambda i=i: torch.matmul(xs[i], ws[i].t(), out=outs[i])
                              for i in range(4)],
                "F.linear": [lambda i=i: F.linear(xs[i], ws[i]) for i in range(4)],
                "mm_KN": [lambda i=i: torch.mm(xs[i], wts[i], out=outs[i]) for i in range(4)],
                "mm_NK_xT": [lambda i=i: torch.mm(ws[i], xs[i].t()) for i in range(4)],
                # the [N, K] weight as two halves of N in one batched GEMM (out [2, M, N/2])
                "bmm_N2": [lambda i=i: torch.bmm(xs[i].expand(2, m, k),
                                                 ws[i].view(2, n // 2, k).transpose(1, 2))
                           for i in range(4)],
                # two halves of K in one batched GEMM, then their sum (out [2, M, N])
                "bmm_K2": [lambda i=i: torch.bmm(xs[i].view(m, 2, k // 2).transpose(0, 1),
                                                 ws[i].view(n, 2, k // 2).permute(1, 2, 0))
                           for i in range(4)],
            }
            for p, wps in padded.items():
                variants[f"mm_KN_ld+{p}"] = [lambda i=i, wps=wps: torch.mm(xs[i], wps[i],
                                                                         out=outs[i])
                                             for i in range(4)]
            ref = (xs[0].float() @ ws[0].float().t())
            for v, fns in variants.items():
                if only and v not in only and not v.startswith("mm_KN_ld+"):
                    continue
                out = fns[0]()
                out = outs[0] if out is None else out
                if v == "mm_NK_xT":
                    out = out.t()
                elif v == "bmm_N2":
                    out = out.transpose(0, 1).reshape(m, n)
                elif v == "bmm_K2":
                    out = out.sum(0)
                err = float((out.float() - ref).abs().max() / ref.abs().max())
                us = time_us(fns, dev, 25, 100)
                nbytes = 2 * (n * k + m * k + m * n)
                rows.append({"blas": blas or "default", "gemm": name, "M": m, "N": n, "K": k,
                             "variant": v, "us": round(us, 2), "tbps": round(nbytes / us / 1e6, 2),
                             "rel_err": err})
                print(f"{blas or '':9s}{name:8s} M={m:4d} {v:10s} {us:7.2f} us "
                      f"{nbytes / us / 1e6:5.2f} TB/s err {err:.1e}", flush=True)
        del ws, wts, padded
        torch.cuda.empty_cache()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{a.name}.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_tbps": bw,
         "model": a.model,
         "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows}, indent=1))
    print(f"copy {bw:.2f} TB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
