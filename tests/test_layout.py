"""The package layout: one import direction, no cycles, one method registry that everything agrees with.

The import test parses every non-test module with :mod:`ast` (static imports, including those inside
functions) and fails on an import that points up the order, on ``protocols`` importing Flower, on
``strategies`` and ``client`` importing each other (both ends share only ``protocols``: the task in
``protocols.task``, the wire vocabulary in ``protocols.wire``), and on a cycle between modules.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ORDER = ("benchmarks", "server", "strategies", "client", "protocols")  # a package may import only packages to its right
RANK = {p: i for i, p in enumerate(ORDER)}
#: Packages that never import each other, whatever their order: the two ends of every message.
APART = {"strategies": "client", "client": "strategies"}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in ORDER:
        for path in (ROOT / pkg).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _imports(path: Path, module: str) -> list[tuple[str, int]]:
    """Absolute names of everything ``path`` imports, with line numbers (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_pkg else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((base, node.lineno))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return out


def layout_violations(modules: dict[str, Path] | None = None) -> list[str]:
    """Every upward import, Flower import in ``protocols``, import between ``strategies`` and ``client``, and cycle."""
    modules = modules if modules is not None else _modules()
    problems: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        own = mod.split(".")[0]
        for name, line in _imports(path, mod):
            top = name.split(".")[0]
            where = f"{path.relative_to(ROOT)}:{line}"
            if own == "protocols" and top == "flwr":
                problems.append(f"{where}: protocols/ must not import Flower ({name})")
            if top in RANK and RANK[top] < RANK[own]:
                problems.append(f"{where}: {own}/ imports {name}, which is above it ({' -> '.join(ORDER)})")
            if APART.get(own) == top:
                problems.append(f"{where}: {own}/ imports {name}; strategies/ and client/ share only protocols/")
            if name in modules and name != mod:
                graph[mod].add(name)
    # Cycles (Tarjan's strongly connected components).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            # A package's __init__ re-exporting its own submodules is not a cycle between files.
            comp = [c for c in comp if not any(o.startswith(c + ".") for o in comp)]
            if len(comp) > 1:
                problems.append(f"import cycle between {', '.join(sorted(comp))}")

    for v in graph:
        if v not in index:
            visit(v)
    return problems


def test_imports_run_one_way_without_cycles():
    problems = layout_violations()
    assert not problems, "\n".join(problems)


def test_the_checker_catches_an_upward_import(tmp_path):
    """The checker is not vacuous: an upward import, Flower in protocols, strategies/client imports, a cycle."""
    for pkg in ("protocols", "client", "strategies"):
        (tmp_path / pkg).mkdir()
    up = tmp_path / "protocols" / "bad.py"
    up.write_text("from client.records import to_record\nimport flwr\n")
    a, b = tmp_path / "client" / "a.py", tmp_path / "client" / "b.py"
    a.write_text("from client import b\n")
    b.write_text("import client.a\n")
    s = tmp_path / "strategies" / "s.py"
    s.write_text("def f():\n    from client.pairwise_phase import roster_round_of\n")
    c = tmp_path / "client" / "c.py"
    c.write_text("from strategies.records import to_record\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        problems = layout_violations({"protocols.bad": up, "client.a": a, "client.b": b, "strategies.s": s,
                                      "client.c": c})
    finally:
        ROOT = saved
    assert any("imports client.records" in p for p in problems)
    assert any("must not import Flower" in p for p in problems)
    assert any("cycle" in p and "client.a" in p and "client.b" in p for p in problems)
    assert any(p.startswith("strategies/s.py:2") and "share only protocols" in p for p in problems)
    assert any(p.startswith("client/c.py:1") and "share only protocols" in p for p in problems)


def test_the_shared_homes_are_checked():
    """The task and the wire vocabulary are modules of the walk (so their imports are checked like any other)."""
    modules = _modules()
    for name in ("protocols.task.data", "protocols.task.models", "protocols.task.training", "protocols.wire.arrays",
                 "protocols.wire.common", "protocols.wire.niss", "protocols.wire.intermediate.stub"):
        assert name in modules, name
    assert not any(m.startswith(("client.messages", "client.intermediate")) for m in modules)


#: Most lines a Python module may have (packages, tests, examples and docs alike).
LINE_LIMIT = 500


def test_no_module_over_500_lines():
    files = [p for d in (*ORDER, "tests", "examples", "docs") for p in (ROOT / d).rglob("*.py")
             if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]
    assert len(files) > 100  # the walk finds the project
    long = [f"{rel}: {n}" for p in files
            if (n := len(p.read_text().splitlines())) > LINE_LIMIT and (rel := p.relative_to(ROOT))]
    assert not long, long


GRID_NAMES = ("grid", "_grid")


def grid_kept(paths: list[Path]) -> list[str]:
    """Places where a strategy keeps a grid on itself.

    ``self.grid`` / ``self._grid`` assigned in any form (``setattr`` included) or a class attribute of that name.
    """
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                targets = [node.target]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in GRID_NAMES):
                found.append(f"{path.name}:{node.lineno}: setattr {node.args[1].value}")
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if (isinstance(item, ast.AnnAssign | ast.Assign) and any(
                            isinstance(t, ast.Name) and t.id in GRID_NAMES
                            for t in (item.targets if isinstance(item, ast.Assign) else [item.target]))):
                        found.append(f"{path.name}:{item.lineno}: class attribute of {node.name}")
            for t in targets:
                for sub in ast.walk(t):
                    if (isinstance(sub, ast.Attribute) and sub.attr in GRID_NAMES and isinstance(sub.value, ast.Name)
                            and sub.value.id == "self"):
                        found.append(f"{path.name}:{node.lineno}: self.{sub.attr}")
    return found


def test_no_strategy_keeps_the_grid():
    """The round stages get the grid as an argument (strategies.stages); no strategy stores it."""
    found = grid_kept(sorted((ROOT / "strategies").rglob("*.py")))
    assert not found, found


def test_the_grid_check_catches_each_form(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("class S:\n    grid: object = None\n\n    def f(self, grid):\n        self.grid = grid\n"
                   "        self._grid: object = grid\n        setattr(self, 'grid', grid)\n        a = self.grid\n")
    found = grid_kept([bad])
    assert [f.split(": ", 1)[1] for f in found] == ["class attribute of S", "self.grid", "self._grid", "setattr grid"]


@pytest.mark.parametrize("method", list(importlib.import_module("protocols.methods").METHOD_NAMES))
def test_registry_entries_resolve(method):
    """Every method of the registry has a strategy, a train handler and its query handlers."""
    from client.methods import query_handler, train_handler
    from protocols.config import RunConfig
    from protocols.methods import method_spec
    from strategies.registry import strategy_class

    spec = method_spec(method)
    assert callable(train_handler(method))
    for action in spec.queries:
        assert callable(query_handler(method, action))
    assert RunConfig(method=method).method == method  # the config accepts every registered method
    assert strategy_class(method).__name__ == spec.strategy.split(":")[1]
