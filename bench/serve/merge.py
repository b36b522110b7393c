"""Several serving-benchmark results (one run each, e.g. one worker, then two, then the
kill-and-restart run) as one results file in the same format: the first run's header with every
run's header under "runs", every run's rows (each row says its "workers"), the CDFs keyed
"wW:scenario", and a markdown with a comparison table (each scenario run with one worker and
with more: throughput, its ratio, TTFT, per-worker hit rates and working sets) above each run's
own tables. With --supersede a scenario measured again in a later run keeps only that run's rows
(a record's resident table re-measured after a change, the rest of the record as it was).

    python -m bench.serve.merge --out bench/results --name serve-2gpu-h200 \\
        OUT/w1.json OUT/w2.json OUT/kill.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

from bench.serve import report as serve_report


def merge(docs: list[dict], supersede: bool = False) -> dict:
    """One document of several runs; each row gains "run" (its run's index in header["runs"]).
    supersede: a scenario run again later (same name and worker count) keeps only its latest
    run's rows, e.g. a record's resident table re-measured after a change, beside the rest of
    the record."""
    if any(d["header"].get("suite") == "saturation" for d in docs):
        raise SystemExit("saturation results: merge them with python -m "
                         "bench.serve.saturation_report --merge (a table of several runs, no "
                         "ratios across them)")
    header = dict(docs[0]["header"])
    header["runs"] = [d["header"] for d in docs]
    latest = {}
    for i, d in enumerate(docs):
        for r in d["rows"]:
            latest[_key(r)] = i
    rows, cdfs = [], {}
    for i, d in enumerate(docs):
        for r in d["rows"]:
            if supersede and latest[_key(r)] != i:
                continue
            rows.append({**r, "run": i})
            if r["scenario"] in d.get("cdfs", {}):
                cdfs[f"w{r.get('workers', 1)}:{r['scenario']}"] = d["cdfs"][r["scenario"]]
    if supersede:
        header["superseded"] = "a scenario measured in several runs keeps its latest run's rows"
    return {"header": header, "rows": rows, "cdfs": cdfs}


def _key(row: dict) -> tuple:
    return row["scenario"], row.get("workers", 1)


def _first(rows: list[dict]) -> dict[tuple, dict]:
    out = {}
    for r in rows:
        out.setdefault((r["scenario"], r.get("workers", 1)), r)
    return out


def comparison(rows: list[dict]) -> list[str]:
    """One line per scenario run with one worker and with W > 1."""
    first = _first(rows)
    lines = ["| scenario | workers | out tok/s | vs 1 worker | TTFT p50 / p99 ms | gpu hit | "
             "per worker: hit, resident | on 2+ GPUs |", "|" + "---|" * 8]
    f = serve_report._f
    for (name, w), r in first.items():
        one = first.get((name, 1))
        if one is None or not any(k[0] == name and k[1] > 1 for k in first):
            continue
        ratio = (r["out_tok_s"] / one["out_tok_s"]) if one["out_tok_s"] else None
        per = "; ".join(f"{f(p['gpu_hit_rate'], '{:.2f}')}, {p['resident']}"
                        for p in r.get("per_worker") or [])
        mr = r.get("multi_resident") or {}
        lines.append(f"| {name} | {w} | {r['out_tok_s']:.0f} | {f(ratio, '{:.2f}x')} | "
                     f"{f(r['ttft_p50_ms'])} / {f(r['ttft_p99_ms'])} | "
                     f"{f(r['gpu_hit_rate'], '{:.2f}')} | {per or '-'} | "
                     f"{mr.get('count', '-') if mr else '-'} |")
    return lines if len(lines) > 2 else []


def markdown(doc: dict) -> str:
    h = doc["header"]
    parts = [f"# Serving benchmark, {len(h['runs'])} runs, {h['card']}, {h['date']}", ""]
    table = comparison(doc["rows"])
    if table:
        parts += ["The same scenarios (same requests) with one worker and with more:", "",
                  *table, ""]
    if h.get("superseded"):
        parts += [f"Rows from {len(h['runs'])} runs: {h['superseded']}; each run's own "
                  "tables below hold the rows kept from it.", ""]
    for i, run in enumerate(h["runs"]):
        w = (run.get("workers") or {}).get("count", 1)
        rows = [r for r in doc["rows"] if r["run"] == i]
        if not rows:
            continue
        parts += [f"## {w} worker{'s' if w > 1 else ''}: {' '.join(run['argv'])}", "",
                  serve_report.markdown(run, rows)]
    return "\n".join(parts)


def plots(out: pathlib.Path, name: str, doc: dict) -> list:
    """The serving benchmark's plots of the merged rows (where matplotlib is): a scenario run
    with several worker counts is labelled with each."""
    counts: dict[str, set] = {}
    for r in doc["rows"]:
        counts.setdefault(r["scenario"], set()).add(r.get("workers", 1))
    rows, cdfs = [], {}
    for r in doc["rows"]:
        w = r.get("workers", 1)
        label = r["scenario"] if len(counts[r["scenario"]]) == 1 else f"{r['scenario']} ({w}w)"
        rows.append({**r, "scenario": label})
        if f"w{w}:{r['scenario']}" in doc["cdfs"]:
            cdfs[label] = doc["cdfs"][f"w{w}:{r['scenario']}"]
    return serve_report.plots(out, name, doc["header"], rows, cdfs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", help="results NAME.json files, in order")
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--supersede", action="store_true", help="a scenario in several runs: only "
                   "its latest run's rows (else every run's)")
    a = p.parse_args(argv)
    doc = merge([json.loads(pathlib.Path(x).read_text()) for x in a.inputs], a.supersede)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"{a.name}.md").write_text(markdown(doc))
    drawn = plots(out, a.name, doc)
    print(f"wrote {out / a.name}.json, .md{''.join(', ' + x.name for x in drawn)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
