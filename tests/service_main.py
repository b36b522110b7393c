"""`python -m services.NAME ARGS` for many short runs (a service refusing its flags) at the cost
of one interpreter per service: a child process imports what the service's __main__ imports
(the worker's: torch, ~5 s of CPU a process) once, then forks a process per run, which runs the
service's __main__ as `python -m` would (runpy, its own argv, its stdout and stderr on files)
and exits with the interpreter's status: SystemExit's code, 1 and the traceback on an
exception. Each run's exit status and output are its own process's.

    runs = run_mains([("worker", ["--grace", "-1"]), ("router", [...])])
    runs[0].returncode, runs[0].stderr
"""
from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclass
class Ran:
    args: list
    returncode: int
    stdout: str
    stderr: str


def run_mains(runs: list[tuple[str, list[str]]], timeout: float = 60.0,
              env: dict | None = None) -> list[Ran]:
    """Each (service, args) run to its end in a process of its own, forked from one child per
    service (two services' modules in one process would register the same metric names)."""
    out: dict[int, Ran] = {}
    for service in dict.fromkeys(s for s, _ in runs):
        mine = [(i, a) for i, (s, a) in enumerate(runs) if s == service]
        payload = json.dumps({"service": service, "runs": [a for _, a in mine],
                              "timeout": timeout})
        proc = subprocess.run([sys.executable, "-m", "tests.service_main"], input=payload,
                              cwd=ROOT, capture_output=True, text=True,
                              timeout=60 + timeout * len(mine), env=env)
        done = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if len(done) != len(mine):
            raise RuntimeError(f"service_main {service} ended with {proc.returncode} after "
                               f"{len(done)} of {len(mine)} runs: {proc.stderr[-3000:]}")
        for (i, a), d in zip(mine, done):
            out[i] = Ran([service, *a], d["rc"], d["stdout"], d["stderr"])
    return [out[i] for i in range(len(runs))]


def _preimport(service: str) -> None:
    """The modules services/SERVICE/__main__.py imports at its top level."""
    import importlib
    tree = ast.parse((ROOT / "services" / service / "__main__.py").read_text())
    for node in tree.body:
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module
                 and not node.level else [])
        for name in names:
            importlib.import_module(name)


def _child(service: str, args: list[str], out: int, err: int) -> None:
    """In the forked process: the service's __main__ as `python -m services.SERVICE ARGS`."""
    import runpy
    import traceback
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.argv = [str(ROOT / "services" / service / "__main__.py"), *args]
    code = 0
    try:
        runpy.run_module(f"services.{service}", run_name="__main__", alter_sys=True)
    except SystemExit as e:                     # as the interpreter ends on it
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:                       # noqa: BLE001 - the interpreter's report
        traceback.print_exc()
        code = 1
    try:
        import logging
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


def _run_one(service: str, args: list[str], timeout: float) -> dict:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(service, args, out.fileno(), err.fileno())
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rc = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                rc = -9
                break
            time.sleep(0.01)
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
    return {"rc": rc, "stdout": texts[0], "stderr": texts[1]}


if __name__ == "__main__":
    job = json.loads(sys.stdin.read())
    _preimport(job["service"])
    for argv in job["runs"]:
        print(json.dumps(_run_one(job["service"], argv, job["timeout"])), flush=True)
