"""bench/serve/bench.py --suite saturation (issue 42): the goodput search on synthetic probe
outcomes, the probe judgement on synthetic client records, the cross-run ratio check, and a
--quick run through the real services whose results must follow the schema. Nothing is timed."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from bench.serve import saturation_report as rep
from bench.serve import saturation_search as srch
from bench.serve import saturation as sat
from bench.serve import scenarios as ss
from bench.serve import steps as serve_steps

ROOT = pathlib.Path(__file__).resolve().parent.parent
CRIT = srch.Criteria(slo_ttft_s=1.0, slo_itl_s=0.06)


def capacity(c: float, calls: list | None = None):
    """A synthetic stack: a probe passes iff its rate is at most c."""
    def probe(rate):
        if calls is not None:
            calls.append(rate)
        return {"pass": rate <= c, "why": [] if rate <= c else ["over"]}
    return probe


@pytest.mark.parametrize("start", [20.0, 60.0, 65.0, 100.0, 300.0])
def test_the_search_brackets_the_capacity_within_its_tolerance(start):
    res = srch.search(capacity(65.0), start, max_probes=12, tol=0.05)
    assert res["bound"] == "" and res["lo"] <= 65.0 < res["hi"]
    assert (res["hi"] - res["lo"]) / res["lo"] <= 0.05
    assert res["goodput_req_s"] == res["lo"] and not res["fail_below_goodput"]
    passed = [p["rate"] for p in res["probes"] if p["pass"]]
    assert max(passed) == res["lo"] and all(p["pass"] == (p["rate"] <= 65) for p in res["probes"])


def test_the_search_is_bounded_and_says_why_it_stopped():
    calls: list = []
    res = srch.search(capacity(65.0, calls), 60.0, max_probes=3, tol=0.001)
    assert len(calls) == 3 and res["bound"] == "probes"            # bracketed, not narrow
    assert res["lo"] <= 65 < res["hi"]
    up = srch.search(capacity(1e9), 10.0, max_probes=3)
    assert up["bound"] == "no_fail" and up["hi"] is None and up["lo"] == pytest.approx(15.625)
    down = srch.search(capacity(0.0), 10.0, max_probes=3)
    assert down["bound"] == "no_pass" and down["goodput_req_s"] is None
    assert [p["rate"] for p in down["probes"]] == [10.0, 8.0, 6.4]
    stopped = srch.search(lambda r: None, 10.0, max_probes=3)
    assert stopped["bound"] == "deadline" and stopped["probes"] == []
    with pytest.raises(ValueError):
        srch.search(capacity(1.0), 0.0, max_probes=3)


def test_a_noisy_failure_below_the_goodput_is_reported():
    outcomes = {10.0: True, 12.5: False, 11.18: True}
    res = srch.search(lambda r: {"pass": outcomes.get(r, r < 11.5), "why": []}, 10.0, 3)
    assert res["lo"] == 11.18 and res["hi"] == 12.5 and res["bound"] == "probes"
    noisy = srch.search(lambda r: {"pass": r != 10.0, "why": []}, 10.0, 2)
    assert noisy["lo"] == 8.0 and noisy["hi"] == 10.0
    flaky = [{"rate": 8.0, "pass": False}, {"rate": 9.0, "pass": True}, {"rate": 10.0,
                                                                         "pass": False}]
    assert srch.bracket(flaky) == (9.0, 10.0)


def _records(rate: float, n: int, e2e, ttft, itl: float = 0.02, status=lambda i: "OK"):
    """n requests sent at 1/rate intervals; e2e(i) and ttft(i) in seconds."""
    out = []
    for i in range(n):
        send = i / rate
        first = send + ttft(i)
        times = [first + k * itl for k in range(8)]
        out.append({"index": i, "send": send, "end": send + e2e(i), "times": times,
                    "status": status(i), "tokens": 8, "cold": False, "error": ""})
    return out, [i / rate for i in range(n)]


def test_a_sustained_probe_passes_and_each_criterion_fails_on_its_own():
    recs, at = _records(50, 300, lambda i: 0.5, lambda i: 0.05)
    ok = srch.judge(recs, at, 50.0, CRIT)
    assert ok["pass"] and ok["ratio"] == pytest.approx(1.0) and ok["req_s"] == pytest.approx(50)
    assert srch.recheck(ok, CRIT)
    # a queue: latency grows 0.1 s each second (the stack serves 50 / 1.1 req/s)
    recs, at = _records(50, 300, lambda i: 0.5 + 0.1 * i / 50, lambda i: 0.05 + 0.1 * i / 50)
    slow = srch.judge(recs, at, 50.0, CRIT)
    assert not slow["pass"] and not slow["sustained"] and slow["growing"]
    assert slow["req_s"] == pytest.approx(50 / 1.1, rel=1e-3) and not srch.recheck(slow, CRIT)
    recs, at = _records(50, 300, lambda i: 0.5, lambda i: 1.2 if i % 10 == 0 else 0.05)
    late = srch.judge(recs, at, 50.0, CRIT)
    assert not late["pass"] and not late["slo_ok"] and late["sustained"]
    recs, at = _records(50, 300, lambda i: 0.5, lambda i: 0.05, itl=0.07)
    assert not srch.judge(recs, at, 50.0, CRIT)["slo_ok"]
    recs, at = _records(50, 300, lambda i: 0.5, lambda i: 0.05,
                        status=lambda i: "UNAVAILABLE" if i % 20 == 0 else "OK")
    failed = srch.judge(recs, at, 50.0, CRIT)
    assert not failed["pass"] and failed["errors"] == 15 and failed["ratio"] < 0.97


def _row(run, scenario, adapters, mode="goodput", **kw):
    r = {"scenario": scenario, "workload": scenario, "mode": mode, "adapters": adapters,
         "zipf": 1.0 if adapters else None, "ranks": [8] if adapters else [], "state": "steady",
         "offered_req_s": 10.0, "req_s": 10.0, "out_tok_s": 1000.0, "ttft_p50_ms": 10.0,
         "ttft_p99_ms": 20.0, "itl_p50_ms": 5.0, "itl_p99_ms": 9.0, "gpu_hit_rate": None,
         "cold_p50_ms": None, "run": run, "goodput_req_s": 10.0}
    r.update(kw)
    return r


def test_ratios_are_within_one_run_and_refused_across_runs(tmp_path):
    rows = [_row("a", "base", 0), _row("a", "zipf-5", 5, goodput_req_s=9.0, itl_p50_ms=5.5)]
    q = rep.ratios(rows)
    assert q[1]["throughput"] == pytest.approx(0.9) and q[1]["itl_p50"] == pytest.approx(1.1)
    mixed = rows + [_row("b", "zipf-100", 100)]
    with pytest.raises(rep.MixedRuns):
        rep.ratios(mixed)
    with pytest.raises(rep.MixedRuns):
        rep.check_one_run([{k: v for k, v in rows[0].items() if k != "run"}])
    head = {"date": "d", "card": "c", "versions": {}, "commit": "x", "run": "a"}
    assert "mixes runs" in rep.markdown({"header": head, "rows": mixed})
    assert "mixes runs" not in rep.markdown({"header": head, "rows": rows})
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"header": head, "rows": rows}))
    b.write_text(json.dumps({"header": {**head, "run": "b"}, "rows": mixed[2:]}))
    assert rep.main(["--check", str(a)]) == 0 and rep.main(["--ratios", str(a)]) == 0
    assert rep.main(["--check", str(a), str(b)]) == 1
    assert rep.main(["--ratios", str(a), str(b)]) == 1
    assert rep.main(["--merge", str(a), str(b), "--out", str(tmp_path), "--name", "m"]) == 0
    assert "mixes runs" in (tmp_path / "m.md").read_text()
    from bench.serve import merge as serve_merge
    with pytest.raises(SystemExit, match="saturation_report"):
        serve_merge.merge([{"header": {**head, "suite": "saturation"}, "rows": rows}])


def test_workloads_parse_and_mixed_ranks_take_each_rank_in_turn():
    ws = sat.parse_workloads("zipf:100,resident:32,mixed:8")
    assert [w.name for w in ws] == ["base", "zipf-100", "resident-32", "mixed-8"]
    mixed = ws[3].scenario("m", concurrency=1)
    assert mixed.ranks == (8, 16, 32, 64) and ss.rank_counts(mixed) == {8: 2, 16: 2, 32: 2, 64: 2}
    assert ws[2].scenario("r", concurrency=1).preload and ws[2].scenario("r", rate=1).zipf == 0
    assert ss.adapter_needs(sat.all_scenarios(ws)) == {8: 100, 16: 32, 32: 2, 64: 2}
    ids = {r: [f"r{r}-{i:04d}" for i in range(3)] for r in (8, 16, 32, 64)}
    assert ss.mixed_ids(ids, (8, 16, 32, 64), 6) == ["r8-0000", "r16-0000", "r32-0000",
                                                     "r64-0000", "r8-0001", "r16-0001"]
    for bad in ("zipf", "colour:3", "mixed:6", "zipf:5,zipf:5"):
        with pytest.raises(SystemExit):
            sat.parse_workloads(bad)


def _profile(*classes):
    """A step profile from (kind, rows, prompt tokens, adapters, steps, seconds) classes."""
    return serve_steps.summary({c[:4]: c[4:] for c in classes})


def test_the_steps_tables_put_each_workload_beside_base():
    """Two workloads' closed-loop and goodput rows: each workload's profile sums its steady
    closed and goodput rows only, an adapter workload's class is set beside base's steps of
    the same kind, rows and prompt tokens, and the markdown shows it."""
    decode, mixed = ("decode-graph", "129-256", "0"), ("mixed-graph", "129-256", "513-2048")
    base = [_row("a", "base-closed8", 0, "closed", workload="base", streams=8,
                 steps=_profile((*decode, "0", 100, 1.89), (*mixed, "0", 10, 0.5))),
            _row("a", "base-goodput", 0, workload="base",
                 steps=_profile((*decode, "0", 100, 1.89)))]
    zipf = [_row("a", "zipf-100-closed8", 100, "closed", workload="zipf-100", streams=8,
                 steps=_profile((*decode, "33-128", 150, 3.195), (*mixed, "33-128", 10, 0.6),
                                ("eager", ">256", ">2048", ">128", 2, 0.3))),
            _row("a", "zipf-100-goodput", 100, workload="zipf-100",
                 steps=_profile((*decode, "33-128", 50, 1.065))),
            _row("a", "zipf-100-open50", 100, "open", workload="zipf-100", frac_of_base_goodput=.5,
                 steps=_profile((*decode, "1-8", 999, 9.0)))]         # open rows: not summed
    prof = serve_steps.by_workload(base + zipf)
    assert set(prof) == {"base", "zipf-100"}
    assert prof["base"]["steps"] == 210 and prof["base"]["seconds"] == pytest.approx(4.28)
    z = prof["zipf-100"]
    assert z["steps"] == 212 and z["seconds"] == pytest.approx(5.16)
    top = z["classes"][0]
    assert (top["kind"], top["rows"], top["prompt_tokens"], top["adapters"], top["steps"]) == (
        "decode-graph", "129-256", "0", "33-128", 200)
    assert top["mean_ms"] == pytest.approx(21.3) and top["base_mean_ms"] == pytest.approx(18.9)
    assert top["vs_base"] == pytest.approx(21.3 / 18.9, abs=1e-4)
    assert top["share"] == pytest.approx(4.26 / 5.16, abs=1e-4)
    eager = z["classes"][-1]
    assert eager["kind"] == "eager" and eager["base_mean_ms"] is None and eager["vs_base"] is None
    md = rep.markdown({"header": {"date": "d", "card": "c", "versions": {}, "commit": "x",
                                  "run": "a"}, "rows": base + zipf})
    assert "## Steps" in md and "zipf-100: 212 steps, 5.2 s timed" in md
    assert "| decode-graph | 129-256 | 0 | 33-128 | 200 | 21.30 | 18.90 | 1.13x | 83% |" in md
    assert "| decode-graph | 129-256 | 0 | 0 | 200 | 18.90 | 88% |" in md       # base's own
    mixed_runs = base + [dict(r, run="b") for r in zipf]
    assert "## Steps" not in rep.markdown({"header": {"date": "d", "card": "c", "versions": {},
                                                     "commit": "x"}, "rows": mixed_runs})


@pytest.mark.slow
def test_the_quick_saturation_suite_writes_its_schema_and_a_sound_search(tmp_path):
    out = tmp_path / "out"
    # the quarter-pool workloads of --quick (zipf-128, mixed-32), one stream count, three
    # probes a search (a bisection step once bracketed) of 1.5 s each: ~45 s
    proc = subprocess.run([sys.executable, "-m", "bench.serve.bench", "--suite", "saturation",
                           "--quick", "--out", str(out), "--work", str(tmp_path / "work"),
                           "--sat-workloads", "zipf:128,mixed:32", "--sat-open",
                           "base,zipf:128", "--streams", "8", "--max-probes", "3",
                           "--probe-s", "1.5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads((out / "saturation-cpu.json").read_text())
    assert set(doc) == {"header", "rows"}
    h = doc["header"]
    for key in rep.HEADER_FIELDS:
        assert h[key], key
    assert not h["skipped"] and not h["failed"], (h["skipped"], h["failed"])
    rows = doc["rows"]
    for r in rows:
        assert set(rep.ROW_FIELDS) <= set(r), r["scenario"]
        assert r["run"] == h["run"] and r["mode"] in ("goodput", "closed", "open")
        assert r["state"] in ("steady", "cold") and not r["errors"], r
    workloads = {r["workload"] for r in rows}
    assert workloads == {"base", "zipf-128", "mixed-32"}
    assert {(r["workload"], r["state"]) for r in rows if r["state"] == "cold"} == {
        ("zipf-128", "cold")}
    assert {tuple(r["ranks"]) for r in rows if r["workload"] == "mixed-32"} == {(8, 16, 32, 64)}
    assert all(r["pool_frac"] <= 0.25 for r in rows if r["workload"] in ("zipf-128", "mixed-32"))
    for w in workloads:
        streams = {r["streams"] for r in rows if r["workload"] == w and r["mode"] == "closed"
                   and r["state"] == "steady"}
        assert streams == {8}, w
    assert len([r for r in rows if r["mode"] == "open"]) == 6
    crit = srch.Criteria(**h["criteria"])
    for r in (r for r in rows if r["mode"] == "goodput"):
        _search_is_sound(r, crit)
    assert rep.ratios(rows)[0]["throughput"] == 1.0
    assert "| scenario |" in (out / "saturation-cpu.md").read_text()
    _steps_were_served(h, rows, (out / "saturation-cpu.md").read_text())
    assert (out / "saturation-cpu.png").stat().st_size > 0


def _steps_were_served(h: dict, rows: list[dict], md: str) -> None:
    """The worker's step profiles in a real run: every measured row has steps (eager on a
    CPU); each workload's header profile is the sum of its steady closed and goodput rows';
    base's steps have no adapters, an adapter workload's classes stand beside base's."""
    for r in rows:
        p = r["steps"]
        assert p["steps"] > 0 and p["seconds"] > 0, r["scenario"]
        assert {c["kind"] for c in p["classes"]} == {"eager"}, r["scenario"]
        assert sum(c["share"] for c in p["classes"]) == pytest.approx(1.0, abs=0.01)
        assert all("steps" not in q for q in r.get("probes") or ())
    profiles = h["steps"]
    assert set(profiles) == {"base", "zipf-128", "mixed-32"}
    for w, p in profiles.items():
        parts = [r["steps"] for r in rows if r["workload"] == w and r["state"] == "steady"
                 and r["mode"] in ("closed", "goodput")]
        assert p["steps"] == sum(x["steps"] for x in parts), w
    assert {c["adapters"] for c in profiles["base"]["classes"]} == {"0"}
    zipf = profiles["zipf-128"]["classes"]
    assert any(c["adapters"] != "0" for c in zipf)
    assert any(c["vs_base"] is not None and c["vs_base"] > 0 for c in zipf)
    assert "## Steps" in md and "| kind | rows | prompt tokens | adapters |" in md


def _meets(p: dict, crit: srch.Criteria) -> bool:
    """The criteria, written out here from the probe's recorded figures."""
    if None in (p["ratio"], p["ttft_rise_ms"], p["ttft_p99_ms"], p["itl_p99_ms"]):
        return False
    return (p["ratio"] >= crit.min_ratio and p["ttft_rise_ms"] <= p["rise_limit_ms"]
            and p["ttft_p99_ms"] <= 1e3 * crit.slo_ttft_s + 1e-6
            and p["itl_p99_ms"] <= 1e3 * crit.slo_itl_s + 1e-6 and p["errors"] == 0
            and p["rise_limit_ms"] >= 1e3 * crit.rise_abs_s - 1e-6)


def _search_is_sound(r: dict, crit: srch.Criteria) -> None:
    """The chosen rate passed its own criteria; a probe above it failed, or the row says the
    search hit its bound."""
    probes = r["probes"]
    assert 1 <= len(probes) <= 3, r["workload"]
    if r["goodput_req_s"] is None:
        assert r["bound"] == "no_pass" and not any(p["pass"] for p in probes)
        return
    chosen = [p for p in probes if p["rate"] == r["goodput_req_s"]]
    assert chosen and chosen[0]["pass"] and _meets(chosen[0], crit), r["workload"]
    assert r["offered_req_s"] == r["goodput_req_s"] and r["req_s"] == chosen[0]["req_s"]
    above = [p for p in probes if p["rate"] > r["goodput_req_s"]]
    assert any(not p["pass"] and not _meets(p, crit) for p in above) or \
        r["bound"] == "no_fail", r["workload"]


def test_parts_past_the_deadline_are_skipped_and_a_failing_part_is_named():
    import time
    from types import SimpleNamespace
    from bench.serve.saturation_suite import Suite
    args = SimpleNamespace(slo_ttft_ms=1000.0, slo_itl_ms=60.0, min_ratio=0.97, commit="abc",
                           deadline_s=100.0, probe_s=5.0)
    alive = SimpleNamespace(check_alive=lambda: None)
    suite = Suite(SimpleNamespace(stack=alive), args, [], [], [], t0=time.monotonic() - 95)
    assert suite.rid.startswith("sat-") and "abc" in suite.rid
    suite.part("late", lambda: pytest.fail("a part past the deadline ran"))
    assert suite.skipped == ["late (deadline 100s)"]
    args.deadline_s = 0.0
    suite.part("boom", lambda: 1 / 0)
    assert "ZeroDivisionError" in suite.failed[0] and not suite.dead
    suite.bench = SimpleNamespace(stack=SimpleNamespace(check_alive=lambda: 1 / 0))
    suite.part("crash", lambda: 1 / 0)
    suite.part("after", lambda: pytest.fail("ran after a service exited"))
    assert suite.dead and suite.skipped[-1] == "after (a service exited)"
