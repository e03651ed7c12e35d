"""Nothing outside a method's unit branches on its name.

A method's unit is its card ``protocols/methods/<card>.py`` and the same-named ``strategies/<card>.py``,
``client/methods/<card>.py`` and ``server/audits/<card>.py`` (its audit adapter); a card may register several
methods (the MP family).  The check parses every module of the packages with :mod:`ast` and reports, outside the
unit of the card that registers the name:

* a comparison (``==``, ``!=``, ``in``, ``not in``, ``match`` cases) with a method-name string literal, or a
  tuple/list/set display holding one;
* a dispatch table: a dict display keyed by a method name whose values include code (a function, class or lambda);
* in ``server/``, ``strategies/``, ``client/`` and ``protocols/``: any table of method names, i.e. a dict display
  keyed by one, or a tuple/list/set display holding one bound to a name (a fact about a method belongs on its card).

The benchmarks may name the methods they run (arms, acceptance rules) but not dispatch on them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from protocols.methods import METHODS, MethodSpec, method_names, reference_method, register

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("benchmarks", "server", "strategies", "client", "protocols")
#: A card's unit: these paths, formatted with the card's module name.
UNIT_HOMES = ("protocols/methods/{}.py", "strategies/{}.py", "client/methods/{}.py", "server/audits/{}.py")


def card_names(root: Path = ROOT) -> dict[str, set[str]]:
    """Card module name -> the method names its ``MethodSpec("name", ...)`` calls register."""
    out: dict[str, set[str]] = {}
    for path in sorted((root / "protocols" / "methods").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "MethodSpec" and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                out.setdefault(path.stem, set()).add(node.args[0].value)
    return out


def _literals(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def compared_names(source: str, names: set[str]) -> set[str]:
    """The method names in ``names`` that ``source`` compares with (or matches a ``case`` on)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                found |= _literals(side) & names
        elif isinstance(node, ast.MatchValue):
            found |= _literals(node.value) & names
    return found


def _code(node: ast.AST) -> bool:
    """A value that is code: a name, attribute, lambda, or a tuple whose first element is one."""
    if isinstance(node, ast.Tuple) and node.elts:
        node = node.elts[0]
    return isinstance(node, ast.Name | ast.Attribute | ast.Lambda)


def tabled_names(source: str, names: set[str], *, dispatch_only: bool) -> set[str]:
    """The method names in ``names`` that ``source`` keys a dict display with or binds in a name table.

    ``dispatch_only``: only dict displays whose values include code (:func:`_code`) count.
    """
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)} & names
            if keys and (not dispatch_only or any(_code(v) for v in node.values)):
                found |= keys
        elif not dispatch_only and isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            if isinstance(node.value, ast.Tuple | ast.List | ast.Set):
                found |= _literals(node.value) & names
    return found


def branches_outside_units(root: Path = ROOT) -> dict[str, set[str]]:
    """Module path (relative to ``root``) -> the method names it compares with although not of its unit."""
    cards = card_names(root)
    names = set().union(*cards.values())
    own = {home.format(card): registered for card, registered in cards.items() for home in UNIT_HOMES}
    out: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            source = path.read_text()
            used = compared_names(source, names) | tabled_names(source, names, dispatch_only=pkg == "benchmarks")
            stray = used - own.get(rel, set())
            if stray:
                out[rel] = stray
    return out


def test_every_registered_method_has_a_card_the_check_knows():
    assert set().union(*card_names().values()) == set(method_names())


def test_no_module_outside_a_method_unit_compares_its_name():
    found = branches_outside_units()
    assert not found, f"method names compared outside their unit (declare it on the card or its adapter): {found}"


def test_the_reference_arm_is_data_on_one_card():
    """The benchmarks' reference arm is the method whose card sets ``reference`` (FedAvg); a second one is refused."""
    assert reference_method() == "fedavg" and not METHODS["fedavg"].units
    assert [name for name, spec in METHODS.items() if spec.reference] == ["fedavg"]
    with pytest.raises(ValueError, match="reference arm is already 'fedavg'"):
        register(MethodSpec("second-reference", "strategies.baselines:FedAvgStrategy",
                            "client.methods.baselines:train_fedavg", units=(), reference=True))
    assert "second-reference" not in METHODS


def test_the_check_catches_a_planted_comparison(tmp_path):
    """Not vacuous: comparisons outside the unit, or with another card's name inside one, are reported."""
    (tmp_path / "protocols" / "methods").mkdir(parents=True)
    (tmp_path / "protocols" / "methods" / "nadp.py").write_text('register(MethodSpec("nadp", "s", "t"))\n')
    (tmp_path / "protocols" / "methods" / "mp.py").write_text(
        'register(MethodSpec("mpddp", "s", "t"))\nregister(MethodSpec("mpcdp", "s", "t"))\n')
    for d in ("server", "strategies", "client/methods", "benchmarks"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
    (tmp_path / "server" / "audit.py").write_text(
        '"""Audits nadp."""\nKEYS = {"nadp": 1}\n\n\ndef f(cfg, m):\n    if cfg.method == "nadp":\n        return 1\n'
        '    if m in ("mpcdp", "other"):\n        return 2\n    match m:\n        case "mpddp":\n            return 3\n')
    (tmp_path / "strategies" / "nadp.py").write_text('def f(m):\n    return m == "nadp" or m != "mpddp"\n')
    (tmp_path / "client" / "methods" / "mp.py").write_text('def f(m):\n    return m == "mpcdp" or "mpddp" == m\n')
    (tmp_path / "benchmarks" / "clean.py").write_text(
        'ROWS = ("nadp", "mpddp")\nGOAL = {"nadp": 1.1}\nprint(ROWS[0] + "nadp")\n')
    (tmp_path / "benchmarks" / "views.py").write_text(
        'def f(c):\n    return c\n\n\nVIEWS = {"nadp": f, "mpcdp": (f, "note"), "other": 1}\n')
    (tmp_path / "protocols" / "spec.py").write_text(
        'SPARSE: tuple[str, ...] = ("nadp", "x")\nLR = {"mpddp": "mpddp-server-lr"}\n')
    assert branches_outside_units(tmp_path) == {"server/audit.py": {"nadp", "mpcdp", "mpddp"},
                                                "strategies/nadp.py": {"mpddp"},
                                                "benchmarks/views.py": {"nadp", "mpcdp"},
                                                "protocols/spec.py": {"nadp", "mpddp"}}
