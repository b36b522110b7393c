"""A worker's exit leaves nothing behind and says nothing it need not (issue 41, friction): a
SIGKILLed worker's `lorafleet-worker-*` directory is removed by the next worker to start, a
drained one removes its own, and a clean exit prints none of nanobind's leak report on Triton's
objects (~27 lines a worker before); an error still ends a process as errors do."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import MODEL_DIR, ROOT, Service

pytestmark = pytest.mark.slow
CLOSED_STORE = "127.0.0.1:1"          # never contacted: no adapter is used here


def worker(tmp_path, tmpdir) -> Service:
    return Service("worker", ["--model", str(MODEL_DIR), "--store", CLOSED_STORE,
                              "--device", "cpu"], tmp_path, env={"TMPDIR": str(tmpdir)}).wait()


def owned(tmpdir, pid: int) -> list[str]:
    return [p.name for p in tmpdir.glob(f"lorafleet-worker-{pid}-*")]


def test_a_killed_workers_directory_is_cleared_and_a_clean_exit_is_quiet(tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    first = worker(tmp_path, tmpdir)
    assert owned(tmpdir, first.proc.pid), list(tmpdir.iterdir())
    first.kill()                                        # SIGKILL: no cleanup of its own
    assert owned(tmpdir, first.proc.pid)
    second = worker(tmp_path, tmpdir)
    try:
        assert not owned(tmpdir, first.proc.pid), list(tmpdir.iterdir())
        assert owned(tmpdir, second.proc.pid)
    finally:
        code = second.terminate()
    assert code == 0, second.log()[-3000:]
    assert not list(tmpdir.glob("lorafleet-worker-*")), list(tmpdir.iterdir())
    assert "nanobind" not in second.log() and "leaked" not in second.log(), second.log()[-3000:]


def test_exit_process_runs_the_exit_handlers_and_keeps_the_code():
    """The quiet exit still flushes what atexit would (tracing, logging) and keeps the code;
    an exception never reaches it (it prints its traceback as usual)."""
    code = ("import atexit, sys; from services.common.runtime import exit_process; "
            "atexit.register(lambda: print('flushed', flush=True)); exit_process(3)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == (3, "flushed"), proc.stderr
