"""bench.engine.structured runs on the CPU with a tiny shape (--cpu), as the lead's GPU run
does on a card: the decode step at 0%, 50% and 100% constrained rows, the host mask time, the
compile times, written as structured-cpu.{json,md} with the date, card and versions."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT


def test_the_benchmark_runs_on_the_cpu_and_writes_its_results(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench.engine.structured", "--cpu",
                          "--out", str(tmp_path), "--new", "12", "--schemas", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads((tmp_path / "structured-cpu.json").read_text())
    head = doc["header"]
    assert head["card"] == "cpu" and head["date"] and head["llguidance"] and head["torch"]
    assert [r["fraction"] for r in doc["decode"]] == [0.0, 0.5, 1.0]
    for r in doc["decode"]:
        assert r["decode_step_ms"] > 0 and r["ended_early"] == 0
    assert doc["decode"][0]["mask_ms"] == 0 and doc["decode"][2]["mask_ms"] > 0
    assert len(doc["compile"]) == 6 and all(r["compile_ms"] > 0 for r in doc["compile"])
    md = (tmp_path / "structured-cpu.md").read_text()
    assert "| 100% (8) |" in md and "Compile, 6 schemas" in md
