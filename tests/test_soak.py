"""bench/stack/soak.py, briefly: the mixed traffic with a worker SIGKILLed and restarted and the
store restarted runs with no unexpected status, no unexplained error in any log, and every
KV block free at the end (the 10-minute run's summary: bench/results/soak-cpu.*)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.slow


def test_a_short_soak_with_faults_passes(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.stack.soak", "--minutes", "0.5",
                           "--clients", "4", "--fault-every", "10",
                           "--work", str(tmp_path / "work"),
                           "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    doc = json.loads((tmp_path / "out" / "soak-cpu.json").read_text())
    assert proc.returncode == 0, (doc["unexpected"][:5], doc["log_errors"][:5])
    kinds = {k.split(":")[0] for k in doc["requests"]}
    assert {"generate", "stream", "quota", "bad", "http_hangup"} <= kinds
    assert len(doc["faults"]) >= 2 and any("SIGKILL" in f["fault"] for f in doc["faults"])
    assert set(doc["kv_used_at_end"].values()) == {0.0}
