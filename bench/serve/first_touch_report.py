"""The first-touch benchmark's figures and files (bench/serve/first_touch.py runs it): its rows
from one phase's client records (bench/serve/load.py) and the worker's cold-load records over
it, the part files combined into one document, and the markdown with issue 43's targets.

Plain Python (no torch); figures in ms. A row:
{"scenario", "adapters_at_once", "background", "ttft_p50_ms", "ttft_p99_ms", "cold_p50_ms",
"cold_p99_ms", "others_itl_p99_ms", "stages", ...}: the TTFT of the requests that touch an
adapter first, the worker's cold loads of those adapters (stage by stage), and the ITL p99 of
the other streams' gaps that overlap those requests' waits for their first token.
"""
from __future__ import annotations

import collections

from bench.serve import metrics as sm

ROW_FIELDS = ("scenario", "adapters_at_once", "background", "ttft_p50_ms", "ttft_p99_ms",
              "cold_p50_ms", "cold_p99_ms", "others_itl_p99_ms", "stages")
START_FIELDS = ("cold_start_s", "warm_start_s", "first_run_tok_s", "second_run_tok_s")
PARTS = ("burst", "one", "churn", "start")


# ------------------------------------------------------------------------------------- rows
def _ttft(recs: list[dict]) -> list[float]:
    return [r["times"][0] - r["send"] for r in recs if r["status"] == "OK" and r["times"]]


def _cold_figures(loads) -> dict:
    """The worker's cold-load records of a row's adapters: totals, stages, tiers."""
    totals = [x.total_s for x in loads]
    return {"cold_p50_ms": sm.ms(sm.pct(totals, 50)), "cold_p99_ms": sm.ms(sm.pct(totals, 99)),
            "stages": sm.stage_figures(loads) or {}, "cold_loads": len(loads),
            "cold_tiers": dict(collections.Counter(sm.tier_name(x.tier) for x in loads))}


def background_row(name: str, records: list[dict], streams: int, serve_row: dict) -> dict:
    """The base streams alone: their own TTFT and ITL."""
    fig = sm.client_figures(records)
    return {"scenario": name, "adapters_at_once": 0, "background": f"{streams} base streams",
            "ttft_p50_ms": fig["ttft_p50_ms"], "ttft_p99_ms": fig["ttft_p99_ms"],
            "cold_p50_ms": None, "cold_p99_ms": None, "others_itl_p99_ms": fig["itl_p99_ms"],
            "stages": {}, "itl_p50_ms": fig["itl_p50_ms"], "out_tok_s": fig["out_tok_s"],
            "requests": fig["requests"], "errors": fig["errors"],
            "gpu_hit_rate": serve_row.get("gpu_hit_rate")}


def first_use_row(name: str, at_once: int, records: list[dict], loads, ids: list[str],
                  streams: int, serve_row: dict) -> dict:
    """Never-used adapters (the phase's cold requests, `ids`) beside the base streams: their
    TTFT, their cold loads, the base streams' ITL p99 while they waited for a first token (and
    outside those waits), and the base streams' own TTFT in the same phase."""
    cold = [r for r in records if r["cold"]]
    ok = [r for r in cold if r["status"] == "OK" and r["times"]]
    ttft = _ttft(cold)
    mine = [x for x in loads if x.adapter_id in set(ids)]
    waits = sm.merge_spans([(r["send"], r["times"][0]) for r in ok])
    split = sm.itl_split(records, waits)
    base = sm.client_figures(records)
    return {"scenario": name, "adapters_at_once": at_once,
            "background": f"{streams} base streams", "ttft_p50_ms": sm.ms(sm.pct(ttft, 50)),
            "ttft_p99_ms": sm.ms(sm.pct(ttft, 99)), **_cold_figures(mine),
            "others_itl_p99_ms": split["itl_p99_cold_ms"],
            "others_itl_p99_outside_ms": split["itl_p99_outside_ms"],
            "others_gaps": split["gaps_in_cold_windows"], "wait_windows": len(waits),
            "adapters": len(ids),
            "requests": len(cold), "ok": len(ok),
            "cold_adapters_loaded": len({x.adapter_id for x in mine}),
            "base_ttft_p50_ms": base["ttft_p50_ms"], "base_ttft_p99_ms": base["ttft_p99_ms"],
            "base_itl_p99_ms": base["itl_p99_ms"], "errors": base["errors"],
            "window_ms": sm.ms(waits[-1][1] - waits[0][0]) if waits else None,
            "gpu_hit_rate": serve_row.get("gpu_hit_rate")}


def churn_row(name: str, s, records: list[dict], loads, serve_row: dict) -> dict:
    """Zipf churn over many adapters: every request's TTFT, the loads from the store's source
    (not its or the worker's host tier), and the streams' ITL p99 while those ran."""
    fig = sm.client_figures(records)
    source = [x for x in loads if sm.tier_name(x.tier) == "source"]
    windows, _ = sm.cold_windows(source, [])
    split = sm.itl_split(records, windows)
    tiers = sm.cold_by_tier(loads, {}, records)
    return {"scenario": name, "adapters_at_once": s.concurrency,
            "background": f"none: {s.concurrency} streams over {s.adapters} rank-{s.rank} "
                          f"adapters, Zipf {s.zipf:g}",
            "ttft_p50_ms": fig["ttft_p50_ms"], "ttft_p99_ms": fig["ttft_p99_ms"],
            **_cold_figures(source), "others_itl_p99_ms": split["itl_p99_cold_ms"],
            "others_itl_p99_outside_ms": split["itl_p99_outside_ms"], "adapters": s.adapters,
            "zipf": s.zipf, "requests": fig["requests"], "errors": fig["errors"],
            "out_tok_s": fig["out_tok_s"], "gpu_hit_rate": serve_row.get("gpu_hit_rate"),
            "by_tier": {t: {k: v[k] for k in ("n", "p50_ms", "p99_ms")}
                        for t, v in tiers.items()}}


def start_rows(result: dict, first: str) -> list[dict]:
    """The start-up part's first and second runs (bench.stack.startup's rows) as rows: the
    first run's requests are its adapters' first uses, on a worker just started."""
    out = []
    for name, label, when in ((first, "first-run", "a worker just started"),
                              (f"{first}-again", "second-run", "the same worker after it")):
        rows = [r for r in result["rows"] if r["scenario"] == name]
        cold = max(rows, key=lambda r: r.get("cold_n") or 0)
        out.append({"scenario": label, "adapters_at_once": rows[0]["adapters"],
                    "background": f"none: {rows[0]['concurrency']} streams, {when}",
                    "ttft_p50_ms": rows[0]["ttft_p50_ms"], "ttft_p99_ms": rows[0]["ttft_p99_ms"],
                    "cold_p50_ms": cold["cold_p50_ms"], "cold_p99_ms": cold["cold_p99_ms"],
                    "others_itl_p99_ms": rows[0]["itl_p99_ms"],
                    "stages": cold.get("stages") or {}, "cold_tier": cold["cold_tier"],
                    "cold_loads": sum(r.get("cold_n") or 0 for r in rows),
                    "out_tok_s": rows[0]["out_tok_s"], "errors": rows[0]["errors"]})
    return out


def link(rows: list[dict]) -> None:
    """The burst row's ITL p99 against the background alone's, the same run."""
    alone = next((r for r in rows if r["scenario"] == "background"), None)
    for r in rows:
        if r["scenario"] in ("burst", "one-at-a-time") and alone and alone["others_itl_p99_ms"] \
                and r["others_itl_p99_ms"] is not None:
            r["others_itl_p99_alone_ms"] = alone["others_itl_p99_ms"]
            r["others_itl_p99_ratio"] = round(r["others_itl_p99_ms"] /
                                              alone["others_itl_p99_ms"], 3)


# ---------------------------------------------------------------------------------- merging
def merge(docs: list[dict]) -> dict:
    """Part documents ({"header", "parts", "rows"}, the start part's with "start") as one:
    rows in part order, the start figures at the top level, each part's header kept."""
    seen = [p for d in docs for p in d["parts"]]
    if len(seen) != len(set(seen)):
        raise SystemExit(f"--merge: a part is given twice: {seen}")
    cards = {d["header"]["card"] for d in docs}
    if len(cards) > 1:
        raise SystemExit(f"--merge: parts measured on different cards: {sorted(cards)}")
    order = sorted(docs, key=lambda d: min(PARTS.index(p) for p in d["parts"]))
    header = {k: v for k, v in order[0]["header"].items() if k != "parts"}
    header["parts"] = {"+".join(d["parts"]): d["header"] for d in order}
    header["commits"] = sorted({d["header"]["commit"] for d in order})
    start = next((d["start"] for d in order if "start" in d), {})
    rows = [r for d in order for r in d["rows"]]
    link(rows)
    return {"header": header, "rows": rows, **{k: start.get(k) for k in START_FIELDS}}


# --------------------------------------------------------------------------------- markdown
def _f(x, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(doc: dict) -> str:
    h = doc["header"]
    m = h.get("model", {})
    lines = [f"# First use of an adapter, and a fresh worker (issue 43), {h['card']}, "
             f"{h['date']}", "",
             f"Commit {', '.join(h.get('commits') or [h['commit']])}; model "
             f"{m.get('shape') or m.get('path')}; parts "
             f"{', '.join(h.get('parts', {})) or '-'}. Through the services as processes.", "",
             "| scenario | adapters at once | background | TTFT p50 / p99 ms | cold p50 / p99 ms "
             "| others' ITL p99 ms (x alone) | base TTFT p50 ms | errors |", "|" + "---|" * 8]
    for r in doc["rows"]:
        ratio = f" ({r['others_itl_p99_ratio']:.2f}x)" if r.get("others_itl_p99_ratio") else ""
        lines.append(f"| {r['scenario']} | {r['adapters_at_once']} | {r['background']} | "
                     f"{_f(r['ttft_p50_ms'])} / {_f(r['ttft_p99_ms'])} | "
                     f"{_f(r['cold_p50_ms'])} / {_f(r['cold_p99_ms'])} | "
                     f"{_f(r['others_itl_p99_ms'], '{:.2f}')}{ratio} | "
                     f"{_f(r.get('base_ttft_p50_ms'))} | {_errors(r)} |")
    return "\n".join(lines + _start(doc) + _stages(doc["rows"]) + _targets(doc)) + "\n"


def _errors(r: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in (r.get("errors") or {}).items()) or "0"


def _start(doc: dict) -> list[str]:
    if doc.get("cold_start_s") is None:
        return []
    first, second = doc["first_run_tok_s"], doc["second_run_tok_s"]
    return ["", "| start to SERVING, empty kernel cache | warm kernel cache | first / second "
            "run tok/s |", "|---|---|---|",
            f"| {doc['cold_start_s']} s | {doc['warm_start_s']} s | {first:.0f} / "
            f"{second:.0f} ({first / second:.0%}) |"]


def _stages(rows: list[dict]) -> list[str]:
    rows = [r for r in rows if r.get("stages")]
    if not rows:
        return []
    st = list(rows[0]["stages"])
    lines = ["", "Cold-load stages from the worker's records (p50 / p99 ms):", "",
             "| scenario | loads | tiers | " + " | ".join(s[:-2] for s in st) + " |",
             "|" + "---|" * (3 + len(st))]
    for r in rows:
        tiers = r.get("cold_tiers") or {r.get("cold_tier"): r.get("cold_loads")}
        cells = [f"{_f(r['stages'][s]['p50_ms'], '{:.2f}')} / "
                 f"{_f(r['stages'][s]['p99_ms'], '{:.2f}')}" for s in st]
        lines.append(f"| {r['scenario']} | {r.get('cold_loads', '-')} | "
                     + ", ".join(f"{k} {v}" for k, v in tiers.items()) + " | "
                     + " | ".join(cells) + " |")
    return lines


def _targets(doc: dict) -> list[str]:
    """Issue 43's "Done when", each against this run's figures (met / not met / not run)."""
    by = {r["scenario"]: r for r in doc["rows"]}
    burst, one, churn = by.get("burst", {}), by.get("one-at-a-time", {}), by.get("churn", {})
    first, second = doc.get("first_run_tok_s"), doc.get("second_run_tok_s")
    checks = [
        ("burst TTFT p50 <= 150 ms, p99 <= 300 ms", burst.get("ttft_p50_ms"),
         lambda: burst["ttft_p50_ms"] <= 150 and burst["ttft_p99_ms"] <= 300),
        ("burst: the base streams' ITL p99 <= 1.1x alone", burst.get("others_itl_p99_ratio"),
         lambda: burst["others_itl_p99_ratio"] <= 1.1),
        ("one at a time: TTFT p50 <= base TTFT p50 + 40 ms", one.get("ttft_p50_ms"),
         lambda: one["ttft_p50_ms"] <= one["base_ttft_p50_ms"] + 40),
        ("churn: source-tier cold p50 <= 50 ms, p99 <= 120 ms", churn.get("cold_p50_ms"),
         lambda: churn["cold_p50_ms"] <= 50 and churn["cold_p99_ms"] <= 120),
        ("first run >= 90% of the second's tok/s", first,
         lambda: first >= 0.9 * second),
        ("start to SERVING <= 120 s empty, <= 30 s warm", doc.get("cold_start_s"),
         lambda: doc["cold_start_s"] <= 120 and doc["warm_start_s"] <= 30)]
    out = ["", "Issue 43's targets (a CPU run only shows the bench works):", ""]
    for what, have, test in checks:
        try:
            verdict = "not run" if have is None else "met" if test() else "not met"
        except TypeError:                       # a figure the run did not get
            verdict = "no figure"
        out.append(f"- {what}: {verdict}")
    return out
