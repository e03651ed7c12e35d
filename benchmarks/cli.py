"""``cancelfl-bench <benchmark> [options]`` (also ``python -m benchmarks``).

Every benchmark module exposes ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> exit status``; this module only builds the parser from them and dispatches.
``cancelfl-bench all`` runs grid, attacks, overhead and scale with their defaults.

A benchmark that writes into an output folder also gets ``record.json`` there (:func:`write_record`): the
command, the UTC date, the machine and the commit that produced the folder's tables.  The documentation's
benchmarks page renders such folders from ``docs/results/`` (``docs/hooks.py``).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from types import ModuleType

import benchmarks as package
from benchmarks.reproduce import env_prefix
from server.cli_text import methods_text, plain_text

#: Subcommand -> benchmark module, in the order ``--help`` lists them.  A module is imported only when its
#: benchmark runs (or its own ``--help`` is asked for): they import torch and Flower, seconds each.
BENCHMARKS: dict[str, str] = {
    "grid": "benchmarks.grid",
    "attacks": "benchmarks.attacks",
    "overhead": "benchmarks.overhead",
    "scale": "benchmarks.scale",
    "protocol-core": "benchmarks.protocol_core",
    "nadp": "benchmarks.nadp",
    "niss": "benchmarks.niss",
    "mpddp": "benchmarks.mpddp",
    "ladp": "benchmarks.ladp",
    "clipping": "benchmarks.clipping",
    "recovery": "benchmarks.recovery",
    "cost": "benchmarks.cost",
    "roundtime": "benchmarks.roundtime",
    "defaults": "benchmarks.defaults",
    "audit": "benchmarks.audit",
}

#: What ``cancelfl-bench --help`` says first: what the benchmarks measure and how to start one (plain text).
DESCRIPTION = """\
Measure the methods: accuracy, privacy, attacks, time and bytes.  Every benchmark runs the
real app (in this process, or in Flower's simulation where it says so) and prints its tables;
with --out FOLDER it also writes them there, with record.json (command, date, machine,
commit).  cancelfl-bench <benchmark> --help lists a benchmark's options with their defaults.

Examples:
  cancelfl-bench defaults --datasets digits            every method with only method and dataset set
  cancelfl-bench roundtime --out /tmp/roundtime        round time of every method against FedAvg
  cancelfl-bench reproduce docs/results/roundtime      rerun a recorded result; exit 1 if a figure moved
"""

#: What ``cancelfl-bench all`` runs, each with its defaults and ``--out <all's --out>/<name>``.
ALL = ("grid", "attacks", "overhead", "scale")


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Module docstrings verbatim, defaults after each option's help."""


def module(name: str) -> ModuleType:
    """The benchmark module of subcommand ``name`` (imported now)."""
    return importlib.import_module(BENCHMARKS[name])


@cache
def summary(name: str) -> tuple[str, str]:
    """(``HELP`` line, docstring) of benchmark ``name``, read from its source without importing it."""
    spec = importlib.util.find_spec(BENCHMARKS[name])
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(BENCHMARKS[name])
    tree = ast.parse(Path(spec.origin).read_text())
    line = next((node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "HELP" for t in node.targets)
                 and isinstance(node.value, ast.Constant)), "")
    return str(line), ast.get_docstring(tree, clean=False) or ""


def build_parser(load: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """Argument parser of ``cancelfl-bench``: one subcommand per benchmark, plus ``all``.

    ``load``: the benchmarks whose options are added (their modules imported); None = every one.
    The others parse their name only, enough for the listing of ``cancelfl-bench --help``.
    """
    load = set(BENCHMARKS if load is None else load)
    parser = argparse.ArgumentParser(prog="cancelfl-bench", description=DESCRIPTION,
                                     epilog=f"methods (the names --methods takes):\n{methods_text()}\n\n"
                                            "run-config keys and defaults: cancelfl run --help",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for name in BENCHMARKS:
        line, doc = summary(name)
        p = sub.add_parser(name, help=line, description=plain_text(doc), formatter_class=_Formatter)
        if name in load:
            module(name).add_arguments(p)
    sub.add_parser("reproduce", help="rerun a recorded result (docs/results/<name>) and fail when a figure no longer "
                   "reproduces", add_help=False)
    everything = sub.add_parser("all", help=f"{', '.join(ALL)} with their defaults", formatter_class=_Formatter)
    everything.add_argument("--out", default="runs/bench")
    return parser


def _commit() -> str | None:
    """``git rev-parse HEAD`` of the source tree of this package (``+dirty`` with uncommitted changes), or None."""
    root = Path(package.__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def machine() -> dict:
    """What ran a benchmark: OS, CPU, core count, load average at start, Python and torch versions."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
            "python": platform.python_version(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


#: Environment variables that change what a benchmark measures (deployment processes); a record's command
#: starts with those that were set, and ``cancelfl-bench reproduce`` sets them again.
MEASURED_ENV = ("CANCELFL_DATA_CACHE", "CANCELFL_POLL_INTERVAL", "CANCELFL_WARM_CLIENTAPP", "CANCELFL_CLIENT_THREADS",
                "FLWR_SUPEREXEC_TASK_POLL_INTERVAL")


def write_record(out: Path, *, benchmark: str, command: str, status: int, started: str, wall_s: float,
                 host: dict, commit: str | None = None) -> Path:
    """Write ``out/record.json``: the provenance of the tables a benchmark wrote into ``out``.

    Args:
        out: the benchmark's output folder (created if missing).
        benchmark: subcommand name.
        command: the full command line.
        status: the benchmark's exit status.
        started: UTC start time, ISO 8601.
        wall_s: wall time in seconds.
        host: :func:`machine` taken at start (its load average is the start's).
        commit: the source commit taken at start (default: now; a benchmark writing its results into the tree
            makes it read dirty at the end).

    Returns:
        The path written.
    """
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(p.name for p in out.iterdir() if p.is_file() and p.name != "record.json")
    record = {"benchmark": benchmark, "command": command, "date": started, "machine": host,
              "commit": commit if commit is not None else _commit(),
              "exit_status": status, "wall_s": round(wall_s, 1), "files": files}
    path = out / "record.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def _run(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    args = parser.parse_args(argv)
    # Settings from the environment are part of what was measured: the record's command carries them.
    env = env_prefix({k: os.environ[k] for k in MEASURED_ENV if k in os.environ})
    args.command_line = env + "cancelfl-bench " + shlex.join(argv)
    out = getattr(args, "out", None) or getattr(args, "out_dir", None)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    host, commit, t0 = machine(), _commit(), time.perf_counter()
    status = module(args.benchmark).run(args)
    if out:
        write_record(Path(out), benchmark=args.benchmark, command=args.command_line, status=status, started=started,
                     wall_s=time.perf_counter() - t0, host=host, commit=commit)
    return status


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cancelfl-bench``; returns the benchmark's exit status (e.g. niss: 1 if a check fails)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["reproduce"]:  # a tool over recorded results, not a benchmark: no record of its own
        from benchmarks import reproduce

        p = argparse.ArgumentParser(prog="cancelfl-bench reproduce", description=plain_text(reproduce.__doc__ or ""),
                                    formatter_class=_Formatter)
        reproduce.add_arguments(p)
        return reproduce.run(p.parse_args(argv[1:]), module)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(ALL if chosen == "all" else [chosen] if chosen in BENCHMARKS else [])
    args = parser.parse_args(argv)
    from benchmarks.common import setup_process  # torch and Flower: only once a benchmark runs

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
