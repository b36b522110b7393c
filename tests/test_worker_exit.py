"""A worker's exit leaves nothing behind and says nothing it need not (issue 41, friction): a
SIGKILLed worker's `lorafleet-worker-*` directory is removed by the next worker to start, a
drained one removes its own, and a clean exit prints none of nanobind's leak report on Triton's
objects (~27 lines a worker before); an error still ends a process as errors do."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

from services.worker.api.frontend_process import socket_parent
from tests.support import MODEL_DIR, ROOT, Service

pytestmark = pytest.mark.slow
CLOSED_STORE = "127.0.0.1:1"          # never contacted: no adapter is used here


def worker(tmp_path, tmpdir) -> Service:
    return Service("worker", ["--model", str(MODEL_DIR), "--store", CLOSED_STORE,
                              "--device", "cpu"], tmp_path, env={"TMPDIR": str(tmpdir)}).wait()


def owned(tmpdir, pid: int) -> list[str]:
    return [p.name for p in tmpdir.glob(f"lorafleet-worker-{pid}-*")]


@pytest.fixture
def tmpdir():
    """A TMPDIR short enough for the core's unix socket under it (tmp_path may not be)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="lfw-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_killed_workers_directory_is_cleared_and_a_clean_exit_is_quiet(tmp_path, tmpdir):
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


def test_a_temporary_directory_too_deep_for_a_unix_socket_puts_it_in_tmp(tmp_path):
    """A TMPDIR whose path leaves no room for the core's socket (107 bytes) is not used for
    it: the worker serves, its socket directory in /tmp (it failed to bind before)."""
    deep = tmp_path / ("d" * 60) / ("e" * 40)
    deep.mkdir(parents=True)
    assert socket_parent(str(deep)) == "/tmp" and socket_parent("/tmp") == "/tmp"
    w = worker(tmp_path, deep)
    try:
        assert list(pathlib.Path("/tmp").glob(f"lorafleet-worker-{w.proc.pid}-*"))
        assert not list(deep.iterdir())
    finally:
        assert w.terminate() == 0


def test_exit_process_runs_the_exit_handlers_and_keeps_the_code():
    """The quiet exit still flushes what atexit would (tracing, logging) and keeps the code;
    an exception never reaches it (it prints its traceback as usual)."""
    code = ("import atexit, sys; from services.common.runtime import exit_process; "
            "atexit.register(lambda: print('flushed', flush=True)); exit_process(3)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == (3, "flushed"), proc.stderr
