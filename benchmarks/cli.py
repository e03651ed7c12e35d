"""``cancelfl-bench <benchmark> [options]`` (also ``python -m benchmarks``).

Every benchmark module exposes ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> exit status``; this module only builds the parser from them and dispatches.
``cancelfl-bench all`` runs grid, attacks, overhead and scale with their defaults.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from types import ModuleType

import benchmarks as package
from benchmarks import (
    attacks,
    audit,
    clipping,
    defaults,
    grid,
    ladp,
    mpddp,
    nadp,
    niss,
    overhead,
    protocol_core,
    recovery,
    roundtime,
    scale,
)
from benchmarks.common import setup_process

#: Subcommand -> benchmark module, in the order ``--help`` lists them.
BENCHMARKS: dict[str, ModuleType] = {
    "grid": grid,
    "attacks": attacks,
    "overhead": overhead,
    "scale": scale,
    "protocol-core": protocol_core,
    "nadp": nadp,
    "niss": niss,
    "mpddp": mpddp,
    "ladp": ladp,
    "clipping": clipping,
    "recovery": recovery,
    "roundtime": roundtime,
    "defaults": defaults,
    "audit": audit,
}

#: What ``cancelfl-bench all`` runs, each with its defaults and ``--out <all's --out>/<name>``.
ALL = ("grid", "attacks", "overhead", "scale")


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Module docstrings verbatim, defaults after each option's help."""


def build_parser() -> argparse.ArgumentParser:
    """Argument parser of ``cancelfl-bench``: one subcommand per benchmark, plus ``all``."""
    parser = argparse.ArgumentParser(prog="cancelfl-bench", description=package.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for name, module in BENCHMARKS.items():
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.__doc__,
                                            formatter_class=_Formatter))
    everything = sub.add_parser("all", help=f"{', '.join(ALL)} with their defaults", formatter_class=_Formatter)
    everything.add_argument("--out", default="runs/bench")
    return parser


def _run(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    args = parser.parse_args(argv)
    args.command_line = "cancelfl-bench " + shlex.join(argv)
    return BENCHMARKS[args.benchmark].run(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cancelfl-bench``; returns the benchmark's exit status (e.g. niss: 1 if a check fails)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    undo = setup_process()
    t0 = time.perf_counter()
    try:
        if args.benchmark == "all":
            status = max(_run(parser, [name, "--out", str(Path(args.out) / name)]) for name in ALL)
        else:
            status = _run(parser, argv)
    finally:
        undo()
    print(f"benchmark '{args.benchmark}' finished in {time.perf_counter() - t0:.1f} s")
    return status
