"""The shape of the code. Issue 24's, kept: no module in services/ or kernels/ over 400 lines,
no function in services/ over 60 (the generated stubs aside). Issue 44's: no import cycle in
services/, kernels/ or bench/ (`import_cycles(top)`, for any top folder), the worker's parts import
only downwards in a declared order, at most 8 modules directly in services/worker/, Engine.step
about ten lines, and bench/ in packages by level (no module at its top but __init__, imports only
to lib/ or an earlier level)."""
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


# --- the import graph (issue 44) -------------------------------------------------------------

def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: pathlib.Path) -> bool:
    return path.name == "__init__.py"


def _imports(path: pathlib.Path, module_level: bool) -> set[str]:
    """The dotted names a module imports (module_level: only the imports that run when it is
    imported, not those inside functions or classes); `from a import b` gives a.b and a (b may
    be a module or a name in a), a relative import its absolute name."""
    tree = ast.parse(path.read_text())
    here = _module_name(path).split(".")
    package = here if _is_package(path) else here[:-1]
    nodes = tree.body if module_level else list(ast.walk(tree))
    if module_level:                       # and those in module-level if/try blocks
        todo, nodes = list(tree.body), []
        while todo:
            node = todo.pop()
            nodes.append(node)
            if isinstance(node, (ast.If, ast.Try)):
                todo += node.body + node.orelse + getattr(node, "finalbody", [])
                todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names if a.name != "*"}
    return out


def _graph(top: str) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports when it is imported (a module's
    packages included: importing a.b.c runs a and a.b first)."""
    mods = {_module_name(p): p for p in _sources(top)}
    graph = {}
    for name, path in mods.items():
        edges = set()
        for imp in _imports(path, module_level=True):
            parts = imp.split(".")
            for i in range(1, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in mods and dep != name:
                    edges.add(dep)
        graph[name] = edges
    return graph


def import_cycles(top: str) -> list[list[str]]:
    """Every import cycle among the modules under the folder `top` (module-level imports), as
    the modules of each strongly connected component of more than one module."""
    graph = _graph(top)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:                     # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_services_kernels_or_bench():
    for top in ("services", "kernels", "bench"):
        assert import_cycles(top) == [], top


# The worker's parts, lowest first: a module may import from its own part and the parts before
# it, never from one after it (any import, in functions too). The top-level modules are parts
# of their own: the performance choices and the metrics below everything, the config (which
# reads the checkpoint's spec) below what it configures, the app and __main__ on top.
WORKER_ORDER = ("perf_config", "metrics", "model", "config", "engine", "executor", "adapters",
                "startup", "api", "app", "__main__")


def _worker_part(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["services", "worker"] or len(parts) < 3:
        return None
    return parts[2]


def test_the_worker_imports_only_downwards():
    worker = ROOT / "services" / "worker"
    parts = {p.stem if p.is_file() else p.name for p in worker.iterdir()
             if (p.is_file() and p.suffix == ".py" and p.name != "__init__.py")
             or (p.is_dir() and (p / "__init__.py").exists())}
    assert parts == set(WORKER_ORDER), parts ^ set(WORKER_ORDER)
    rank = {name: i for i, name in enumerate(WORKER_ORDER)}
    upward = []
    for path in sorted(worker.rglob("*.py")):
        mine = _worker_part(_module_name(path))
        if mine is None:
            continue
        for imp in _imports(path, module_level=False):
            theirs = _worker_part(imp)
            if theirs in rank and rank[theirs] > rank[mine]:
                upward.append(f"{path.relative_to(ROOT)} imports {imp}")
    assert not upward, upward


def test_at_most_8_modules_directly_in_the_worker():
    flat = sorted(p.name for p in (ROOT / "services" / "worker").glob("*.py"))
    assert len(flat) <= 8, flat


def test_the_engine_step_is_about_ten_lines():
    """Engine.step: schedule, launch, post-process; the bookkeeping is the scheduler's."""
    tree = ast.parse((ROOT / "services" / "worker" / "engine" / "loop.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    step = next(n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "step")
    assert step.end_lineno - step.lineno + 1 <= 12


def test_the_cycle_finder_finds_one(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from .. import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg import a, c\n\n\ndef f():\n    import pkg.d\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert import_cycles("pkg") == [["pkg.a", "pkg.c", "pkg.sub.b"]]


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
