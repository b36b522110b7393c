"""The saturation suite's results: OUT/NAME.json ({"header", "rows"}, every row with its run
id), NAME.md (each row's ratio to the base model's row of the same run and load) and NAME.png
(goodput and ITL against adapter count). Ratios are computed within one run only: a table of
rows from several runs says so and `ratios` refuses it.

Step profiles (bench/serve/steps.py has the profile's keys): each measured row's "steps" (the
worker's engine steps over it by class; a goodput row's over every probe of its search) and the
header's "steps": {workload: the profile of its steady closed-loop rows and goodput search, an
adapter workload's classes with base_mean_ms and vs_base against base's}. NAME.md has a Steps
table per workload from them (one run only: a merged document has none).

    python -m bench.serve.saturation_report --check A.json [B.json ...]   # exit 1: rows of >1 run
    python -m bench.serve.saturation_report --ratios A.json                # the ratios, or refuses
    python -m bench.serve.saturation_report --merge A.json B.json --out DIR --name N  # no ratios
    python -m bench.serve.saturation_report --replot A.json                # NAME.md and NAME.png
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

from bench.serve import steps as serve_steps

ROW_FIELDS = ("scenario", "mode", "adapters", "zipf", "ranks", "state", "offered_req_s",
              "req_s", "out_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
              "gpu_hit_rate", "cold_p50_ms")
HEADER_FIELDS = ("date", "card", "versions", "commit", "run")


class MixedRuns(ValueError):
    """Rows of several runs: no ratio between them."""


def runs_of(rows: list[dict]) -> list[str]:
    return sorted({r.get("run") or "?" for r in rows})


def check_one_run(rows: list[dict]) -> str:
    """The run id the rows share; MixedRuns if they come from several (or say none)."""
    runs = runs_of(rows)
    if len(runs) != 1 or runs[0] == "?":
        raise MixedRuns(f"rows from {len(runs)} runs ({', '.join(runs)}): ratios across runs "
                        "are refused")
    return runs[0]


def _key(r: dict) -> tuple:
    return r["mode"], r.get("streams") if r["mode"] == "closed" else None, \
        r.get("frac_of_base_goodput") if r["mode"] == "open" else None


def _div(a, b):
    return round(a / b, 4) if a is not None and b else None


def ratios(rows: list[dict]) -> list[dict]:
    """Per row, against the base model's steady row of the same mode and load: throughput
    (goodput req/s; closed-loop out tok/s) and ITL p50 / p99. MixedRuns across runs."""
    check_one_run(rows)
    base = {_key(r): r for r in rows if r["adapters"] == 0 and r["state"] == "steady"}
    out = []
    for r in rows:
        b = base.get(_key(r))
        tput = None
        if b is not None and r["mode"] == "goodput":
            tput = _div(r.get("goodput_req_s"), b.get("goodput_req_s"))
        elif b is not None and r["mode"] == "closed":
            tput = _div(r["out_tok_s"], b["out_tok_s"])
        out.append({"scenario": r["scenario"], "base": b["scenario"] if b else None,
                    "throughput": tput,
                    "itl_p50": _div(r["itl_p50_ms"], b["itl_p50_ms"]) if b else None,
                    "itl_p99": _div(r["itl_p99_ms"], b["itl_p99_ms"]) if b else None})
    return out


# -------------------------------------------------------------------------------- writing
def write(out: pathlib.Path, name: str, header: dict, rows: list[dict]) -> list:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"header": header, "rows": rows}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(markdown(doc))
    (out / "partial-saturation.json").unlink(missing_ok=True)
    png = plot(out / f"{name}.png", header, rows)
    return [out / f"{name}.json", out / f"{name}.md"] + ([png] if png else [])


def _f(x, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _load(r: dict) -> str:
    if r["mode"] == "closed":
        return f"{r.get('streams')} streams"
    if r["mode"] == "open":
        return f"{r['offered_req_s']:.2f} req/s ({r['frac_of_base_goodput']:.0%} of base goodput)"
    bound = f", bound: {r['bound']}" if r.get("bound") else ""
    return f"{_f(r.get('goodput_req_s'), '{:.2f}')} req/s{bound}"


def table(rows: list[dict], ratio: list[dict] | None) -> list[str]:
    lines = ["| scenario | mode | state | adapters | ranks | load | req/s | out tok/s | "
             "throughput vs base | TTFT p50 / p99 ms | ITL p50 / p99 ms | ITL vs base p50 / "
             "p99 | GPU hit | cold p50 ms | pool holds |", "|" + "---|" * 15]
    for i, r in enumerate(rows):
        q = ratio[i] if ratio else {}
        vs = "n/a (mixed runs)" if ratio is None else _f(q.get("throughput"), "{:.1%}")
        itl_vs = "n/a" if ratio is None else (f"{_f(q.get('itl_p50'), '{:.2f}x')} / "
                                               f"{_f(q.get('itl_p99'), '{:.2f}x')}")
        ranks = "/".join(str(x) for x in r["ranks"]) or "-"
        lines.append(
            f"| {r['scenario']} | {r['mode']} | {r['state']} | {r['adapters'] or 'base'} | "
            f"{ranks} | {_load(r)} | {_f(r['req_s'], '{:.2f}')} | {_f(r['out_tok_s'], '{:.0f}')}"
            f" | {vs} | {_f(r['ttft_p50_ms'])} / {_f(r['ttft_p99_ms'])} | "
            f"{_f(r['itl_p50_ms'], '{:.2f}')} / {_f(r['itl_p99_ms'], '{:.2f}')} | {itl_vs} | "
            f"{_f(r['gpu_hit_rate'], '{:.2f}')} | {_f(r['cold_p50_ms'])} | "
            f"{_f(r.get('pool_frac'), '{:.0%}')} |")
    return lines


def probes_table(rows: list[dict]) -> list[str]:
    lines = ["", "Goodput probes (open loop, Poisson; in the order run):", "",
             "| workload | # | offered | arrivals | achieved | ratio | TTFT p99 ms | TTFT rise / "
             "limit ms | ITL p99 ms | errors | verdict |", "|" + "---|" * 11]
    for r in rows:
        for i, p in enumerate(r.get("probes") or [], 1):
            lines.append(
                f"| {r['workload']} | {i} | {p['rate']:.2f} | {_f(p['arrival_req_s'], '{:.2f}')}"
                f" | {_f(p['req_s'], '{:.2f}')} | {_f(p['ratio'], '{:.3f}')} | "
                f"{_f(p['ttft_p99_ms'])} | {_f(p['ttft_rise_ms'])} / {_f(p['rise_limit_ms'])} "
                f"| {_f(p['itl_p99_ms'], '{:.2f}')} | {p['errors']} | "
                f"{'pass' if p['pass'] else 'fail: ' + '; '.join(p['why'])} |")
    return lines if len(lines) > 4 else []


def markdown(doc: dict) -> str:
    h, rows = doc["header"], doc["rows"]
    try:
        ratio = ratios(rows)
        runs = f"All rows from run `{check_one_run(rows)}`; ratios are to the base model's row "
        runs += "of the same run, mode and load."
    except MixedRuns as exc:
        ratio, runs = None, f"**This table mixes runs**: {exc}."
    c = h.get("criteria", {})
    m = h.get("model", {})
    lines = [f"# Saturation, {h['card']}, {h['date']}", "",
             f"Commit {h['commit']}; " + ", ".join(f"{k} {v}" for k, v in h["versions"].items())
             + f". Model {m.get('shape') or m.get('path')}. {runs}", "",
             f"Goodput: the highest Poisson rate with achieved >= {c.get('min_ratio')} x the "
             "arrival rate (achieved: the arrivals over 1 + the growth of latency, from each "
             "request's scheduled arrival, over the probe's second half, times the share that "
             "completed), TTFT not rising over the second half, TTFT p99 <= "
             f"{h.get('slo', {}).get('ttft_p99_ms')} ms, ITL p99 <= "
             f"{h.get('slo', {}).get('itl_p99_ms')} ms, no errors. Open rows' req/s: the same "
             "achieved rate; closed rows': the completion rate fitted over the middle 80% of "
             "completions; tok/s: req/s x the mean output. 'pool holds': the share of the "
             "workload's adapter bytes the GPU pool can hold.", "",
             *table(rows, ratio), *probes_table(rows)]
    lines += steps_tables(rows) if ratio is not None else []
    if h.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(h["skipped"]) + "."]
    if h.get("failed"):
        lines += ["", "**Failed**: " + "; ".join(h["failed"]) + "."]
    return "\n".join(lines) + "\n"


def steps_tables(rows: list[dict], top: int = 8) -> list[str]:
    """The Steps section: per workload, its step profile's largest classes (serve_steps.table),
    an adapter workload's beside the base model's same class."""
    profiles = serve_steps.by_workload(rows)
    if not profiles:
        return []
    lines = ["", "## Steps", "", "The worker's engine steps over each workload's steady closed "
             "loops and goodput search, by class (kind; rows: the step's sequences; prompt "
             "tokens: of its prompt chunks; adapters: distinct). A step's time runs from the "
             "previous step's tokens reaching the host to its own (steps after an idle wait "
             "are not timed); share: of the workload's timed step time; vs base: mean ms over "
             "the base model's steps of the same kind, rows and prompt tokens in this run."]
    for w, p in profiles.items():
        lines += ["", f"{w}: {p['steps']} steps, {p['seconds']:.1f} s timed", "",
                  *serve_steps.table(p, top, compare=w != "base" and "base" in profiles)]
    return lines


def plot(path: pathlib.Path, header: dict, rows: list[dict]) -> pathlib.Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    good = [r for r in rows if r["mode"] == "goodput" and r.get("goodput_req_s")]
    if not good:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for kind, mark in (("zipf", "-o"), ("resident", "s"), ("mixed", "^")):
        rs = sorted((r for r in good if r["adapters"] == 0 or r["workload"].startswith(kind)),
                    key=lambda r: r["adapters"])
        if len(rs) > 1 or any(r["adapters"] for r in rs):
            xs = [r["adapters"] for r in rs]
            ax1.plot(xs, [r["goodput_req_s"] for r in rs], mark, label=kind)
    top = max((x.get("frac_of_base_goodput") or 0 for x in rows), default=0)
    for mode, state in (("goodput", "at goodput"), ("open", f"open loop, {top:.0%} of base")):
        rs = sorted((r for r in rows if r["mode"] == mode and r["itl_p50_ms"] is not None and
                     (mode == "goodput" or r.get("frac_of_base_goodput") == top)),
                    key=lambda r: r["adapters"])
        if rs:
            xs = [r["adapters"] for r in rs]
            ax2.plot(xs, [r["itl_p50_ms"] for r in rs], "o", label=f"p50, {state}")
            ax2.plot(xs, [r["itl_p99_ms"] for r in rs], "^", label=f"p99, {state}")
    for ax, what in ((ax1, "goodput req/s"), (ax2, "ITL ms")):
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlabel("adapters (0 = base model)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Saturation, {header['card']}, run {header.get('run')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------ CLI
def merge(docs: list[dict]) -> dict:
    """Several runs' rows in one document (each row keeps its run id); no ratios."""
    header = dict(docs[0]["header"])
    header["runs"] = [d["header"].get("run") for d in docs]
    header.pop("steps", None)                      # one run's: no profile across runs
    return {"header": header, "rows": [r for d in docs for r in d["rows"]]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", help="saturation results NAME.json")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--check", action="store_true", help="exit 1 if the rows span several runs")
    g.add_argument("--ratios", action="store_true", help="print each row's ratios to base")
    g.add_argument("--merge", action="store_true", help="one table of several runs (no ratios)")
    g.add_argument("--replot", action="store_true", help="rewrite NAME.md and NAME.png")
    p.add_argument("--out")
    p.add_argument("--name")
    a = p.parse_args(argv)
    docs = [json.loads(pathlib.Path(x).read_text()) for x in a.inputs]
    doc = merge(docs) if len(docs) > 1 else docs[0]
    try:
        if a.check:
            print(f"one run: {check_one_run(doc['rows'])}")
        elif a.ratios:
            print(json.dumps(ratios(doc["rows"]), indent=1))
    except MixedRuns as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 1
    if a.merge or a.replot:
        out = pathlib.Path(a.out or pathlib.Path(a.inputs[0]).parent)
        name = a.name or pathlib.Path(a.inputs[0]).stem
        if a.merge and not (a.out and a.name):
            p.error("--merge needs --out and --name")
        for f in write(out, name, doc["header"], doc["rows"]):
            print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
