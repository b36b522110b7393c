"""bench/README.md lists every benchmark entry point, one line each (`python -m bench.x.y`): each
one runs `--help` (exit 0, its usage printed), and every module of bench/ that runs as a script
is listed. The `--help` runs share one child process (most import torch: one import, not one
per entry point), each module run as `python -m` runs it (runpy, its own argv), its exit status
and output recorded on their own."""
from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "bench" / "README.md"


def _listed() -> list[str]:
    return re.findall(r"^- `python -m (bench(?:\.\w+)+)`", README.read_text(), re.M)


def _scripts() -> set[str]:
    """bench's modules with an `if __name__ == "__main__":` block."""
    out = set()
    for p in (ROOT / "bench").rglob("*.py"):
        for node in ast.parse(p.read_text()).body:
            if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                    and isinstance(node.test.left, ast.Name)
                    and node.test.left.id == "__name__"):
                out.add(".".join(p.relative_to(ROOT).with_suffix("").parts))
    return out


def test_the_readme_lists_every_entry_point_once():
    listed = _listed()
    assert len(listed) == len(set(listed)), listed
    assert set(listed) == _scripts()


def _help_all(modules: list[str]) -> dict[str, tuple[int, str]]:
    """{module: (exit status, output)} of `python -m MODULE --help` for each, in one child."""
    proc = subprocess.run([sys.executable, "-m", "tests.test_bench_entry_points", *modules],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["module"]] = (r["rc"], r["out"])
    for m in modules:       # one the child never finished (it died): its exit and stderr
        results.setdefault(m, (proc.returncode or -1, proc.stderr[-2000:]))
    return results


def test_every_entry_point_prints_its_usage():
    modules = _listed()
    assert modules
    results = _help_all(modules)
    bad = {m: (rc, out[-800:]) for m, (rc, out) in results.items()
           if rc != 0 or "usage:" not in out}
    assert not bad, bad


def _run_help(module: str) -> tuple[int, str]:
    """`python -m module --help` in this process: its exit status and what it printed."""
    import runpy
    import traceback
    buf = io.StringIO()
    rc = 0
    argv = sys.argv
    sys.argv = [module, "--help"]
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            except SystemExit as e:
                if e.code is None or isinstance(e.code, int):
                    rc = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
                    rc = 1
            except BaseException:                       # noqa: BLE001 - reported as a failure
                traceback.print_exc()
                rc = 1
    finally:
        sys.argv = argv
    return rc, buf.getvalue()


if __name__ == "__main__":              # the child: one JSON line per module
    out = sys.stdout
    for name in sys.argv[1:]:
        code, text = _run_help(name)
        out.write(json.dumps({"module": name, "rc": code, "out": text}) + "\n")
        out.flush()
