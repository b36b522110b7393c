"""The saturation suite's judgement of one open-loop probe and its goodput search.

A probe offers Poisson arrivals at a rate for a fixed time. It passes when the stack sustained
it: the achieved rate is at least `min_ratio` of the arrival rate (achieved: the arrival rate
over 1 + the growth of end-to-end latency, counted from the scheduled arrival, with arrival time
over the second half, times the share that completed), TTFT does not rise over
the probe's second half (no growing queue), the SLO holds (TTFT p99, ITL p99) and no request
failed. The goodput is the highest rate that passes, found by bracketing (up or down from a
start by `step` until one probe passes and one fails) and then bisecting (geometric mean),
within a bounded number of probes.

Plain Python on the client records of bench/serve/load.py (no torch, no gRPC calls).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from bench.serve.metrics import gaps, ms, pct


@dataclass(frozen=True)
class Criteria:
    """What counts as sustained. rise: TTFT may grow over the second half by at most
    max(rise_abs_s, rise_rel x its median there)."""
    slo_ttft_s: float = 1.0
    slo_itl_s: float = 0.060
    min_ratio: float = 0.97
    rise_abs_s: float = 0.1
    rise_rel: float = 0.5

    def as_dict(self) -> dict:
        return asdict(self)


def _slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys on xs (None for fewer than 3 points or no spread)."""
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def steady_rate(times: list[float], trim: float = 0.1) -> float | None:
    """Events per second from event times: the slope of the sorted times against their rank,
    fitted over the middle (1 - 2 trim) of them, so the first and last few (a ramp, a tail,
    one slow request) do not set it. None for too few events."""
    t = sorted(times)
    k = int(len(t) * trim)
    mid = t[k:len(t) - k] if len(t) - 2 * k >= 3 else t
    s = _slope([float(i) for i in range(len(mid))], mid)
    return None if not s or s <= 0 else 1.0 / s


def second_half(records: list[dict]) -> list[dict]:
    """The OK records whose send is in the second half of the probe's sends, by send time
    (the ramp from an empty stack is over by then)."""
    ok = sorted((r for r in records if r["status"] == "OK" and r["times"]),
                key=lambda r: r["send"])
    if len(ok) < 6:
        return []
    mid = (ok[0]["send"] + ok[-1]["send"]) / 2
    return [r for r in ok if r["send"] >= mid]


def ttft_rise(records: list[dict]) -> tuple[float | None, float | None]:
    """(rise, median) of TTFT over the second half of the probe's sends, in seconds: the
    fitted slope against send time times the half's length, and the half's median TTFT."""
    half = second_half(records)
    if not half:
        return None, None
    xs = [r["send"] for r in half]
    ys = [r["times"][0] - r["send"] for r in half]
    s = _slope(xs, ys)
    return (None if s is None else s * (xs[-1] - xs[0])), pct(ys, 50)


def lag_slope(records: list[dict], arrivals: list[float]) -> float | None:
    """How fast end-to-end latency, counted from each request's scheduled arrival (so a
    client that falls behind counts too), grows over the second half of the arrivals (s per
    s). A stack that serves mu req/s of lambda offered falls behind by lambda / mu - 1 a
    second, so the achieved rate is lambda / (1 + slope). arrivals[i]: request i's offset."""
    ok = [(arrivals[r["index"]], r["end"]) for r in records if r["status"] == "OK"]
    if len(ok) < 6:
        return None
    mid = (min(arrivals) + max(arrivals)) / 2
    half = [(at, end - at) for at, end in ok if at >= mid]
    return _slope([x for x, _ in half], [y for _, y in half])


def send_lag(records: list[dict], arrivals: list[float]) -> float | None:
    """p99 of how late the client sent requests against their schedule (s; the earliest
    relative send taken as on time): large means the load generator, not the stack, lagged."""
    rel = [r["send"] - arrivals[r["index"]] for r in records]
    return pct([x - min(rel) for x in rel], 99) if rel else None


def achieved_rate(records: list[dict], arrivals: list[float]) -> tuple[float | None, float]:
    """(arrival rate, achieved rate): the realized rate of the scheduled arrivals, and that
    times the share that completed OK over 1 + the latency's growth (lag_slope, >= 0)."""
    if len(arrivals) < 2 or max(arrivals) <= min(arrivals):
        return None, 0.0
    arrival = (len(arrivals) - 1) / (max(arrivals) - min(arrivals))
    ok = sum(r["status"] == "OK" for r in records) / max(1, len(records))
    g = lag_slope(records, arrivals)
    if g is None:
        return arrival, 0.0
    return arrival, arrival * ok / (1.0 + max(0.0, g))


def judge(records: list[dict], arrivals: list[float], offered: float, crit: Criteria) -> dict:
    """One probe's outcome. arrivals[i]: the scheduled send offset (s) of request index i."""
    ok = [r for r in records if r["status"] == "OK"]
    arrival, achieved = achieved_rate(records, arrivals)
    ratio = achieved / arrival if arrival else None
    ttft = [r["times"][0] - r["send"] for r in ok if r["times"]]
    itl = [b - a for r in ok for a, b in gaps(r)]
    t99, i99 = pct(ttft, 99), pct(itl, 99)
    rise, med = ttft_rise(records)
    errors = len(records) - len(ok)
    limit = max(crit.rise_abs_s, crit.rise_rel * (med or 0.0))
    out = {"offered_req_s": round(offered, 3), "arrival_req_s": _r(arrival),
           "req_s": _r(achieved), "ratio": _r(ratio, 4), "ttft_p99_ms": ms(t99),
           "itl_p99_ms": ms(i99), "ttft_rise_ms": ms(rise), "rise_limit_ms": ms(limit),
           "errors": errors, "requests": len(records),
           "send_lag_p99_ms": ms(send_lag(records, arrivals))}
    why = reasons(out, crit)
    out.update(sustained=not any(w.startswith("achieved") for w in why),
               growing=any(w.startswith("TTFT rose") for w in why),
               slo_ok=not any(" p99 " in w for w in why), why=why)
    out["pass"] = not why
    return out


def reasons(p: dict, crit: Criteria) -> list[str]:
    """Why a probe's recorded figures (as judge rounds them) miss the criteria; [] = pass."""
    why = []
    if p["ratio"] is None or p["ratio"] < crit.min_ratio:
        why.append(f"achieved {_fmt(p['ratio'])} of offered < {crit.min_ratio}")
    if p["ttft_rise_ms"] is None or p["ttft_rise_ms"] > p["rise_limit_ms"]:
        why.append(f"TTFT rose {_fmt(p['ttft_rise_ms'])} ms over the second half (limit "
                   f"{p['rise_limit_ms']:.0f})")
    for name, key, slo in (("TTFT", "ttft_p99_ms", crit.slo_ttft_s),
                           ("ITL", "itl_p99_ms", crit.slo_itl_s)):
        if p[key] is None or p[key] > round(1e3 * slo, 6):
            why.append(f"{name} p99 {_fmt(p[key])} ms > {1e3 * slo:.0f}")
    if p["errors"]:
        why.append(f"{p['errors']} requests failed")
    return why


def recheck(p: dict, crit: Criteria) -> bool:
    """Whether a probe's recorded figures satisfy the criteria."""
    return not reasons(p, crit)


def _r(x, nd: int = 3):
    return None if x is None else round(x, nd)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


# ------------------------------------------------------------------------------- the search
def bracket(probes: list[dict]) -> tuple[float | None, float | None]:
    """(lo, hi): the highest passing rate, and the lowest failing rate above it."""
    passed = [p["rate"] for p in probes if p["pass"]]
    lo = max(passed) if passed else None
    failed = [p["rate"] for p in probes if not p["pass"] and (lo is None or p["rate"] > lo)]
    return lo, (min(failed) if failed else None)


def next_rate(lo: float | None, hi: float | None, start: float, step: float) -> float:
    if lo is None and hi is None:
        return start
    if hi is None:
        return lo * step
    if lo is None:
        return hi / step
    return math.sqrt(lo * hi)


def search(probe, start: float, max_probes: int, tol: float = 0.05,
           step: float = 1.25) -> dict:
    """probe(rate) -> an outcome with "pass" (judge's), or None to stop (out of time).
    Returns goodput_req_s (the highest passing rate, None if none passed), lo, hi, the
    probes in order, and bound: "" when lo and hi are within tol of each other, else why the
    search stopped short: "probes" (the bound on probes, bracketed), "no_fail" (every probe
    passed: the goodput is at least lo), "no_pass" (none passed), "deadline"."""
    if not start > 0 or max_probes < 1:
        raise ValueError("search needs start > 0 and max_probes >= 1")
    probes: list[dict] = []
    bound = "probes"
    while len(probes) < max_probes:
        lo, hi = bracket(probes)
        rate = round(next_rate(lo, hi, start, step), 3)
        outcome = probe(rate)
        if outcome is None:
            bound = "deadline"
            break
        probes.append({**outcome, "rate": rate})
        lo, hi = bracket(probes)
        if lo is not None and hi is not None and (hi - lo) / lo <= tol:
            bound = ""
            break
    lo, hi = bracket(probes)
    if bound == "probes" and hi is None:
        bound = "no_fail"
    elif bound == "probes" and lo is None:
        bound = "no_pass"
    below = [p["rate"] for p in probes if not p["pass"] and lo is not None and p["rate"] < lo]
    return {"goodput_req_s": lo, "lo": lo, "hi": hi, "bound": bound, "probes": probes,
            "fail_below_goodput": below}
