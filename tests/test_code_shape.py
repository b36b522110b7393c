"""Issue 24's shape of the code, kept: no module in services/ or kernels/ over 400 lines, no
function in services/ over 60 (the generated stubs aside)."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _sources(top: str):
    return [p for p in sorted((ROOT / top).rglob("*.py")) if "gen" not in p.parts]


def test_no_module_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in _sources("services") + _sources("kernels")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_no_service_function_over_60_lines():
    long = {}
    for p in _sources("services"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long[f"{p.relative_to(ROOT)}:{node.name}"] = n
    assert not long, long
