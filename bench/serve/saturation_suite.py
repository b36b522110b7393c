"""The saturation suite's measurements on a running stack (bench.serve.bench.run_saturation
sets it up with bench/serve/saturation.py's workloads and flags): per workload a warm-up pass,
closed loops, the goodput search and open-loop rows; the cold rows first. Every row says its run
id; progress is printed for every probe. Every measured row keeps the worker's step profile over
it (bench/serve/steps.py: "steps"; a goodput row's over all its probes), and the header each
workload's over its steady closed loops and goodput search ("steps": {workload: profile})."""
from __future__ import annotations

import datetime
import secrets
import time

from bench.serve import saturation_search as srch
from bench.serve import fleet as serve_fleet, metrics as sm, scenarios as ss
from bench.serve import steps as serve_steps


def run_id(commit: str) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"sat-{stamp}-{commit or 'nogit'}-{secrets.token_hex(2)}"


def achieved(records: list[dict], rate: float | None = None) -> tuple:
    """(req/s, out tok/s) at steady state: `rate` (an open loop's, from its judgement), else
    the completion rate over the middle of the completions (a closed loop); tok/s is that
    times the mean output of the requests that completed."""
    ok = [r for r in records if r["status"] == "OK"]
    if rate is None:
        rate = srch.steady_rate([r["end"] for r in ok])
    if rate is None or not ok:
        return None, None
    return round(rate, 3), round(rate * sum(r["tokens"] for r in ok) / len(ok), 1)


class Suite:
    def __init__(self, bench, args, workloads, cold, opened, t0: float | None = None):
        """t0: when the run started (time.monotonic()); --deadline-s counts from it."""
        from bench.lib.header import base_header
        self.bench, self.args, self.workloads = bench, args, workloads
        self.cold, self.opened = cold, opened
        self.crit = srch.Criteria(slo_ttft_s=args.slo_ttft_ms / 1e3,
                                  slo_itl_s=args.slo_itl_ms / 1e3, min_ratio=args.min_ratio,
                                  rise_abs_s=max(0.1 * args.slo_ttft_ms / 1e3, 0.05))
        self.rid = run_id(base_header("cpu", args.commit)["commit"])
        self.rows: list[dict] = []
        self.skipped: list[str] = []
        self.failed: list[str] = []
        self.dead = False
        self.timings: dict[str, float] = {}
        self.base_goodput: float | None = None
        self.gain: float | None = None          # base goodput / base closed-loop capacity
        self.t0 = time.monotonic() if t0 is None else t0

    # ---- time -------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def time_for(self, seconds: float) -> bool:
        d = self.args.deadline_s
        return not d or self.elapsed() + seconds <= d

    def say(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {text}", flush=True)

    # ---- the plan -----------------------------------------------------------------------------
    def run(self) -> None:
        base, rest = self.workloads[0], self.workloads[1:]
        self.steady(base)
        for w in self.cold:
            self.part(f"{w.name} cold", lambda w=w: self.cold_row(w))
        for w in rest:
            self.steady(w)

    def part(self, what: str, fn) -> None:
        """Run one part unless the deadline leaves too little time for it or the stack is
        gone; a part that fails is named in the header and the run goes on (its rows so far
        are kept), unless a service exited."""
        if self.dead or not self.time_for(self.args.probe_s * 2 + 5):
            why = "a service exited" if self.dead else f"deadline {self.args.deadline_s:.0f}s"
            self.skipped.append(f"{what} ({why})")
            self.say(f"{what}: skipped ({why})")
            return
        t = time.monotonic()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - keep the rows measured so far
            self.failed.append(f"{what}: {exc!r}"[:500])
            self.say(f"{what}: FAILED: {exc!r}")
            try:
                self.bench.stack.check_alive()
            except Exception:  # noqa: BLE001
                self.dead = True
        self.timings[what] = round(time.monotonic() - t, 1)

    def steady(self, w) -> None:
        self.part(f"{w.name} warm-up", lambda: self.prime(w))
        caps = []
        for c in self.args.stream_counts:
            self.part(f"{w.name} closed {c}", lambda c=c: caps.append(self.closed_row(w, c)))
        caps = [x for x in caps if x]
        if caps:
            self.part(f"{w.name} goodput", lambda: self.goodput_row(w, max(caps)))
        if w.name in self.opened:
            for f in self.args.fracs:
                self.part(f"{w.name} open {f:g}", lambda f=f: self.open_row(w, f))

    # ---- unmeasured passes --------------------------------------------------------------------
    def prime(self, w) -> None:
        """Host tiers touched (each adapter once, least popular first) or the adapters
        preloaded, then a pass of the workload itself, short outputs: the pool at its
        equilibrium (the base model: the kernels and the stack warm)."""
        b, a = self.bench, self.args
        ids = b.ids(w.scenario("prime", concurrency=1))
        recs = []
        if w.kind == "resident":
            b._preload(w.scenario(w.name, concurrency=1), ids)
        elif ids:
            touch = ss.preload_requests(list(reversed(ids)), b.vocab, a.tenants)
            recs = b.pool.run(touch, max(a.stream_counts))
        s = w.scenario(f"{w.name}-warm", concurrency=max(a.stream_counts),
                       requests=a.warm_requests, prompt=a.defaults["prompt"], output=(2, 2))
        recs += b.pool.run(b.requests(s, "warmup"), s.concurrency)
        bad = sum(r["status"] != "OK" for r in recs)
        self.say(f"{w.name}: warm-up ({len(ids)} adapters touched, {a.warm_requests} requests"
                 + (f"; {bad} FAILED" if bad else "") + ")")

    # ---- measured -----------------------------------------------------------------------------
    def measure(self, s: ss.Scenario) -> tuple[list, list, dict]:
        """(requests, records, the services' figures) of one scenario's requests."""
        from bench.serve.stack import store_stats, worker_info
        b = self.bench
        reqs = b.requests(s, "measure")
        addrs = [x.addr for x in b.stack.workers]
        w0, st0 = [worker_info(x) for x in addrs], store_stats(b.stack.store.addr)
        records = b.pool.run(reqs, s.concurrency)
        w1 = [worker_info(x, since=y.cold_load_seq) for x, y in zip(addrs, w0)]
        st1 = store_stats(b.stack.store.addr)
        b.stack.check_alive()
        before, after = serve_fleet.fleet_info(w0, w1)
        hits = sm.hit_rates(before, after, st0, st1)
        loads = [r.total_s for r in after.cold_load_records] or [
            r["timings"]["cold_load_s"] for r in records
            if r["timings"] and r["timings"]["cold_load_s"] > 0]
        return reqs, records, {"gpu_hit_rate": hits["gpu_hit_rate"],
                               "cold_p50_ms": sm.ms(sm.pct(loads, 50)), "cold_n": len(loads),
                               "steps": serve_steps.summary(serve_steps.delta(w0, w1))}

    def row(self, w, s, mode: str, state: str, records: list, svc: dict,
            rate: float | None = None, **more) -> dict:
        fig = sm.client_figures(records)
        req_s, tok_s = achieved(records, rate)
        r = {"scenario": s.name, "workload": w.name, "mode": mode, "adapters": w.adapters,
             "zipf": s.zipf if w.adapters else None, "ranks": list(w.ranks), "state": state,
             "offered_req_s": float(s.rate) if s.rate is not None else None,
             "streams": s.concurrency, "req_s": req_s, "out_tok_s": tok_s,
             **{k: fig[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                                    "e2e_p50_ms", "requests", "ok", "errors")},
             "span_out_tok_s": fig["out_tok_s"], **svc, "pool_frac": self.pool_frac(w),
             "run": self.rid, **more}
        self.rows.append(r)
        self.save_partial()
        return r

    def save_partial(self) -> None:
        """The rows so far (OUT/partial-saturation.json), in case the run is cut short."""
        import json
        import pathlib
        out = pathlib.Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "partial-saturation.json").write_text(json.dumps(
            {"run": self.rid, "rows": self.rows}, indent=1, default=str))

    def pool_frac(self, w) -> float | None:
        """The share of the workload's adapter bytes the GPU pool can hold (<= 0.25: issue
        42's 'a quarter at most')."""
        from services.common.runtime import parse_bytes
        from services.worker.config import flag_defaults
        ids = self.bench.ids(w.scenario("x", concurrency=1))
        if not ids:
            return None
        from bench.serve.run import rank_of
        elem = 4 if self.args.device == "cpu" else 2
        total = sum(elem * self.bench.manifest["elements"][rank_of(a)] for a in ids)
        pool = parse_bytes(self.args.gpu_pool_bytes or flag_defaults()["gpu_pool_bytes"])
        return round(min(1.0, pool / total), 4)

    def closed_row(self, w, streams: int, state: str = "steady") -> float | None:
        s = w.scenario(f"{w.name}-{'cold-' if state == 'cold' else ''}closed{streams}",
                       concurrency=streams, requests=self.args.closed_rounds * streams,
                       prompt=self.args.defaults["prompt"], output=self.args.defaults["output"])
        _, records, svc = self.measure(s)
        r = self.row(w, s, "closed", state, records, svc)
        self.say(f"{s.name}: {r['req_s']} req/s, {r['out_tok_s']} tok/s, TTFT p99 "
                 f"{r['ttft_p99_ms']} ms, ITL p50 {r['itl_p50_ms']} ms, GPU hit "
                 f"{r['gpu_hit_rate']}, errors {r['errors'] or 0}")
        return r["req_s"]

    def cold_row(self, w) -> None:
        self.closed_row(w, self.args.stream_counts[0], state="cold")

    def open_load(self, w, name: str, rate: float) -> ss.Scenario:
        a = self.args
        n = max(a.probe_min_requests, round(rate * a.probe_s))
        return w.scenario(name, rate=rate, requests=n, prompt=a.defaults["prompt"],
                          output=a.defaults["output"])

    def probe(self, w, k: list, rate: float) -> dict | None:
        """One goodput probe (None when the deadline leaves no time for it)."""
        if not self.time_for(self.args.probe_s * 1.5 + 3):
            return None
        k.append(len(k) + 1)
        s = self.open_load(w, f"{w.name}-probe{k[-1]}", rate)
        reqs, records, svc = self.measure(s)
        out = srch.judge(records, [q.at for q in reqs], rate, self.crit)
        out.update(svc, scenario=s.name, ttft_p50_ms=sm.client_figures(records)["ttft_p50_ms"])
        out["_records"] = records
        self.say(f"{w.name} probe {k[-1]}/{self.args.max_probes}: offered {rate:.2f} req/s "
                 f"(arrivals {out['arrival_req_s']}), achieved {out['req_s']} "
                 f"({out['ratio']}), TTFT p99 {out['ttft_p99_ms']} ms (rise "
                 f"{out['ttft_rise_ms']}), ITL p99 {out['itl_p99_ms']} ms, send lag p99 "
                 f"{out['send_lag_p99_ms']} ms: "
                 + ("PASS" if out["pass"] else "fail: " + "; ".join(out["why"])))
        return out

    def goodput_row(self, w, capacity: float) -> None:
        """The search from the closed-loop capacity (times the base model's goodput over its
        capacity, once known); the row holds the chosen probe's figures."""
        start = capacity * (self.gain or 1.0)
        k: list = []
        res = srch.search(lambda r: self.probe(w, k, r), start, self.args.max_probes,
                          self.args.search_tol, self.args.search_step)
        chosen = next((p for p in res["probes"] if p["pass"] and p["rate"] == res["lo"]), None)
        records = chosen.pop("_records") if chosen else []
        for p in res["probes"]:
            p.pop("_records", None)
        s = w.scenario(f"{w.name}-goodput", rate=res["lo"] or start, requests=1)
        svc = {x: chosen[x] for x in ("gpu_hit_rate", "cold_p50_ms", "cold_n")} if chosen \
            else {"gpu_hit_rate": None, "cold_p50_ms": None, "cold_n": 0}
        svc["steps"] = serve_steps.merge(p.pop("steps", None) for p in res["probes"])
        r = self.row(w, s, "goodput", "steady", records, svc, chosen["req_s"] if chosen
                     else None, goodput_req_s=res["lo"],
                     search={k2: v for k2, v in res.items() if k2 != "probes"},
                     probes=res["probes"], start_req_s=round(start, 3), bound=res["bound"])
        if not chosen:
            r.update(offered_req_s=None, req_s=None, out_tok_s=None)
        if w.kind == "base" and res["lo"]:
            self.base_goodput, self.gain = res["lo"], res["lo"] / capacity
        self.say(f"{w.name}: goodput {res['lo']} req/s (bracket {res['lo']}..{res['hi']}, "
                 f"{len(res['probes'])} probes{', bound ' + res['bound'] if res['bound'] else ''})")

    def open_row(self, w, frac: float) -> None:
        if not self.base_goodput:
            self.skipped.append(f"{w.name} open {frac:g}: no base goodput")
            return
        s = self.open_load(w, f"{w.name}-open{round(frac * 100)}", frac * self.base_goodput)
        reqs, records, svc = self.measure(s)
        out = srch.judge(records, [q.at for q in reqs], float(s.rate), self.crit)
        r = self.row(w, s, "open", "steady", records, svc, out["req_s"], frac_of_base_goodput=frac,
                     sustained=out["sustained"], ttft_rise_ms=out["ttft_rise_ms"])
        self.say(f"{s.name}: {s.rate:.2f} req/s offered, achieved {r['req_s']}, TTFT p50/p99 "
                 f"{r['ttft_p50_ms']}/{r['ttft_p99_ms']} ms, ITL p50/p99 {r['itl_p50_ms']}/"
                 f"{r['itl_p99_ms']} ms")

    def header(self) -> dict:
        return {"suite": "saturation", "run": self.rid, "criteria": self.crit.as_dict(),
                "slo": {"ttft_p99_ms": self.args.slo_ttft_ms, "itl_p99_ms": self.args.slo_itl_ms},
                "search": {"max_probes": self.args.max_probes, "tol": self.args.search_tol,
                           "step": self.args.search_step, "probe_s": self.args.probe_s},
                "streams": self.args.stream_counts, "open_fracs": self.args.fracs,
                "base_goodput_req_s": self.base_goodput, "timings_s": self.timings,
                "skipped": self.skipped, "failed": self.failed,
                "elapsed_s": round(self.elapsed(), 1),
                "workloads": [w.name for w in self.workloads],
                "cold": [w.name for w in self.cold], "open": self.opened,
                "steps": serve_steps.by_workload(self.rows)}
