"""bench/README.md lists every benchmark entry point, one line each (`python -m bench.x.y`): each
one runs `--help` (exit 0, its usage printed), and every module of bench/ that runs as a script
is listed. The runs go in parallel (most import torch)."""
from __future__ import annotations

import ast
import concurrent.futures
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


def _help(module: str) -> tuple[str, int, str]:
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    return module, proc.returncode, proc.stdout + proc.stderr


def test_every_entry_point_prints_its_usage():
    modules = _listed()
    assert modules
    with concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        results = list(pool.map(_help, modules))
    bad = {m: (rc, out[-800:]) for m, rc, out in results if rc != 0 or "usage:" not in out}
    assert not bad, bad
