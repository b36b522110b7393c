"""Decode attention's launch shape against batch, context and query heads per KV head: each
launch (BLOCK_N, warps, stages) timed on the same paged cache, after a check against the torch
reference, by CUDA-graph replay (median of triton's do_bench over a graph of 10 calls).

    python -m bench.kernels.attn_launch_scan --out DIR [--groups 1,4] [--batches 8,16,32,64,128]
        [--ctxs 192,1024] [--configs 16,1,2;32,4,2] [--q-heads 16 --head-dim 256]

Writes DIR/attn-launch-scan-<card>.json (rows {"q_heads", "kv_heads", "batch", "ctx", "config",
"us", "tb_s"}) and a markdown table (one row a case, one column a launch, the fastest in bold),
with the card, versions and date. Heads are 32 query heads of 128 (--q-heads, --head-dim: e.g.
Gemma-3-12B's 16 of 256) over q-heads / group KV heads;
16-token blocks in a shuffled block table; contexts within 40 tokens below `ctx`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import torch
import triton

from bench.lib.timing import timed  # (CUDA-graph replay of 10 calls, median)
from kernels.attention_ref import paged_attention_ref
from kernels.attention_triton import paged_attention_triton

BS = 16


def case(batch: int, kv_heads: int, ctx: int, HQ: int, D: int, dev: str = "cuda"):
    g = torch.Generator(device=dev).manual_seed(batch * 7 + ctx + kv_heads)
    per_seq = ctx // BS + 1
    blocks = batch * per_seq
    k = torch.randn(blocks, BS, kv_heads, D, generator=g, device=dev).to(torch.bfloat16)
    v = torch.randn(blocks, BS, kv_heads, D, generator=g, device=dev).to(torch.bfloat16)
    tables = torch.randperm(blocks, generator=g, device=dev).view(batch, per_seq)
    q = torch.randn(batch, HQ, D, generator=g, device=dev).to(torch.bfloat16)
    pos = torch.randint(ctx - 40, ctx, (batch,), generator=g, device=dev).to(torch.int32)
    seq = torch.arange(batch, device=dev, dtype=torch.int32)
    return q, k, v, tables.to(torch.int32).contiguous(), seq, pos


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--groups", default="1,4", help="query heads per KV head")
    p.add_argument("--batches", default="8,16,32,64,96,128")
    p.add_argument("--ctxs", default="192,1024")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--configs", default="16,1,2;32,4,2;32,2,2;64,4,2",
                   help="';'-separated BLOCK_N,WARPS,STAGES[,SPLITS] (SPLITS: the context in "
                   "that many parts, flash-decoding)")
    a = p.parse_args()
    configs = [tuple(ints(c)) for c in a.configs.split(";") if c]
    HQ, D = a.q_heads, a.head_dim
    rows = []
    for group in ints(a.groups):
        for ctx in ints(a.ctxs):
            for batch in ints(a.batches):
                q, k, v, tables, seq, pos = case(batch, HQ // group, ctx, HQ, D)
                scale, cap = D ** -0.5, tables.shape[1] * BS
                ref = paged_attention_ref(q.float(), k.float(), v.float(), tables, seq, pos,
                                          scale, cap)
                kv_bytes = 2 * int((pos.long() + 1).sum()) * (HQ // group) * D * 2
                for config in configs:
                    bn, warps, stages, splits = (*config, 1)[:4]

                    def fn(bn=bn, warps=warps, stages=stages, splits=splits):
                        return paged_attention_triton(q, k, v, tables, seq, pos, scale, cap,
                                                      block_n=bn, num_warps=warps,
                                                      num_stages=stages, splits=splits)
                    err = (fn().float() - ref).abs().max().item()
                    if err > 5e-2:
                        raise SystemExit(f"wrong: group {group} batch {batch} ctx {ctx} "
                                         f"config {config}: err {err}")
                    us = timed(fn)
                    row = dict(q_heads=HQ, kv_heads=HQ // group, batch=batch, ctx=ctx,
                               config=",".join(map(str, config)), us=us,
                               tb_s=kv_bytes / us / 1e6)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del q, k, v, tables
                torch.cuda.empty_cache()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    card = torch.cuda.get_device_name().split()[-1].lower()
    meta = dict(card=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    stem = f"attn-launch-scan-{card}" + ("" if (HQ, D) == (32, 128) else f"-q{HQ}-d{D}")
    (out / f"{stem}.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))
    names = [",".join(map(str, c)) for c in configs]
    lines = [f"# Decode attention launches, {meta['card']}, {meta['date']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}; {HQ} query heads of {D}, bf16, "
             f"{BS}-token blocks; us a call (TB/s of KV read). Launch = BLOCK_N,WARPS,STAGES"
             f"[,SPLITS] (BLOCK_N {BS}: a tile is one KV block; SPLITS: the context in parts, "
             f"then a combine launch).", "",
             "| kv heads | batch | ctx | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    cases = sorted({(r["kv_heads"], r["ctx"], r["batch"]) for r in rows},
                   key=lambda c: (-c[0], c[1], c[2]))
    for kvh, ctx, batch in cases:
        got = {r["config"]: r for r in rows
               if (r["kv_heads"], r["ctx"], r["batch"]) == (kvh, ctx, batch)}
        best = min(got.values(), key=lambda r: r["us"])["config"]
        cells = [(f"**{got[n]['us']:.1f}** ({got[n]['tb_s']:.2f})" if n == best else
                  f"{got[n]['us']:.1f} ({got[n]['tb_s']:.2f})") for n in names]
        lines.append(f"| {kvh} | {batch} | {ctx} | " + " | ".join(cells) + " |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
