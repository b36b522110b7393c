"""Issue 24's shape of the code, kept: no module in services/ or kernels/ over 400 lines, no
function in services/ over 60 (the generated stubs aside). Issue 44's: bench/ in packages by level
(no module at its top but __init__, imports only to lib/ or an earlier level) with no import
cycle."""
from __future__ import annotations

import ast
import pathlib
import sys

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


def _import_cycles(top: str) -> list[list[str]]:
    """The import cycles among the modules under ROOT/top (generated stubs aside): the strongly
    connected components of more than one module of the graph of imports found anywhere in a
    module (a function's own imports too), each as its sorted module names. `from pkg import
    name` counts as an import of pkg.name where that is a module, else of pkg; a package's
    __init__ is not counted as imported with its submodules."""
    mods = {}
    for p in _sources(top):
        parts = p.relative_to(ROOT).with_suffix("").parts
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for a in node.names:
                    deps.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else known(base))
        graph[name] = {d for d in deps if d and d != name}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:              # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle_in_bench():
    assert not _import_cycles("bench")


def test_the_cycle_finder_finds_one(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from .. import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg import a, c\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _import_cycles("pkg") == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_bench_has_no_module_at_its_top_but_its_init():
    top = sorted(p.name for p in (ROOT / "bench").glob("*.py"))
    assert top == ["__init__.py"], top


BENCH_LEVELS = ("lib", "kernels", "engine", "serve", "capacity", "stack")   # bench/README.md


def test_bench_levels_import_only_lib_or_earlier_levels():
    wrong = []
    for p in _sources("bench"):
        parts = p.relative_to(ROOT / "bench").parts
        if len(parts) < 2:
            continue
        level = BENCH_LEVELS.index(parts[0])
        for node in ast.walk(ast.parse(p.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            for name in names:
                to = name.split(".")[1] if name.startswith("bench.") else None
                if to and BENCH_LEVELS.index(to) > level:
                    wrong.append(f"{p.relative_to(ROOT)} imports {name}")
    assert not wrong, wrong
