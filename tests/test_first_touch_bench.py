"""bench/serve/first_touch.py (issue 43): its rows from synthetic client and worker records, the
part files merged (and refused when mixed), and a --quick run through the real services whose
results must follow the schema with sane figures. Nothing here is timed."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from bench.serve import first_touch_report as rep

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _rec(send, times, cold=False, adapter=""):
    return {"index": 0, "adapter": adapter, "tenant": "t0", "cold": cold, "burst": False,
            "phase": "measure", "prompt": 4, "send": send, "end": times[-1] if times else send,
            "times": times, "status": "OK", "error": "", "tokens": len(times), "timings": None}


def _loads(*pairs):
    from services.common.gen.lorafleet.v1 import common_pb2, worker_pb2
    return [worker_pb2.ColdLoadRecord(seq=i + 1, adapter_id=a, tier=common_pb2.SOURCE,
                                      total_s=t, fetch_s=t / 2, end_unix_s=1.0 + t)
            for i, (a, t) in enumerate(pairs)]


def test_a_first_use_row_takes_the_cold_requests_their_loads_and_the_gaps_beside_them():
    base = _rec(0.0, [0.1, 0.2, 0.3, 0.8, 0.9, 1.0])              # a 0.5 s gap at 0.3-0.8
    cold = [_rec(0.25, [0.45, 0.6], True, "a"), _rec(0.5, [0.7, 0.8], True, "b")]
    loads = _loads(("a", 0.1), ("b", 0.05), ("other", 9.0))
    r = rep.first_use_row("one-at-a-time", 1, [base, *cold], loads, ["a", "b"], 1, {})
    assert set(rep.ROW_FIELDS) <= set(r)
    assert r["ttft_p50_ms"] == pytest.approx(200.0) and r["ttft_p99_ms"] == pytest.approx(200.0)
    assert r["cold_loads"] == 2 and r["cold_adapters_loaded"] == 2
    assert r["cold_p50_ms"] == r["cold_p99_ms"] == pytest.approx(100.0)   # nearest rank
    assert r["stages"]["fetch_s"]["p99_ms"] == pytest.approx(50.0)
    assert r["cold_tiers"] == {"source": 2} and r["wait_windows"] == 2
    assert r["others_itl_p99_ms"] == pytest.approx(500.0)           # the gap over both waits
    assert r["others_itl_p99_outside_ms"] == pytest.approx(100.0)
    assert r["base_ttft_p50_ms"] == pytest.approx(100.0) and r["window_ms"] == pytest.approx(450)
    alone = rep.background_row("background", [base], 1, {})
    rows = [alone, r]
    rep.link(rows)
    assert r["others_itl_p99_ratio"] == pytest.approx(1.0)


def _doc(parts, card="AMD EPYC", rows=(), **start):
    return {"header": {"card": card, "device": "cpu", "commit": "abc", "date": "d"},
            "parts": parts, "rows": list(rows), **({"start": start} if start else {})}


def test_parts_merge_in_order_and_mixed_or_repeated_parts_are_refused():
    row = {k: None for k in rep.ROW_FIELDS}
    start = dict(cold_start_s=9.0, warm_start_s=3.0, first_run_tok_s=90.0, second_run_tok_s=100.0)
    doc = rep.merge([_doc(["start"], rows=[{**row, "scenario": "first-run"}], **start),
                     _doc(["burst", "one"], rows=[{**row, "scenario": "burst"}])])
    assert set(doc) == {"header", "rows", *rep.START_FIELDS}
    assert [r["scenario"] for r in doc["rows"]] == ["burst", "first-run"]
    assert list(doc["header"]["parts"]) == ["burst+one", "start"] and doc["cold_start_s"] == 9.0
    md = rep.markdown(doc)
    assert "| burst |" in md and "first run >= 90% of the second's tok/s: met" in md
    with pytest.raises(SystemExit, match="twice"):
        rep.merge([_doc(["burst"]), _doc(["burst", "churn"])])
    with pytest.raises(SystemExit, match="different cards"):
        rep.merge([_doc(["burst"]), _doc(["start"], card="NVIDIA H100")])


def _sane(r: dict) -> None:
    for lo, hi in (("ttft_p50_ms", "ttft_p99_ms"), ("cold_p50_ms", "cold_p99_ms")):
        if r[lo] is not None:
            assert 0 < r[lo] <= r[hi], (r["scenario"], lo)
    assert r["others_itl_p99_ms"] > 0 and not r["errors"], r["scenario"]


@pytest.mark.slow
def test_the_quick_run_writes_its_schema_with_sane_figures(tmp_path):
    out = tmp_path / "out"
    # the stack's parts; the start part is bench.stack.startup's own run, which
    # tests/test_serve_bench.py runs (its merge: the test above); the churn over 64 adapters
    # (still over twice what the 3 MiB pool holds), 96 requests
    proc = subprocess.run([sys.executable, "-m", "bench.serve.first_touch", "--quick", "--out",
                           str(out), "--work", str(tmp_path / "work"),
                           "--parts", "burst,one,churn", "--churn-adapters", "64",
                           "--churn-requests", "96"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads((out / "first-touch-cpu.json").read_text())
    assert set(doc) == {"header", "rows", *rep.START_FIELDS}
    assert all(doc[key] is None for key in rep.START_FIELDS)      # the start part not run
    by = {r["scenario"]: r for r in doc["rows"]}
    assert list(by) == ["background", "burst", "one-at-a-time", "churn"]
    for r in by.values():
        assert set(rep.ROW_FIELDS) <= set(r), r["scenario"]
        _sane(r)
    burst, one, churn = by["burst"], by["one-at-a-time"], by["churn"]
    # every never-used adapter really loaded cold, all waiting at once (one window) in the burst,
    # one after another in the chain (a window each)
    assert burst["adapters_at_once"] == burst["requests"] == burst["ok"] == 8
    assert burst["cold_adapters_loaded"] == 8 and burst["cold_loads"] >= 8
    assert burst["wait_windows"] == 1 and burst["others_itl_p99_ratio"] > 0
    assert one["requests"] == one["ok"] == one["cold_adapters_loaded"] == one["wait_windows"] == 4
    assert one["base_ttft_p50_ms"] > 0
    assert set(churn["cold_tiers"]) == {"source"} and churn["cold_loads"] > 0
    assert churn["by_tier"]["source"]["n"] == churn["cold_loads"]
    for r in (burst, one, churn):
        assert r["stages"]["fetch_s"]["p50_ms"] is not None, r["scenario"]
    md = (out / "first-touch-cpu.md").read_text()
    assert "| scenario | adapters at once |" in md
    assert all(f"| {name} |" in md for name in by)
    merged = sorted((out / "first-touch-parts").glob("*.json"))
    assert [p.name for p in merged] == ["burst+one+churn-cpu.json"]
    again = subprocess.run([sys.executable, "-m", "bench.serve.first_touch", "--merge",
                            *map(str, merged), "--out", str(tmp_path / "m")], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((tmp_path / "m" / "first-touch-cpu.json").read_text())["rows"] == \
        doc["rows"]
