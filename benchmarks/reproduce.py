"""``cancelfl-bench reproduce <folder>``: rerun a recorded benchmark and fail when its figures no longer hold.

A results folder (``docs/results/<name>``) holds the tables a benchmark wrote and ``record.json`` with the
command that wrote them.  This reruns that command into a temporary folder and compares every ``.csv`` table
row by row: a number that moved by more than the tolerance, a text figure that changed (e.g. a goal met that
is no longer), a row or a column that disappeared, or another exit status is printed and makes the exit status 1.
A benchmark names the columns the docs quote in ``FIGURES`` (column -> relative tolerance) and the columns that
identify a row in ``KEY``; by default rows are matched on their first column and every numeric column is compared
at the default tolerance.  Exit status: 0 = reproduced, 1 = not, 2 = no record.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType

HELP = "rerun a recorded result (docs/results/<name>) and fail when a figure no longer reproduces"
DEFAULT_TOLERANCE = 0.25


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl-bench reproduce``."""
    p.add_argument("folder", help="a results folder with record.json (e.g. docs/results/roundtime)")
    p.add_argument("--tolerance", type=float, default=None,
                   help=f"relative tolerance for every compared column (default: the benchmark's FIGURES, else "
                        f"{DEFAULT_TOLERANCE})")
    p.add_argument("--keep", default="", help="write the rerun's tables into this folder instead of a temporary one")


def _rows(path: Path, key: tuple[str, ...]) -> tuple[list[str], dict[str, dict[str, str]]]:
    """(columns, row label -> row) of a CSV table; the label joins the ``key`` columns (default: the first)."""
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        columns = list(reader.fieldnames or [])
        rows = {}
        for row in reader:
            label = " / ".join(row.get(c, "") for c in (key or columns[:1]))
            while label in rows:  # repeated labels keep their order
                label += "'"
            rows[label] = row
    return columns, rows


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def compare_tables(recorded: Path, rerun: Path, figures: dict[str, float], tolerance: float | None,
                   key: tuple[str, ...] = ()) -> list[str]:
    """Every way the table ``rerun`` fails to reproduce ``recorded`` (empty list = reproduced).

    Args:
        recorded: the recorded CSV table.
        rerun: the same table written by the rerun.
        figures: column -> relative tolerance of the columns to compare; empty = every numeric column.
        tolerance: overrides every tolerance when given.
        key: the columns that identify a row (default: the first column).
    """
    if not rerun.is_file():
        return [f"{recorded.name}: the rerun wrote no such table"]
    cols_a, rows_a = _rows(recorded, key)
    cols_b, rows_b = _rows(rerun, key)
    problems = [f"{recorded.name}: column {c!r} is gone" for c in cols_a if c not in cols_b]
    checked = figures or {c: DEFAULT_TOLERANCE for c in cols_a[1:]}
    for label, row in rows_a.items():
        other = rows_b.get(label)
        if other is None:
            problems.append(f"{recorded.name}: row {label!r} is gone")
            continue
        for column, tol in checked.items():
            a, b = _number(row.get(column, "")), _number(other.get(column, ""))
            if a is None:
                if column in figures and row.get(column, "") != other.get(column, ""):  # a text figure: exact
                    problems.append(f"{recorded.name}: {label} {column}: recorded {row.get(column)!r}, "
                                    f"now {other.get(column)!r}")
                continue
            tol = tolerance if tolerance is not None else tol
            if b is None:
                problems.append(f"{recorded.name}: {label} {column}: recorded {a:g}, now {other.get(column)!r}")
            elif abs(b - a) > tol * max(abs(a), 1e-12):
                problems.append(f"{recorded.name}: {label} {column}: recorded {a:g}, now {b:g} "
                                f"({(b - a) / max(abs(a), 1e-12):+.0%}, tolerance {tol:.0%})")
    return problems


def _declared(module_of: Callable[[str], ModuleType], benchmark: str) -> tuple[dict[str, float], tuple[str, ...]]:
    """The benchmark module's ``FIGURES`` and ``KEY`` (empty when it declares none or is unknown)."""
    try:
        mod = module_of(benchmark)
    except (KeyError, ImportError):
        return {}, ()
    return dict(getattr(mod, "FIGURES", {})), tuple(getattr(mod, "KEY", ()))


def env_prefix(env: Mapping[str, str]) -> str:
    """``NAME=value `` for each setting, shell-quoted: how a record's command carries its environment."""
    return "".join(f"{k}={shlex.quote(v)} " for k, v in env.items())


def _rerun_argv(command: str, out: Path) -> tuple[dict[str, str], list[str]]:
    """``(environment, arguments)`` of a recorded command.

    The environment is its leading ``NAME=value`` settings; the arguments have the output folder replaced by ``out``.
    """
    argv = shlex.split(command)
    env = {}
    while argv and "=" in argv[0] and argv[0].split("=", 1)[0].isidentifier():
        name, value = argv.pop(0).split("=", 1)
        env[name] = value
    if argv and argv[0] == "cancelfl-bench":
        argv = argv[1:]
    if "--out" in argv:
        argv[argv.index("--out") + 1] = str(out)
    else:  # a positional output folder (nadp, niss, mpddp, ladp): the last argument
        argv[-1] = str(out)
    return env, argv


def run(args: argparse.Namespace, module_of: Callable[[str], ModuleType]) -> int:
    """Rerun the folder's recorded command and compare; see the module docstring for the exit status.

    ``module_of``: benchmark name -> its module (:func:`benchmarks.cli.module`), for its ``FIGURES`` and ``KEY``.
    """
    folder = Path(args.folder)
    path = folder / "record.json"
    if not path.is_file():
        print(f"cancelfl-bench reproduce: {path} does not exist (record a result with its --out first)", file=sys.stderr)
        return 2
    record = json.loads(path.read_text())
    tables = sorted(folder.glob("*.csv"))
    with tempfile.TemporaryDirectory(prefix="reproduce-") as tmp:
        out = Path(args.keep or tmp) / folder.name
        env, argv = _rerun_argv(record["command"], out)
        print(f"rerunning: {env_prefix(env)}cancelfl-bench {shlex.join(argv)}  (recorded {record.get('date')}, commit "
              f"{record.get('commit')})", flush=True)
        status = subprocess.run([sys.executable, "-m", "benchmarks", *argv], check=False,
                                env={**os.environ, **env}).returncode
        problems = [] if status == record.get("exit_status", 0) else [
            f"exit status {status}, recorded {record.get('exit_status')}"]
        figures, key = _declared(module_of, record.get("benchmark", ""))
        for table in tables:
            problems += compare_tables(table, out / table.name, figures, args.tolerance, key)
    if problems:
        print(f"NOT REPRODUCED: {folder} ({len(problems)} figure(s)); rerecord it with its command or fix the "
              "regression:", file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"reproduced: {folder} ({len(tables)} table(s) within tolerance)")
    return 0
