"""The serving benchmark's figures: from the client records of one scenario (throughput, TTFT,
ITL, end-to-end latency, errors) and from the services' counters before and after it (the
worker's cache hit rates and cold-load records stage by stage, the store's host tier).

Plain Python (no torch); records are the dicts bench/serve/load.py returns, times in wall-clock
seconds; figures are in ms.
"""
from __future__ import annotations

import bisect
import collections

from services.common.gen.lorafleet.v1 import common_pb2

COLD_TIERS = ("source", "store_host", "worker_host")
STAGES = ("fetch_s", "digest_s", "layout_s", "room_wait_s", "host_to_device_s", "copy_wait_s",
          "launch_s", "device_s", "handoff_s", "source_s")


def pct(xs, q: float) -> float | None:
    """Nearest-rank percentile (as the router's stats); None for no values."""
    s = sorted(xs)
    if not s:
        return None
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return float(s[k])


def ms(x: float | None) -> float | None:
    return None if x is None else round(1e3 * x, 3)


def gaps(rec: dict) -> list[tuple[float, float]]:
    """(previous token's arrival, this token's) for every token after the first."""
    t = rec["times"]
    return list(zip(t, t[1:]))


def client_figures(records: list[dict]) -> dict:
    """Throughput over all measured requests; latencies over the main (not cold) stream."""
    ok = [r for r in records if r["status"] == "OK"]
    main = [r for r in ok if not r["cold"] and not r.get("burst") and r["times"]]
    errors = collections.Counter(r["status"] for r in records if r["status"] != "OK")
    span = (max(r["end"] for r in records) - min(r["send"] for r in records)) if records else 0
    ttft = [r["times"][0] - r["send"] for r in main]
    itl = [b - a for r in main for a, b in gaps(r)]
    e2e = [r["end"] - r["send"] for r in main]
    tokens = sum(r["tokens"] for r in ok)
    return {"requests": len(records), "ok": len(ok), "errors": dict(errors),
            "error_examples": sorted({r["error"] for r in records if r["error"]})[:3],
            "tokens": tokens, "span_s": round(span, 3),
            "out_tok_s": round(tokens / span, 2) if span > 0 else 0.0,
            "req_s": round(len(ok) / span, 3) if span > 0 else 0.0,
            "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p90_ms": ms(pct(ttft, 90)),
            "ttft_p99_ms": ms(pct(ttft, 99)), "itl_p50_ms": ms(pct(itl, 50)),
            "itl_p99_ms": ms(pct(itl, 99)), "e2e_p50_ms": ms(pct(e2e, 50)),
            "e2e_p99_ms": ms(pct(e2e, 99)), "_ttft": ttft, "_itl": itl}


def cold_stream_figures(records: list[dict]) -> dict | None:
    cold = [r for r in records if r["cold"]]
    if not cold:
        return None
    ok = [r for r in cold if r["status"] == "OK" and r["times"]]
    loads = [r["timings"]["cold_load_s"] for r in ok if r["timings"]]
    ttft = [r["times"][0] - r["send"] for r in ok]
    return {"requests": len(cold), "ok": len(ok),
            "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p99_ms": ms(pct(ttft, 99)),
            "cold_load_p50_ms": ms(pct(loads, 50)), "cold_load_p99_ms": ms(pct(loads, 99))}


# ------------------------------------------------------------------------ service counters
def _rate(hits: int, misses: int) -> float | None:
    return round(hits / (hits + misses), 4) if hits + misses else None


def hit_rates(w0, w1, s0, s1) -> dict:
    """Hit rates over a scenario from WorkerInfoResponse / StoreStatsResponse before and after."""
    def counts(info):
        return {c.tier: (c.hits, c.misses) for c in info.cache}
    a, b = counts(w0), counts(w1)
    out = {}
    for tier in ("gpu", "worker_host"):
        (h0, m0), (h1, m1) = a.get(tier, (0, 0)), b.get(tier, (0, 0))
        out[f"{tier}_hit_rate"] = _rate(h1 - h0, m1 - m0)
    out["store_host_hit_rate"] = _rate(s1.host_hits - s0.host_hits,
                                       s1.host_misses - s0.host_misses)
    return out


def tier_name(tier: int) -> str:
    return common_pb2.Tier.Name(tier).lower()


def histogram_delta(w0, w1) -> dict[str, list[float]]:
    """tier -> the cold-load seconds the worker's bounded histograms gained over the scenario
    (the newest samples: a fallback for a worker that returns no cold-load records)."""
    before = {h.tier.lower(): h.count for h in w0.cold_loads}
    out = {}
    for h in w1.cold_loads:
        n = h.count - before.get(h.tier.lower(), 0)
        if n > 0 and h.tier.lower() in COLD_TIERS:
            out[h.tier.lower()] = list(h.samples)[-n:]
    return out


def cold_by_tier(records_pb, hist: dict[str, list[float]], requests: list[dict]) -> dict:
    """tier -> {n, p50_ms, p99_ms, from, stages, first_step_p50_ms, req_cold_*}. The worker's
    records when it sent any, else its histograms; per request, the final timings."""
    by: dict[str, list] = collections.defaultdict(list)
    for rec in records_pb:
        by[tier_name(rec.tier)].append(rec)
    source = "worker_records" if records_pb else "worker_histogram"
    totals = ({t: [r.total_s for r in v] for t, v in by.items()} if records_pb else hist)
    out = {}
    for tier in COLD_TIERS:
        xs = totals.get(tier) or []
        reqs = [r for r in requests if r["timings"] and r["timings"]["adapter_tier"] == tier
                and r["timings"]["cold_load_s"] > 0]
        if not xs and not reqs:
            continue
        loads = [r["timings"]["cold_load_s"] for r in reqs]
        first = [r["timings"]["time_to_first_token_s"] - r["timings"]["cold_load_s"]
                 for r in reqs]
        out[tier] = {"n": len(xs) if xs else len(reqs), "from": source if xs else "requests",
                     "p50_ms": ms(pct(xs or loads, 50)), "p99_ms": ms(pct(xs or loads, 99)),
                     "stages": stage_figures(by.get(tier, [])),
                     "first_step_p50_ms": ms(pct(first, 50)),
                     "req_cold_p50_ms": ms(pct(loads, 50)), "req_cold_p99_ms": ms(pct(loads, 99))}
    return out


def stage_figures(recs) -> dict | None:
    """stage -> {p50_ms, p99_ms} over worker cold-load records (None for none)."""
    if not recs:
        return None
    return {st: {"p50_ms": ms(pct([getattr(r, st) for r in recs], 50)),
                 "p99_ms": ms(pct([getattr(r, st) for r in recs], 99))} for st in STAGES}


# -------------------------------------------------------------- ITL while cold loads run
def cold_windows(records_pb, requests: list[dict]) -> tuple[list[tuple[float, float]], str]:
    """Wall-clock intervals during which a cold load ran, merged: from the worker's records
    (end_unix_s - total_s .. end_unix_s), else estimated from requests' timings (the worker
    received the request about total_s before the client's end; the load came first)."""
    if records_pb:
        spans, source = [(r.end_unix_s - r.total_s, r.end_unix_s) for r in records_pb], "worker"
    else:
        spans = [(r["end"] - r["timings"]["total_s"],
                  r["end"] - r["timings"]["total_s"] + r["timings"]["cold_load_s"])
                 for r in requests if r["timings"] and r["timings"]["cold_load_s"] > 0
                 and r["timings"]["adapter_tier"] in COLD_TIERS]
        source = "request_timings"
    return merge_spans(spans), source


def merge_spans(spans) -> list[tuple[float, float]]:
    """(start, end) intervals, sorted and merged where they overlap."""
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def burst_figures(requests: list[dict]) -> dict:
    """A prefill burst: its requests' TTFT, and the other requests' inter-token gaps while it
    is taken in (from its first send to its last first token) against those outside."""
    burst = [r for r in requests if r.get("burst")]
    ok = [r for r in burst if r["status"] == "OK" and r["times"]]
    if not ok:
        return {"burst_requests": len(burst), "burst_ok": 0}
    lo, hi = min(r["send"] for r in burst), max(r["times"][0] for r in ok)
    inside, outside = [], []
    for r in requests:
        if r["cold"] or r.get("burst") or r["status"] != "OK":
            continue
        for a, b in gaps(r):
            (inside if a < hi and b > lo else outside).append(b - a)
    return {"burst_requests": len(burst), "burst_ok": len(ok),
            "burst_window_ms": ms(hi - lo),
            "burst_ttft_p50_ms": ms(pct([r["times"][0] - r["send"] for r in ok], 50)),
            "burst_ttft_p99_ms": ms(pct([r["times"][0] - r["send"] for r in ok], 99)),
            "itl_p50_burst_ms": ms(pct(inside, 50)), "itl_p99_burst_ms": ms(pct(inside, 99)),
            "itl_p50_outside_burst_ms": ms(pct(outside, 50)),
            "gaps_in_burst": len(inside)}


def itl_split(requests: list[dict], windows: list[tuple[float, float]]) -> dict:
    """ITL p99 of the main stream's gaps that overlap a cold-load window, and of the rest."""
    starts = [a for a, _ in windows]
    inside, outside = [], []
    for r in requests:
        if r["cold"] or r["status"] != "OK":
            continue
        for a, b in gaps(r):
            k = bisect.bisect_left(starts, b) - 1       # the last window starting before b
            (inside if k >= 0 and windows[k][1] > a else outside).append(b - a)
    return {"itl_p99_cold_ms": ms(pct(inside, 99)), "itl_p99_outside_ms": ms(pct(outside, 99)),
            "gaps_in_cold_windows": len(inside)}
