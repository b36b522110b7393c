"""FP8 weights against bf16 in the decode step (issue 46): checkpoint shapes (Llama-2-7B by
default; Llama-3-70B's FP8 rows alone where its bf16 weights do not fit), random weights, built
through the worker's own loader path (bench.engine.families.run_model: load_spec, the loader's
per-tensor FP8 quantization for --quantization fp8, fuse_layers, assemble, the warm-up), batch
64 with the base model and with 32 rank-16 q/k/v/o adapters. Each decode step is set against its
bytes floor (the weights as stored: FP8 values and their scales, or bf16; the KV read; the
adapters) over the card's copy bandwidth; the FP8 rows also against the bf16 row of the same
adapters (target: <= 0.75x, and <= 1.2x its own floor).

    python -m bench.engine.fp8 --out bench/results                 # H100 / H200, ~3 min
    python -m bench.engine.fp8 --quick --out /tmp/x                 # tiny shapes, any device
    python -m bench.engine.fp8 --served saturation-h100.json ...    # + a served run's rows
    python -m bench.engine.fp8 --models llama-70b --out /tmp/70b     # on an H200
    python -m bench.engine.fp8 --merge a/fp8-h200.json b/fp8-h200.json --out bench/results
    python -m bench.engine.fp8 --kv-cache-dtype auto,fp8 --out /tmp/kv  # + rows with FP8 KV

Rows: bf16, FP8 W8A8 (--quantization fp8: "activations": "token") and FP8 weight-only (W8A16,
--quantization fp8-weight-only: "activations": "bf16"), each with every --kv-cache-dtype given
("kv_cache_dtype": "fp8": the e4m3 KV cache, its read counted at 1 byte an element in the floor).

Writes fp8-<card>.{json,md}: {"header", "rows": [{"model", "dtype", "batch", "distinct",
"decode_step_ms", "bytes_floor_ms", ...}], "served": [the rows of --served files: the
saturation benchmark's, e.g. its closed-loop runs of a bf16 and an FP8 stack]}.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

from bench.engine.families import CONFIGS, config, run_header, run_model, settings


def compare(rows: list[dict]) -> None:
    """Each FP8 row's step (FP8 weights, or an FP8 KV cache) against the bf16 row of the same
    model and adapters with a bf16 KV cache (vs_bf16), in place."""
    def kv8(r):
        return r.get("kv_cache_dtype", "auto") == "fp8"
    bf16 = {(r["model"], r["distinct"]): r["decode_step_ms"] for r in rows
            if r["dtype"] == "bf16" and not kv8(r)}
    for r in rows:
        ref = bf16.get((r["model"], r["distinct"]))
        fp8 = r["dtype"] == "fp8" or kv8(r)
        r["vs_bf16"] = r["decode_step_ms"] / ref if fp8 and ref and r["decode_step_ms"] else None


def served_rows(paths: list[str]) -> list[dict]:
    """The rows of saturation-benchmark results (bench.serve saturation's JSON), each tagged
    with its file (its parent folder's name too: two stacks' results share a file name) and the
    worker's --quantization in that run (its argv's --worker-flag; "auto" when not given)."""
    out = []
    for path in paths:
        path = pathlib.Path(path)
        doc = json.loads(path.read_text())
        argv = doc["header"].get("argv", [])
        tags = {"quantization": worker_flag(argv, "quantization"),
                "kv_cache_dtype": worker_flag(argv, "kv-cache-dtype")}
        out += [{**r, "source": f"{path.parent.name}/{path.name}", **tags}
                for r in doc.get("rows", [])]
    return out


def worker_flag(argv: list[str], name: str) -> str:
    """The worker's --NAME in a serving benchmark's argv (its --worker-flag=--NAME=VALUE; auto
    when absent)."""
    flags = [a.split("=", 1)[1] for a in argv if a.startswith("--worker-flag=")]
    values = [f.split("=", 1)[1] for f in flags if f.startswith(f"--{name}=")]
    return values[-1] if values else "auto"


def _stack(r: dict) -> str:
    """A served row's stack: its worker's --quantization, "+kv8" with an e4m3 KV cache."""
    return r["quantization"] + ("+kv8" if r.get("kv_cache_dtype") == "fp8" else "")


def served_md(served: list[dict]) -> list[str]:
    """The closed-loop rows of the served runs, FP8 beside the bf16 (auto) run's row of the same
    scenario: the issue's served target is >= 1.3x (64 streams, 32 resident adapters)."""
    closed = [r for r in served if r.get("mode") == "closed"]
    bf16 = {r["scenario"]: r["out_tok_s"] for r in closed if _stack(r) == "auto"}
    lines = ["", "Served (the saturation benchmark's closed loops through the services; each "
             "quantization its own stack, one device call):", "",
             "| quantization | scenario | streams | out tok/s | TTFT p50 ms | ITL p50 ms "
             "| vs bf16 | source |", "|---|---|---|---|---|---|---|---|"]
    for r in closed:
        ref = bf16.get(r["scenario"]) if _stack(r) != "auto" else None
        vs = f"{r['out_tok_s'] / ref:.2f}x" if ref and r["out_tok_s"] else "-"
        lines.append(f"| {_stack(r)} | {r['scenario']} | {r.get('streams')} | "
                     f"{r['out_tok_s']:.0f} | {r['ttft_p50_ms']:.1f} | {r['itl_p50_ms']:.2f} | "
                     f"{vs} | {r['source']} |")
    return lines


def write(out: pathlib.Path, doc: dict) -> pathlib.Path:
    out.mkdir(parents=True, exist_ok=True)
    h, rows = doc["header"], doc["rows"]
    stem = out / f"fp8-{h['card_slug']}"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    lines = [f"# FP8 weights against bf16, {h['card']}, {h['date']}", "",
             f"{', '.join(h['models'])}, random weights; batch {rows[0]['batch']}, prompts of "
             f"{h['prompt']} tokens, {h['new']} new; rank-16 q/k/v/o adapters (bf16 in both); "
             f"the bytes floor: the weights as stored + the KV read + the adapters over "
             f"{h['copy_tb_s']:.2f} TB/s. Targets: FP8 <= 0.75x bf16 and <= 1.2x its floor.", "",
             "| model | weights | adapters | weight GB | decode step ms | bytes floor ms "
             "| step / floor | vs bf16 | compiles after warm-up |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = f"{r['vs_bf16']:.3f}x" if r.get("vs_bf16") else "-"
        weights = (r["dtype"] + (" W8A8" if r.get("activations") == "token" else "")
                   + (", FP8 KV" if r.get("kv_cache_dtype") == "fp8" else ""))
        lines.append(f"| {r['model']} | {weights} | {r['distinct'] or 'base'} | "
                     f"{r['weight_gb']:.2f} | "
                     f"{r['decode_step_ms']:.2f} | {r['bytes_floor_ms']:.2f} | "
                     f"{r['ratio']:.2f} | {vs} | {r['compiles_after_warmup']} |")
    for note in h.get("notes", []):
        lines += ["", note]
    if doc["served"]:
        lines += served_md(doc["served"])
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return stem


def bf16_fits(cfg: dict, device) -> bool:
    """Whether the model's bf16 weights (2 bytes a parameter) leave a tenth of the card free."""
    if device.type != "cuda":
        return True
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim", h // heads)
    per_layer = h * d * (2 * heads + 2 * kv) + 3 * h * i
    params = layers * per_layer + cfg["vocab_size"] * h * (1 if cfg["tie_word_embeddings"] else 2)
    return 2 * params < 0.9 * torch.cuda.get_device_properties(device).total_memory


def merge(paths: list[str]) -> dict:
    """One document from fp8 runs of one card (e.g. the 7B and the 70B, each its own device
    call): their rows in order, the first one's header with every run's models and date."""
    docs = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    cards = {d["header"]["card"] for d in docs}
    if len(cards) != 1:
        raise SystemExit(f"refusing to merge runs of different cards: {sorted(cards)}")
    header = dict(docs[0]["header"])
    header["models"] = [m for d in docs for m in d["header"]["models"]]
    header["runs"] = [{"date": d["header"]["date"], "commit": d["header"].get("commit"),
                       "models": d["header"]["models"]} for d in docs]
    header["notes"] = [n for d in docs for n in d["header"].get("notes", [])]
    rows = [r for d in docs for r in d["rows"]]
    compare(rows)
    return {"header": header, "rows": rows, "served": [r for d in docs for r in d["served"]]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--models", default="llama-7b",
                   help=f"of {', '.join(sorted(CONFIGS))}; a model whose bf16 weights do not "
                        "fit the card gets FP8 rows only (llama-70b on an H200)")
    p.add_argument("--merge", nargs="*", default=None,
                   help="fp8-<card>.json files of one card written by separate runs: one file")
    p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run, any device)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--distinct", type=int, default=32)
    p.add_argument("--served", nargs="*", default=[],
                   help="saturation-benchmark JSON files whose rows go under 'served'")
    p.add_argument("--commit", default=None)
    p.add_argument("--quantizations", default="auto,fp8,fp8-weight-only",
                   help="the worker's --quantization values to run: auto (the bf16 rows), fp8 "
                        "(W8A8, inputs per token), fp8-weight-only (W8A16)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="the worker's --kv-cache-dtype values to run each quantization with: "
                        "auto (bf16 KV), fp8 (e4m3 KV, read counted at 1 byte in the floor); "
                        "e.g. auto,fp8")
    p.add_argument("--profile", action="store_true",
                   help="then each run's GPU kernels of a short run by total time: "
                        "OUT/profile-<model>[-<quantization>][-kv8].txt")
    a = p.parse_args(argv)
    if a.merge:
        print(write(pathlib.Path(a.out), merge(a.merge)).with_suffix(".md").read_text())
        return 0
    device, bw = settings(a)
    rows, notes, models = [], [], a.models.split(",")
    for model in models:
        cfg = config(model, a.quick)
        quants = a.quantizations.split(",")
        if not bf16_fits(cfg, device):
            quants = [q for q in quants if q != "auto"]
            notes.append(f"{model}: no bf16 rows (its bf16 weights do not fit this card)")
        for quantization in quants:
            for kv in a.kv_cache_dtype.split(","):
                rows += run_model(model, cfg, a, device, bw, quantization, kv)
    compare(rows)
    doc = {"header": {**run_header(a, device, bw), "models": models, "notes": notes},
           "rows": rows, "served": served_rows(a.served)}
    print(write(pathlib.Path(a.out), doc).with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
