"""bench.engine.host_overhead runs on the CPU (tiny: batch 4, the stub forward, a few steps) and
times every phase of a graph decode step where the step now does that work: each phase is in its
JSON and markdown, and positive."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny-llama"


@pytest.mark.skipif(not (MODEL / "tokenizer.json").exists(), reason="no tiny model (make model)")
def test_host_overhead_times_every_phase_on_cpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engine.host_overhead", "--model", str(MODEL),
         "--batch", "4", "--forward", "stub", "--modes", "greedy", "sampled", "--steps", "3",
         "--warm", "1", "--repeats", "1", "--no-fill", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    from bench.engine.host_overhead import PHASES
    result = json.loads((tmp_path / "host-overhead-cpu.json").read_text())
    assert set(result["runs"]) == {"stub/4/greedy", "stub/4/sampled"}
    for key, run in result["runs"].items():
        assert run["steps"] == 3, key
        for phase in ("host", "forward", "host_minus_sample", *PHASES):
            assert run["us"][phase] > 0, (key, phase, run["us"])
    md = (tmp_path / "host-overhead-cpu.md").read_text()
    assert "| 4 | greedy |" in md and "| 4 | sampled |" in md
