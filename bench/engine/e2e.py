"""End-to-end decode throughput on a GPU: the lorafleet engine vs transformers + PEFT.

A Llama-2-7B-shaped model with random bf16 weights (hidden 4096, 32 layers, intermediate 11008,
vocab 32000), rank-16 adapters on q/k/v/o, prompts of 128 tokens and 128 new tokens, batches 32
and 64 with base only and 1, 8, 32, 128 distinct adapters (at most one per row). Reports
tokens/s, the median decode-step time and its ratio to the weight-streaming floor (model bytes /
measured device copy bandwidth), and PEFT's mixed-adapter generate on the same shapes.

    python -m bench.engine.e2e --out bench/results            # on the H200
    python -m bench.engine.e2e --quick --out /tmp/x           # a smoke run
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

from bench.lib.synthetic import (SHAPES, TARGETS, NullTokenizer, adapter_tensors,
                                 llama7b_spec, random_weights, weight_bytes)
from bench.lib.timing import copy_tbps
from services.worker.adapters.layout import staged_from_tensors
from services.worker.engine.sequence import Sampling, Sequence, Stopping
from services.worker.perf_config import PerfConfig
from services.worker.config import EngineOptions
from services.worker.startup.factory import assemble


def copy_bandwidth(device) -> float:
    """Device-to-device copy, bytes read + written per second: 2 GiB each way, as the peers' anchors
    measures the card (4.27 TB/s on the H200). Until the 2026-12-01 late-morning session this copied 1 GiB,
    which read 1-3% lower (4.12-4.19 TB/s) and so gave a 1-3% lower floor ratio."""
    return copy_tbps(device, 2.0, 25, 100) * 1e12


def run_engine(built, slots: list[int], batch: int, prompt_len: int, new: int, seed: int,
               sampling: Sampling | None = None):
    """Submit `batch` requests (row i uses slots[i % len(slots)], -1 = base) and step to the end
    (sampling: every request's; default greedy)."""
    eng = built.engine
    g = torch.Generator().manual_seed(seed)
    done = []
    for i in range(batch):
        prompt = torch.randint(3, 32000, (prompt_len,), generator=g).tolist()
        seq = Sequence(f"r{seed}-{i}", prompt, slot=slots[i % len(slots)] if slots else -1,
                       stopping=Stopping(max_new_tokens=new, ignore_eos=True),
                       sampling=sampling or Sampling())
        eng.submit(seq, lambda ev, d=done: ev.stop and d.append(ev))
    steps, start = [], time.perf_counter()
    while len(done) < batch:
        t0 = time.perf_counter()
        running = len(eng.scheduler.running)
        eng.step()
        steps.append((time.perf_counter() - t0, running))
    total = time.perf_counter() - start
    decode = [t for t, r in steps if r == batch][2:]     # full-batch decode steps
    return {"tokens_per_s": batch * new / total, "total_s": total,
            "decode_step_ms": 1e3 * statistics.median(decode) if decode else None,
            "steps": len(steps)}


# a variant's keys -> the PerfConfig variables they set (over this process's own, ENV0)
VARIANT_ENV = {"layout": "LORAFLEET_WEIGHT_LAYOUT", "blas": "LORAFLEET_BLAS",
               "cols": "LORAFLEET_LORA_COLUMNS", "fold": "LORAFLEET_FOLD_NORMS",
               "pdl": "LORAFLEET_PDL", "rows": "LORAFLEET_LORA_ROWS"}
ENV0 = {k: os.environ.get(k) for k in (*VARIANT_ENV.values(), "LORAFLEET_SGMV_SPLIT")}


def _launch0() -> dict:
    from kernels import fused
    return {"rope_parts": fused.ROPE_LAUNCH["parts"], "rope_warps": fused.ROPE_LAUNCH["num_warps"],
            "silu_block": fused.SILU_LAUNCH["block"], "silu_warps": fused.SILU_LAUNCH["num_warps"]}


LAUNCH0 = _launch0()            # the defaults of kernels.fused's launch shapes


def apply_variant(variant: str) -> tuple[int, "PerfConfig"]:
    """A build variant, "pdl=0,layout=nk" style: PDL on or off (kernels.pdl), the decode GEMMs'
    weight layout (LORAFLEET_WEIGHT_LAYOUT, read when the model is built), the largest rank the
    graphs serve (grank; default: the worker's EngineOptions.graph_max_rank), torch's BLAS
    backend for the base GEMMs (blas=cublas|cublaslt: LORAFLEET_BLAS, read when the model is
    built; default cublaslt), the column LoRA's blocks (cols=N: LORAFLEET_LORA_COLUMNS, read
    when the model is built; default: the worker's, lora_columns.CUDA_DEFAULT), row LoRA for
    o (rows=0|1|2|4|8: LORAFLEET_LORA_ROWS, its shrink's rank parts; default off), the in-layer
    norms folded into the GEMMs (fold=0|1: LORAFLEET_FOLD_NORMS, read when the model is built;
    default on), the rope + KV write and SiLU launch shapes (rope_parts, rope_warps,
    silu_block, silu_warps: kernels.fused.ROPE_LAUNCH / SILU_LAUNCH), and fields of the split
    SGMV's config (kernels.sgmv_split.SplitConfig, e.g. k_chunk=512,progs_per_sm=2:
    LORAFLEET_SGMV_SPLIT). Empty: the defaults. Returns the graphs' largest rank and the
    PerfConfig to build the engine with."""
    import dataclasses
    from kernels import fused, pdl
    from kernels.sgmv_split import SplitConfig
    opts = dict(kv.split("=") for kv in variant.split(",") if kv)
    split_fields = {f.name for f in dataclasses.fields(SplitConfig)}
    launch = {"rope_parts": (fused.ROPE_LAUNCH, "parts"),
              "rope_warps": (fused.ROPE_LAUNCH, "num_warps"),
              "silu_block": (fused.SILU_LAUNCH, "block"),
              "silu_warps": (fused.SILU_LAUNCH, "num_warps")}
    unknown = (set(opts) - {"pdl", "layout", "grank", "blas", "cols", "fold", "logprobs"}
               - set(VARIANT_ENV) - set(launch) - split_fields)
    if unknown:
        raise SystemExit(f"unknown variant keys {sorted(unknown)} (pdl, layout, grank, blas, "
                         f"cols, fold, {', '.join(sorted(launch))}, "
                         f"{', '.join(sorted(split_fields))})")
    for key, (table, field) in launch.items():
        table[field] = int(opts.get(key, LAUNCH0[key]))
    env = {**{k: v for k, v in ENV0.items() if v is not None},
           **{name: opts[key] for key, name in VARIANT_ENV.items() if key in opts}}
    split = [f"{k}={v}" for k, v in opts.items() if k in split_fields]
    env["LORAFLEET_SGMV_SPLIT"] = ",".join(filter(None, [ENV0["LORAFLEET_SGMV_SPLIT"] or "",
                                                          *split]))
    perf = PerfConfig.from_env(env)
    pdl.set_enabled(perf.pdl)
    return int(opts.get("grank", EngineOptions.graph_max_rank)), perf


def _decode_launches(batches) -> dict:
    """The decode attention launch each benchmarked batch takes (the model's 32 KV heads)."""
    from kernels.attention_triton import decode_config
    return {str(b): decode_config(b, 32, 1) for b in batches}


def engine_rows(args, device, variant: str = "") -> tuple[list[dict], dict]:
    grank, perf = apply_variant(variant)
    # logprobs=K: every request asks for its tokens' logprobs and K alternatives (issue 25)
    k = dict(kv.split("=") for kv in variant.split(",") if kv).get("logprobs")
    sampling = Sampling(logprobs=int(k)) if k is not None else None
    spec = llama7b_spec(args.layers)
    weights = random_weights(spec, device, torch.bfloat16)
    wbytes = weight_bytes(weights)
    opts = EngineOptions(device="cuda", dtype="bfloat16", kv_cache_bytes=args.kv_gib << 30,
                         block_size=16, max_batch_tokens=8192, max_running=128,
                         pool_bytes=args.pool_gib << 30, pool_slots=160, max_model_len=1024,
                         graph_max_rank=grank, perf=perf)
    built = assemble(spec, weights, NullTokenizer(), opts, device, torch.bfloat16)
    n_adapters = max(args.distinct)
    slots = [built.pool.place(f"a{i}", staged_from_tensors(
                 adapter_tensors(spec, 16, i + 1, device=device), {"r": 16, "lora_alpha": 32},
                 spec)) for i in range(n_adapters)]
    rows = []
    runs = [(batch, n, True) for batch in args.batch for n in [0, *args.distinct] if n <= batch]
    # the same without overlap (each step waits for the last before the next is launched)
    if not args.no_waited:
        runs += [(max(args.batch), n, False) for n in (0, 32) if n <= max(args.batch)]
    for batch, n, overlap in runs:
        built.engine.overlap = overlap
        use = slots[:n] if n else []
        run_engine(built, use, batch, args.prompt, 8, seed=99, sampling=sampling)   # warm up
        built.engine.runner.timings = []
        r = run_engine(built, use, batch, args.prompt, args.new, seed=n, sampling=sampling)
        torch.cuda.synchronize()
        impl = "lorafleet" if overlap else "lorafleet, no overlap"
        r.update(impl=impl + (f" [{variant}]" if variant else ""), batch=batch, distinct=n,
                 graph_replay_ms=replay_ms(built.engine.runner, batch))
        built.engine.runner.timings = None
        rows.append(r)
        print(json.dumps(r), flush=True)
    built.engine.overlap = True
    meta = {"weight_bytes": wbytes, "graph_replays": getattr(built.engine.runner, "replays", 0)}
    del built, weights
    gc.collect()        # the engine's cycles (threads, graphs) hold its memory until collected
    torch.cuda.empty_cache()
    return rows, meta


def replay_ms(runner, batch: int) -> float | None:
    """Median device time of the decode graphs replayed for `batch` rows during the last run
    (CUDA events around each replay): the GPU's share of a step, without the host's scheduling,
    metadata and sampling around it."""
    times = [s.elapsed_time(e) for b, s, e in (getattr(runner, "timings", None) or []) if b == batch]
    return statistics.median(times[2:]) if len(times) > 2 else None


def peft_rows(args, device) -> list[dict]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    shape = SHAPES["7b"]
    cfg = LlamaConfig(num_hidden_layers=args.layers, **{k: shape[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings")})
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    n_max = max(d for d in args.peft_distinct)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=list(TARGETS)),
                           adapter_name="a0")
    for i in range(1, n_max):
        model.add_adapter(f"a{i}", LoraConfig(r=16, lora_alpha=32, target_modules=list(TARGETS)))
    model.eval()
    rows = []
    for batch in args.batch:
        ids = torch.randint(3, 32000, (batch, args.prompt), device=device)
        for n in [0, *args.peft_distinct]:
            names = ["__base__"] * batch if n == 0 else [f"a{i % n}" for i in range(batch)]
            def gen(k):
                torch.cuda.synchronize()
                t = time.perf_counter()
                with torch.no_grad():
                    model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                                   adapter_names=names, pad_token_id=0)
                torch.cuda.synchronize()
                return time.perf_counter() - t
            gen(2)
            t1, tk = gen(1), gen(1 + args.peft_new)
            step = (tk - t1) / args.peft_new
            r = {"impl": "peft", "batch": batch, "distinct": n, "decode_step_ms": 1e3 * step,
                 "tokens_per_s": batch / step}
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


def write(out: pathlib.Path, rows: list[dict], header: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e-h200.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    floor = header["floor_ms"]
    lines = [f"# End to end, {header['gpu']}, {header['date']}", "",
             f"torch {header['torch']}, triton {header['triton']}; Llama-2-7B shape "
             f"({header['layers']} layers), bf16, rank-16 q/k/v/o adapters, prompt "
             f"{header['prompt']}, {header['new']} new tokens. Weight-streaming floor "
             f"{floor:.2f} ms ({header['weight_bytes']/1e9:.1f} GB at "
             f"{header['copy_tb_s']:.2f} TB/s).", "",
             "| impl | batch | distinct adapters | tokens/s | decode step ms | step / floor "
             "| graph replay ms |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = r.get("decode_step_ms")
        lines.append(f"| {r['impl']} | {r['batch']} | {r['distinct'] or 'base'} | "
                     f"{r['tokens_per_s']:.0f} | {ms:.2f} | {ms / floor:.2f} | "
                     f"{r.get('graph_replay_ms') or 0:.2f} |" if ms else
                     f"| {r['impl']} | {r['batch']} | {r['distinct']} | {r['tokens_per_s']:.0f} "
                     "| - | - |")
    builds = [i for i in dict.fromkeys(r["impl"] for r in rows)
              if i.startswith("lorafleet") and "no overlap" not in i]
    for impl in builds:                  # one build, or each A/B variant
        ours = {(r["batch"], r["distinct"]): r for r in rows if r["impl"] == impl}
        big = max((b for b, _ in ours), default=None)
        if big is not None and all((big, n) in ours for n in (0, 1, 32)):
            r0, r1, r32 = (ours[(big, n)] for n in (0, 1, 32))
            lines += ["", f"{impl}, batch {big}, 32 distinct adapters: decode step "
                      f"{r32['decode_step_ms'] / floor:.2f}x the floor (target <= 2), "
                      f"{100 * r32['tokens_per_s'] / r1['tokens_per_s']:.0f}% of the "
                      "single-adapter throughput (target >= 90%), "
                      f"{100 * r32['tokens_per_s'] / r0['tokens_per_s']:.0f}% of the base-only "
                      "throughput (target >= 80%)."]
    (out / "e2e-h200.md").write_text("\n".join(lines) + "\n")
    write_plot(out / "e2e-h200.png", rows, header)


def write_plot(path: pathlib.Path, rows: list[dict], header: dict) -> bool:
    """tokens/s against distinct adapters, per batch size: each lorafleet build (the default
    one, or each A/B variant) and PEFT (log scale)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    builds = [i for i in dict.fromkeys(r["impl"] for r in rows)
              if i.startswith("lorafleet") and "no overlap" not in i]
    for impl, style in [(b, "-o") for b in builds] + [("peft", "--s")]:
        for batch in sorted({r["batch"] for r in rows if r["impl"] == impl}):
            pts = sorted((r["distinct"], r["tokens_per_s"]) for r in rows
                         if r["impl"] == impl and r["batch"] == batch)
            ax.plot([str(d or "base") for d, _ in pts], [v for _, v in pts], style,
                    label=f"{impl}, batch {batch}")
    ax.set_yscale("log")
    ax.set_xlabel("distinct adapters in the batch")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"Llama-2-7B shape, bf16, rank-16 q/k/v/o, {header['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-peft", action="store_true")
    p.add_argument("--attn-config", default="",
                   help="decode attention BLOCK_N,WARPS,STAGES[,SPLITS]")
    p.add_argument("--batches", default="", help="override: batch sizes, e.g. 64")
    p.add_argument("--distincts", default="", help="override: distinct adapter counts, e.g. 1,32")
    p.add_argument("--new", type=int, default=0, help="override: new tokens per request")
    p.add_argument("--plot-from", type=pathlib.Path, help="only draw the plot of a results JSON")
    p.add_argument("--variants", default="", help="A/B builds, ';'-separated, each like "
                   "'pdl=0,layout=nk' (rows tagged with it); default: one default build")
    p.add_argument("--no-waited", action="store_true", help="skip the runs without overlap")
    a = p.parse_args()
    if a.plot_from:
        doc = json.loads(a.plot_from.read_text())
        return 0 if write_plot(a.plot_from.with_suffix(".png"), doc["rows"], doc["header"]) else 1
    if a.attn_config:
        from kernels.attention_triton import DECODE_OVERRIDE
        bn, warps, stages, splits = (*(int(x) for x in a.attn_config.split(",")), 1)[:4]
        DECODE_OVERRIDE.update(block_n=bn, num_warps=warps, num_stages=stages, splits=splits)
    a.layers, a.prompt, a.new_default = (4, 32, 16) if a.quick else (32, 128, 128)
    a.batch = [8] if a.quick else [32, 64]
    a.distinct = [1, 4] if a.quick else [1, 8, 32, 128]
    a.peft_distinct = [1, 4] if a.quick else [1, 8, 32]
    a.peft_new = 4 if a.quick else 8
    a.kv_gib, a.pool_gib = (2, 1) if a.quick else (24, 6)
    if a.batches:
        a.batch = [int(x) for x in a.batches.split(",")]
    if a.distincts:
        a.distinct = [int(x) for x in a.distincts.split(",")]
    a.new = a.new or a.new_default
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    rows, meta = [], {}
    for variant in (a.variants.split(";") if a.variants else [""]):
        more, meta = engine_rows(a, device, variant)
        rows += more
    if not a.no_peft:
        rows += peft_rows(a, device)
    import triton
    header = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "python": platform.python_version(),
              "layers": a.layers, "prompt": a.prompt, "new": a.new, "copy_tb_s": bw / 1e12,
              "attention_decode_config": _decode_launches(a.batch),
              "floor_ms": 1e3 * meta["weight_bytes"] / bw, **meta}
    write(pathlib.Path(a.out), rows, header)
    print((pathlib.Path(a.out) / "e2e-h200.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
