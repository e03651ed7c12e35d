"""``cancelfl compare``: several methods at one epsilon, side by side, with a report.

    cancelfl compare --engine simulation --methods fedavg,ldp,cdp,nadp,nadp-record-ldp --epsilon 1 --out runs/compare

Each method runs with the same federation (dataset, clients, seed), the same whole-run privacy
target ``epsilon`` and its own default regime (rounds, local steps, learning rate: the keys left
``"auto"``, :func:`protocols.methods.regime`), in its own folder ``<out>/<method>``; then
:func:`strategies.run.report.write_report` writes ``<out>/report.md`` with the accuracy per round
of every method, the epsilon each spent in both directions, and the noise in one upload
against the noise left in the model -- what noise that cancels on aggregation buys.

``--engine simulation`` runs every method through Flower's simulation runtime on one
private SuperLink (started once, :func:`server.deploy.run_simulations`); ``inprocess``
runs the same ServerApp and ClientApp code on the in-process grid (seconds; tests).
Method names are the registered methods plus their variants (:data:`protocols.methods.VARIANTS`,
e.g. ``nadp-record-ldp``: NADP's training and noise per upload without the cancelling pairs).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

from protocols.config import RunConfig
from protocols.methods import METHODS, VARIANTS, method_or_variant
from server.defaults import app_defaults
from strategies.run.report import RunData, write_report

DEFAULT_METHODS = "fedavg,ldp,cdp,nadp,nadp-record-ldp"

#: ``cancelfl compare --help``'s description (plain text).
DESCRIPTION = """\
Run several methods with the same data, clients and privacy target (--epsilon), each with
its own default settings, then write <out>/report.md: one verdict line (the DP method that
protects the most, with the best accuracy, against the others), a table of final figures,
and plots of accuracy, epsilon spent (uploads and published model) and noise per round.
Each method's run is in <out>/<method>.
"""


def method_runs(names: list[str], epsilon: float, out: Path, overrides: dict) -> dict[str, dict]:
    """Run-config overrides of every compared method (label -> overrides)."""
    runs = {}
    for name in names:
        method, extra = method_or_variant(name)
        runs[name] = {**extra, **overrides, "method": method,
                      "epsilon": float(epsilon), "out-dir": str(out / name)}
    return runs


def compare(names: list[str], *, epsilon: float, out: Path, engine: str = "inprocess",
            overrides: dict | None = None, command: str = "",
            inprocess: Callable[..., object] | None = None, verbose: bool = False,
            check: Callable[..., object] | None = None) -> tuple[Path, list[str]]:
    """Run every method in ``names`` and write the side-by-side report.

    Returns ``<out>/report.md`` and the methods that did not finish (their exit code was not 0).

    ``inprocess(overrides, verbose=...)`` runs one method on the in-process engine (the launcher's
    :func:`server.launch.run_inprocess`; needed for ``engine="inprocess"``); ``verbose``: detailed round lines;
    ``check(overrides, warn=...)``: every method's start checks before any method runs (the launcher's
    :func:`server.launch.preflight`; its notes go to ``warn``), so a setting one method refuses stops the comparison
    before the others spend their time.

    Raises:
        ValueError: a bad run-config key or value, or (``check``) settings a method refuses at start, naming it.
    """
    out = Path(out).resolve()
    runs = method_runs(names, epsilon, out, dict(overrides or {}))
    for name, cfg in runs.items():
        RunConfig.from_mapping({**app_defaults(), **cfg})  # fail fast, naming the bad key
        if check is not None:
            try:
                check(cfg, warn=lambda note, name=name: print(f"cancelfl compare: {name}: warning: {note}",
                                                               file=sys.stderr))
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from err
    notes: list[str] = []
    t0 = time.perf_counter()
    if engine == "simulation":
        from server.deploy import run_simulations

        codes = run_simulations(list(runs.values()), verbose=verbose, notes_shown=check is not None)
    else:
        if inprocess is None:
            raise ValueError("compare: the in-process engine needs the launcher's runner (inprocess=run_inprocess)")
        codes = []
        for name, cfg in runs.items():
            print(f"== {name}", flush=True)
            try:
                inprocess(cfg, verbose=verbose, **({"checked": True} if check is not None else {}))
                codes.append(0)
            except Exception as err:  # noqa: BLE001 - one method's failure (e.g. divergence) is reported, not fatal
                print(f"cancelfl compare: {name}: {err}", file=sys.stderr)
                notes.append(f"`{name}` stopped: {err}")
                codes.append(1)
    done, failed = {}, [name for name, code in zip(runs, codes, strict=True) if code != 0]
    for (name, cfg), code in zip(runs.items(), codes, strict=True):
        metrics = Path(cfg["out-dir"]) / "metrics.jsonl"
        if metrics.is_file() and metrics.read_text().strip():
            done[name] = Path(cfg["out-dir"])
        if code != 0:
            notes.append(f"`{name}` did not finish (exit code {code}); its folder: {cfg['out-dir']}")
    if not done:
        raise RuntimeError("no method finished; nothing to report")
    for name, folder in done.items():
        settings = {k: v for k, v in runs[name].items() if k not in ("out-dir", "epsilon", "method")}
        regime = RunData.load(name, folder).summary.get("regime", {})
        notes.append(f"`{name}`: method's regime " + (" ".join(f"{k}={v!r}" for k, v in regime.items()) or "-")
                     + ("; set: " + " ".join(f"{k}={v!r}" for k, v in settings.items()) if settings else ""))
    notes.append(f"engine: {engine}; total wall time {time.perf_counter() - t0:.0f} s")
    report = write_report(done, out, title=f"cancelfl: methods side by side at epsilon = {epsilon:g}",
                          command=command, notes=notes)
    return report, failed


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``compare`` subcommand's options."""
    p.add_argument("--engine", choices=("inprocess", "simulation"), default="inprocess",
                   help="inprocess: in this process, no Ray (default); simulation: Flower's simulation, one SuperLink")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"comma-separated methods or variants (list below); default {DEFAULT_METHODS}")
    p.add_argument("--epsilon", type=float, default=1.0, help="whole-run privacy target of every method")
    p.add_argument("--out", default="", help="report folder (default: runs/compare-<date>-<time>, never overwritten)")
    p.add_argument("--run-config", default="", help="run-config for every method, e.g. 'num-rounds=10 dataset=\"mnist\"'")


def main(args: argparse.Namespace, overrides: dict, inprocess: Callable[[dict], object],
         check: Callable[..., object] | None = None) -> int:
    """Run ``cancelfl compare`` with parsed arguments; returns the exit code (2: refused before any method ran).

    ``inprocess``: the launcher's runner; ``check``: its start checks (:func:`compare`).
    """
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        if not names:
            raise ValueError(f"--methods {args.methods!r} names no method; known: {', '.join((*METHODS, *VARIANTS))}")
        for name in names:
            method_or_variant(name)
    except ValueError as err:
        print(f"cancelfl compare: {err}", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    if (out / "report.md").exists():
        print(f"cancelfl compare: {out} holds an earlier comparison; choose another --out (or none: a fresh folder)",
              file=sys.stderr)
        return 2
    command = "cancelfl " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else ""
    try:
        report, failed = compare(names, epsilon=args.epsilon, out=out, engine=args.engine, overrides=overrides,
                                 command=command, inprocess=inprocess, verbose=getattr(args, "verbose", False),
                                 check=check)
    except ValueError as err:
        print(f"cancelfl compare: {err}", file=sys.stderr)
        return 2
    if failed:
        print(f"cancelfl compare: report at {report} without {', '.join(failed)}, which did not finish (exit 1; "
              "the lines above say why)", file=sys.stderr)
        return 1
    print(f"cancelfl compare: report at {report}")
    return 0
