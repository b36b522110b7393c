"""FP8 weights against bf16 in the decode step (issue 46): one checkpoint shape (Llama-2-7B by
default), random bf16 weights, built twice through the worker's own loader path (bench.engine
.families.run_model: load_spec, the loader's per-tensor FP8 quantization for --quantization fp8,
fuse_layers, assemble, the warm-up), batch 64 with the base model and with 32 rank-16 q/k/v/o
adapters. Each decode step is set against its bytes floor (the weights as stored: FP8 values and
their scales, or bf16; the KV read; the adapters) over the card's copy bandwidth; the FP8 rows
also against the bf16 row of the same adapters (target: <= 0.75x, and <= 1.2x its own floor).

    python -m bench.engine.fp8 --out bench/results                 # H100 / H200, ~3 min
    python -m bench.engine.fp8 --quick --out /tmp/x                 # tiny shapes, any device
    python -m bench.engine.fp8 --served saturation-h100.json ...    # + a served run's rows

Writes fp8-<card>.{json,md}: {"header", "rows": [{"dtype", "batch", "distinct",
"decode_step_ms", "bytes_floor_ms", ...}], "served": [the rows of --served files: the
saturation benchmark's, e.g. its closed-loop runs of a bf16 and an FP8 stack]}.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

from bench.engine.families import CONFIGS, config, run_header, run_model, settings


def compare(rows: list[dict]) -> None:
    """Each FP8 row's step against the bf16 row of the same adapters (vs_bf16), in place."""
    bf16 = {r["distinct"]: r["decode_step_ms"] for r in rows if r["dtype"] == "bf16"}
    for r in rows:
        ref = bf16.get(r["distinct"])
        r["vs_bf16"] = (r["decode_step_ms"] / ref
                        if r["dtype"] == "fp8" and ref and r["decode_step_ms"] else None)


def served_rows(paths: list[str]) -> list[dict]:
    """The rows of saturation-benchmark results (bench.serve saturation's JSON), each tagged
    with its file."""
    out = []
    for path in paths:
        doc = json.loads(pathlib.Path(path).read_text())
        out += [{**r, "source": pathlib.Path(path).name} for r in doc.get("rows", [])]
    return out


def write(out: pathlib.Path, doc: dict) -> pathlib.Path:
    out.mkdir(parents=True, exist_ok=True)
    h, rows = doc["header"], doc["rows"]
    stem = out / f"fp8-{h['card_slug']}"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    lines = [f"# FP8 weights against bf16, {h['card']}, {h['date']}", "",
             f"{h['model']}, random weights; batch {rows[0]['batch']}, prompts of "
             f"{h['prompt']} tokens, {h['new']} new; rank-16 q/k/v/o adapters (bf16 in both); "
             f"the bytes floor: the weights as stored + the KV read + the adapters over "
             f"{h['copy_tb_s']:.2f} TB/s. Targets: FP8 <= 0.75x bf16 and <= 1.2x its floor.", "",
             "| weights | adapters | weight GB | decode step ms | bytes floor ms | step / floor "
             "| vs bf16 | compiles after warm-up |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = f"{r['vs_bf16']:.3f}x" if r.get("vs_bf16") else "-"
        lines.append(f"| {r['dtype']} | {r['distinct'] or 'base'} | {r['weight_gb']:.2f} | "
                     f"{r['decode_step_ms']:.2f} | {r['bytes_floor_ms']:.2f} | "
                     f"{r['ratio']:.2f} | {vs} | {r['compiles_after_warmup']} |")
    if doc["served"]:
        lines += ["", f"Served rows: {len(doc['served'])} from "
                  f"{', '.join(sorted({r['source'] for r in doc['served']}))} (in the JSON)."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return stem


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--model", default="llama-7b", choices=sorted(CONFIGS))
    p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run, any device)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--distinct", type=int, default=32)
    p.add_argument("--served", nargs="*", default=[],
                   help="saturation-benchmark JSON files whose rows go under 'served'")
    p.add_argument("--commit", default=None)
    a = p.parse_args(argv)
    device, bw = settings(a)
    cfg = config(a.model, a.quick)
    rows = []
    for quantization in ("auto", "fp8"):
        rows += run_model(a.model, cfg, a, device, bw, quantization)
    compare(rows)
    doc = {"header": {**run_header(a, device, bw), "model": a.model}, "rows": rows,
           "served": served_rows(a.served)}
    print(write(pathlib.Path(a.out), doc).with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
