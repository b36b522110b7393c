"""The serving benchmark's results: the header (bench.lib.header's base plus model, adapters,
service command lines), one row per scenario and cold-load source tier, and
NAME.json, NAME.md and the plots (NAME.png, NAME-cdf.png) under --out. A gRPC scenario's rows
keep the workers' step profile over it ("steps": bench/serve/steps.py's keys), and NAME.md has
its largest step classes."""
from __future__ import annotations

import json
import pathlib

ROW_FIELDS = ("scenario", "adapters", "zipf", "rate", "concurrency", "out_tok_s", "ttft_p50_ms",
              "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "gpu_hit_rate", "cold_p50_ms",
              "cold_p99_ms", "cold_tier")


# ----------------------------------------------------------------------------------- rows
def scenario_rows(s, figures: dict, hits: dict, tiers: dict, extra: dict) -> list[dict]:
    """One row per cold-load source tier seen (cold_tier null and no cold figures when none)."""
    base = {"scenario": s.name, "path": s.path, "adapters": s.adapters,
            "rank": s.rank if s.adapters else None, "zipf": s.zipf if s.adapters else None,
            "rate": s.rate, "rate_frac": s.rate_frac, "concurrency": s.concurrency,
            "preload": s.preload,
            "cold_stream_rate": s.cold or None,
            "cold_arrival": s.cold_arrival if s.cold_requests else None,
            "cold_adapters": s.cold_adapters if s.cold_requests else None,
            **{k: v for k, v in figures.items() if not k.startswith("_")}, **hits, **extra}
    if not tiers:
        return [{**base, "cold_tier": None, "cold_n": 0, "cold_p50_ms": None,
                 "cold_p99_ms": None}]
    rows = []
    for tier, t in tiers.items():
        rows.append({**base, "cold_tier": tier, "cold_n": t["n"], "cold_p50_ms": t["p50_ms"],
                     "cold_p99_ms": t["p99_ms"], "cold_from": t["from"], "stages": t["stages"],
                     "first_step_p50_ms": t["first_step_p50_ms"],
                     "req_cold_p50_ms": t["req_cold_p50_ms"],
                     "req_cold_p99_ms": t["req_cold_p99_ms"]})
    return rows


# -------------------------------------------------------------------------------- writing
def quantiles(xs: list[float], n: int = 200) -> list[float]:
    """n + 1 evenly spaced quantiles of xs (what the JSON keeps of a CDF)."""
    xs = sorted(xs)
    return [xs[round(i * (len(xs) - 1) / n)] for i in range(n + 1)] if xs else []


def write(out: pathlib.Path, name: str, header: dict, rows: list[dict], cdfs: dict) -> list:
    """NAME.json (header, rows and each scenario's TTFT / ITL quantiles), NAME.md, and the
    plots where matplotlib imports (else `--replot NAME.json` draws them later)."""
    out.mkdir(parents=True, exist_ok=True)
    kept = {k: {m: quantiles(v) for m, v in d.items()} for k, d in cdfs.items()}
    (out / f"{name}.json").write_text(json.dumps({"header": header, "rows": rows,
                                                  "cdfs": kept}, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(header, rows))
    return [out / f"{name}.json", out / f"{name}.md"] + plots(out, name, header, rows, kept)


def plots(out: pathlib.Path, name: str, header: dict, rows: list[dict], cdfs: dict) -> list:
    try:
        import matplotlib
        matplotlib.use("Agg")
    except ImportError:
        return []
    from bench.serve.plots import plot_cdfs, plot_scaling
    ordered = {r["scenario"]: cdfs[r["scenario"]] for r in rows if r["scenario"] in cdfs}
    return [p for p in (plot_scaling(out / f"{name}.png", header, rows),
                        plot_cdfs(out / f"{name}-cdf.png", header, ordered)) if p]


def _f(x, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _load(r: dict) -> str:
    if r["rate"] is None:
        return f"conc {r['concurrency']}"
    frac = f" ({r['rate_frac']:.0%} sat)" if r.get("rate_frac") else ""
    return f"rate {r['rate']:g}{frac}"


def markdown(header: dict, rows: list[dict]) -> str:
    m = header.get("model", {})
    ad = header.get("adapters", {})
    fleet = header.get("workers")
    lines = [f"# Serving benchmark, {header['card']}, {header['date']}", "",
             *([f"{fleet['count']} workers behind the router: {fleet['layout']}.", ""]
               if fleet else []),
             f"Commit {header['commit']}; " + ", ".join(f"{k} {v}" for k, v in
                                                     header["versions"].items()) + ".",
             f"Model {m.get('shape') or m.get('path')} ({m.get('layers')} layers, hidden "
             f"{m.get('hidden')}, vocab {m.get('vocab')}); adapters "
             + ", ".join(f"{g['count']}x rank {g['rank']}" for g in ad.get("groups", []))
             + f" on {','.join(ad.get('targets', []))} ({ad.get('dtype')}, source "
             f"{ad.get('source')}); {header.get('clients')} client process(es). Requests through "
             "the router's GenerateStream (path grpc) or the engine in-process (path engine).",
             "", "| scenario | path | adapters | zipf | load | req/s | out tok/s | TTFT p50 / p99 "
             "ms | ITL p50 / p99 ms | e2e p50 / p99 ms | gpu hit | cold tier | cold n | cold p50 "
             "/ p99 ms | errors |", "|" + "---|" * 15]
    for r in rows:
        lines.append(
            f"| {r['scenario']} | {r['path']} | {r['adapters'] or 'base'} | {_f(r['zipf'], '{:g}')}"
            f" | {_load(r)} | {_f(r.get('req_s'), '{:.2f}')} | {_f(r['out_tok_s'], '{:.0f}')} | "
            f"{_f(r['ttft_p50_ms'])} / {_f(r['ttft_p99_ms'])} | {_f(r['itl_p50_ms'], '{:.2f}')} "
            f"/ {_f(r['itl_p99_ms'], '{:.2f}')} | {_f(r.get('e2e_p50_ms'))} / "
            f"{_f(r.get('e2e_p99_ms'))} | {_f(r['gpu_hit_rate'], '{:.2f}')} | "
            f"{r['cold_tier'] or '-'} | {r.get('cold_n') or '-'} | {_f(r['cold_p50_ms'], '{:.2f}')}"
            f" / {_f(r['cold_p99_ms'], '{:.2f}')} | {_errors(r)} |")
    return "\n".join(lines + _cold_tables(rows) + _steps_tables(rows) + _notes(header, rows)
                     ) + "\n"


def _steps_tables(rows: list[dict], top: int = 6) -> list[str]:
    """Per gRPC scenario, the largest classes of the worker's steps over it."""
    from bench.serve.steps import table
    seen, lines = set(), []
    for r in rows:
        p = r.get("steps")
        if p and p["steps"] and r["scenario"] not in seen:
            seen.add(r["scenario"])
            lines += ["", f"{r['scenario']}: {p['steps']} steps, {p['seconds']:.1f} s timed",
                      "", *table(p, top)]
    if not lines:
        return []
    return ["", "Engine steps by class (kind; rows: sequences; prompt tokens: of prompt chunks; "
            "adapters: distinct), the worker's over each scenario; a step's time runs from the "
            "previous step's tokens to its own, steps after an idle wait not timed:", *lines]


def _errors(r: dict) -> str:
    errs = r.get("errors") or {}
    return ", ".join(f"{k} {v}" for k, v in errs.items()) or "0"


def _cold_tables(rows: list[dict]) -> list[str]:
    cold = [r for r in rows if r["cold_tier"]]
    if not cold:
        return []
    from bench.serve.metrics import STAGES
    lines = ["", "Cold loads by source tier (p50 / p99 ms; stages from the worker's records, "
             "'-' where it sent none; first step = TTFT - cold load of the requests that had "
             "one):", "", "| scenario | tier | n | from | total | " + " | ".join(
                 s[:-2] for s in STAGES) + " | request cold load | first step p50 |",
             "|" + "---|" * (7 + len(STAGES))]
    for r in cold:
        st = r.get("stages") or {}
        cells = [f"{_f(st[s]['p50_ms'], '{:.2f}')} / {_f(st[s]['p99_ms'], '{:.2f}')}"
                 if s in st else "-" for s in STAGES]
        lines.append(f"| {r['scenario']} | {r['cold_tier']} | {r['cold_n']} | "
                     f"{r.get('cold_from', '-')} | {_f(r['cold_p50_ms'], '{:.2f}')} / "
                     f"{_f(r['cold_p99_ms'], '{:.2f}')} | " + " | ".join(cells) +
                     f" | {_f(r.get('req_cold_p50_ms'), '{:.2f}')} / "
                     f"{_f(r.get('req_cold_p99_ms'), '{:.2f}')} | "
                     f"{_f(r.get('first_step_p50_ms'), '{:.2f}')} |")
    return lines


def _notes(header: dict, rows: list[dict]) -> list[str]:
    lines = []
    seen = set()
    for r in rows:
        if r.get("cold_stream") and r["scenario"] not in seen:
            seen.add(r["scenario"])
            how = (f"at {r['cold_stream_rate']:g} req/s" if r.get("cold_arrival", "poisson")
                   == "poisson" else {"burst": "arriving at once",
                                      "chain": "one at a time"}[r["cold_arrival"]])
            lines.append(f"- {r['scenario']}: a cold stream {how} "
                         f"({r['cold_stream']['requests']} requests on {r['cold_adapters']} adapters sent "
                         "before the main stream ended); ITL p99 "
                         f"of the other requests' gaps inside cold-load windows "
                         f"{_f(r.get('itl_p99_cold_ms'), '{:.2f}')} ms "
                         f"({r.get('gaps_in_cold_windows', 0)} gaps; windows from "
                         f"{r.get('cold_windows_from')}), outside them "
                         f"{_f(r.get('itl_p99_outside_ms'), '{:.2f}')} ms, without the cold "
                         f"stream ({r.get('nocold_twin') or 'no twin run'}) "
                         f"{_f(r.get('itl_p99_nocold_ms'), '{:.2f}')} ms.")
        if r.get("burst_requests") and r["scenario"] not in seen:
            seen.add(r["scenario"])
            lines.append(f"- {r['scenario']}: {r['burst_requests']} requests arriving at once "
                         f"({r['burst_ok']} OK) during the steady stream: their TTFT p50 / p99 "
                         f"{_f(r.get('burst_ttft_p50_ms'))} / {_f(r.get('burst_ttft_p99_ms'))} "
                         f"ms; the other requests' ITL p50 / p99 while the burst was taken in "
                         f"({_f(r.get('burst_window_ms'))} ms, {r.get('gaps_in_burst', 0)} gaps) "
                         f"{_f(r.get('itl_p50_burst_ms'), '{:.2f}')} / "
                         f"{_f(r.get('itl_p99_burst_ms'), '{:.2f}')} ms, p50 outside it "
                         f"{_f(r.get('itl_p50_outside_burst_ms'), '{:.2f}')} ms.")
        if r.get("engine_vs") and r["scenario"] not in seen:
            seen.add(r["scenario"])
            lines.append(f"- {r['scenario']}: the engine in-process on the same workload: "
                         f"{r['out_tok_s']:.0f} tok/s against {r['engine_vs']['out_tok_s']:.0f} "
                         f"through the services ({r['engine_vs']['scenario']}).")
    lines += _fleet_notes(rows)
    if header.get("probe"):
        p = header["probe"]
        lines.append(f"- rate auto: a closed-loop probe at concurrency {p['concurrency']} on the "
                     f"base model served {p['req_s']:.2f} req/s; open-loop scenarios ran at "
                     f"{p['rate']:.2f} req/s (90%).")
    return ["", *lines] if lines else []


def _fleet_notes(rows: list[dict]) -> list[str]:
    """With several workers: each worker's share, hit rate and working set per scenario, the
    adapters resident on more than one, and a kill-and-restart's outcome."""
    lines, seen = [], set()
    for r in rows:
        if not r.get("per_worker") or r["scenario"] in seen:
            continue
        seen.add(r["scenario"])
        parts = [f"worker {w['worker']}: {w['gpu_lookups']} GPU lookups, hit "
                 f"{_f(w['gpu_hit_rate'], '{:.2f}')}, {w['resident']} resident "
                 f"({_f(w['resident_frac'], '{:.0%}')} of the union)" for w in r["per_worker"]]
        mr = r.get("multi_resident") or {}
        lines.append(f"- {r['scenario']} ({r['workers']} workers): " + "; ".join(parts)
                     + f"; on more than one GPU at the end: {mr.get('count', 0)} of "
                     f"{mr.get('union', 0)} resident adapters ("
                     f"{_f(mr.get('request_share'), '{:.0%}')} of the requests).")
        k = r.get("killed")
        if k:
            ev = k["events_s"]
            lines.append(
                f"- {r['scenario']}: worker {k['worker']} SIGKILLed at "
                f"{_f(ev.get('killed'), '{:.2f}')} s ({k['in_flight_at_kill']} requests in "
                f"flight over both workers), SERVING again at "
                f"{_f(ev.get('serving'), '{:.2f}')} s, live in the "
                f"router at {_f(ev.get('router_sees'), '{:.2f}')} s, its first request at "
                f"{_f(ev.get('first_request'), '{:.2f}')} s; of {k['requests']} requests "
                f"{k['ok']} OK, failed after streaming tokens "
                f"{sum(k['failed_after_tokens'].values())} ({_codes(k['failed_after_tokens'])}), "
                f"failed before any token {k['failed_before_token_n']} (the router retried "
                f"{k.get('retried_before_token', 0)} attempts elsewhere), duplicated "
                f"{k['duplicated']}; the restarted worker took {k['served_by_restarted']} "
                "adapter requests (GPU lookups) after its restart.")
    return lines


def _codes(c: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in c.items()) or "-"
