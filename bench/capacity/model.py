"""The capacity simulator's measured inputs: engine step time and cold-load times per tier.

Engine step time (ms) of a step with ``b`` rows of which ``p`` prefill tokens, ``d`` distinct
adapters among its ``l`` LoRA rows:

    step = a0 + a1 * b + [d > 0] * (c0 + c1 * d)      the captured decode graph (least squares
                                                      over bench/results/e2e-h200.json and
                                                      ab/e2e-small-*: batch 1-64, 0-32 adapters)
         + k_pre * p                                   prefill, per token (the same e2e runs:
                                                      their total time less their decode steps)
         + [p > 0] * (e0 + [l > 0] * e_lora)           a mixed prefill + decode step runs eagerly
                                                      (PERF_NOTES: "mixed steps run eagerly"):
                                                      e0 and e_lora are calibrated on the serving
                                                      benchmark's base and 5-adapter rows only

Cold-load time of a tier: lognormal through the measured p50 and p99 of the serving benchmark's
worker records for that tier (pooled over its rows: the same distribution for every run), for
an adapter of the measured size; another size scales it by ``FIXED + (1 - FIXED) * bytes /
measured bytes``: about half a source load is per-load latency (rank 8, 16.8 MB: p50 29.9 ms;
rank 16, 33.6 MB: 45.8 ms in serve-h200-check.json, i.e. ~14 ms + 0.95 ms/MB).
"""
from __future__ import annotations

import glob
import json
import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from bench.lib.header import RESULTS

Z99 = 2.3263478740408408      # the standard normal's 99th percentile
FIXED = 0.5                   # the part of a load that does not grow with its bytes


@dataclass(frozen=True)
class StepModel:
    """Coefficients of the step-time model above (ms)."""
    a0: float
    a1: float
    c0: float
    c1: float
    k_pre: float
    e0: float = 0.0
    e_lora: float = 0.0

    def ms(self, rows: int, prefill_tokens: int, distinct: int, lora_rows: int) -> float:
        t = self.a0 + self.a1 * rows + self.k_pre * prefill_tokens
        if distinct:
            t += self.c0 + self.c1 * distinct
        if prefill_tokens:
            t += self.e0 + (self.e_lora if lora_rows else 0.0)
        return t


def _e2e_rows(results: Path) -> list[dict]:
    files = [results / "e2e-h200.json", *map(Path, sorted(glob.glob(
        str(results / "ab" / "e2e-small-*-h200.json"))))]
    rows = []
    for f in files:
        if f.exists():
            rows += [r for r in json.loads(f.read_text())["rows"]
                     if r.get("impl") == "lorafleet" and r.get("decode_step_ms")]
    return rows


def _lstsq(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Ordinary least squares by the normal equations (4 unknowns; no numpy needed)."""
    n = len(xs[0])
    a = [[sum(x[i] * x[j] for x in xs) for j in range(n)] for i in range(n)]
    b = [sum(x[i] * y for x, y in zip(xs, ys)) for i in range(n)]
    for i in range(n):                                   # Gauss-Jordan with partial pivoting
        piv = max(range(i, n), key=lambda r: abs(a[r][i]))
        a[i], a[piv], b[i], b[piv] = a[piv], a[i], b[piv], b[i]
        for r in range(n):
            if r != i and a[i][i]:
                f = a[r][i] / a[i][i]
                a[r] = [v - f * w for v, w in zip(a[r], a[i])]
                b[r] -= f * b[i]
    return [b[i] / a[i][i] for i in range(n)]


def fit_step_model(results: Path = RESULTS, prompt: int = 128) -> tuple[StepModel, dict]:
    """The decode-graph and prefill terms from the e2e bench; returns the model and the fit's
    residuals (for the docs)."""
    rows = _e2e_rows(results)
    xs = [[1.0, r["batch"], float(r["distinct"] > 0), r["distinct"]] for r in rows]
    ys = [r["decode_step_ms"] for r in rows]
    a0, a1, c0, c1 = _lstsq(xs, ys)
    pre = [(r["total_s"] * 1e3 - r["steps"] * r["decode_step_ms"]) / (r["batch"] * prompt)
           for r in rows if r.get("total_s") and r["batch"] >= 32]
    model = StepModel(a0, a1, c0, c1, statistics.median(pre))
    resid = [round(y - model.ms(int(x[1]), 0, int(x[3]), int(x[1])), 3) for x, y in zip(xs, ys)]
    return model, {"points": len(rows), "max_abs_residual_ms": max(map(abs, resid))}


@dataclass(frozen=True)
class LoadTimes:
    """Per tier (worker_host, store_host, source): (p50 s, p99 s) of one adapter of ref_bytes."""
    tiers: dict
    ref_bytes: int

    def sample(self, rng: random.Random, tier: str, nbytes: int) -> float:
        p50, p99 = self.tiers[tier]
        sigma = max(1e-6, math.log(max(p99, p50 * 1.0001) / p50) / Z99)
        return rng.lognormvariate(math.log(p50), sigma) * self._scale(nbytes)

    def _scale(self, nbytes: int) -> float:
        return FIXED + (1.0 - FIXED) * nbytes / self.ref_bytes

    def expected(self, tier: str, nbytes: int) -> float:
        """Mean of the tier's lognormal (the reload cost cost-aware eviction is given)."""
        p50, p99 = self.tiers[tier]
        sigma = math.log(max(p99, p50 * 1.0001) / p50) / Z99
        return p50 * math.exp(sigma ** 2 / 2) * self._scale(nbytes)


def measured_load_times(results: Path = RESULTS) -> LoadTimes:
    """Source and worker-host loads from serve-h200.json (rank-8, 16.8 MB; pooled medians of
    the rows' p50 and p99); the store's host tier from serve-h200-check.json's cold-store row
    (rank 16: serve-h200's runs never loaded from it)."""
    serve = json.loads((results / "serve-h200.json").read_text())
    tiers: dict[str, list] = {}
    for r in serve["rows"]:
        if r.get("cold_tier") and r.get("cold_p50_ms"):
            tiers.setdefault(r["cold_tier"], []).append((r["cold_p50_ms"], r["cold_p99_ms"]))
    check = results / "serve-h200-check.json"
    if "store_host" not in tiers and check.exists():
        for r in json.loads(check.read_text())["rows"]:
            if r.get("cold_tier") == "store_host" and r.get("cold_p50_ms"):
                tiers.setdefault("store_host", []).append((r["cold_p50_ms"], r["cold_p99_ms"]))
    out = {t: (statistics.median(v[0] for v in vs) / 1e3, statistics.median(v[1] for v in vs)
               / 1e3) for t, vs in tiers.items()}
    ref = serve["header"]["adapters"]["bytes"].get("8", 16 << 20)
    return LoadTimes(out, int(ref))
