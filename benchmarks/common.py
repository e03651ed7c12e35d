"""What the benchmarks share: the method names they run, process set-up, options and result tables.

Method names come from the registry (:data:`protocols.methods.METHODS`); the benchmark-only
variants of a method (a method plus a few run-config keys) are declared once, in :data:`protocols.methods.VARIANTS`.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from protocols.methods import METHODS, VARIANTS, method_names, method_or_variant, reference_method
from strategies.run.report import pyplot, save_figure  # noqa: F401 - plotting has one home (lazy matplotlib, Agg backend)

#: ``--method-set`` default of the cost benchmarks: the papers' sparse pairing (mpddp: Theorem 11 needs n ~ 80
#: at K = 100; nadp: any n works).
SPARSE_PAIRING = ['nadp:graph="n-out"', "nadp:n-out=8", 'mpddp:graph="n-out"', "mpddp:n-out=80"]


# ==================================================================== methods
def benchmark_names() -> tuple[str, ...]:
    """What ``--methods all`` runs: every registered method, then the variants."""
    return (*method_names(), *VARIANTS)


def method_config(name: str) -> tuple[str, dict]:
    """(registered method, run-config the variant adds) of a method or variant name.

    Keys a benchmark leaves unset take the method's regime (:func:`protocols.methods.regime`).
    """
    return method_or_variant(name)


def family_of(name: str) -> str:
    """The registry family (baseline, pairwise, mpddp, ...) of a method or variant name."""
    return METHODS[VARIANTS.get(name, (name, {}))[0]].family


def private(name: str) -> bool:
    """Whether a method or variant name trains with DP (its card lists privacy units): it has an epsilon."""
    return bool(METHODS[VARIANTS.get(name, (name, {}))[0]].units)


def reference() -> str:
    """The arm the benchmarks measure the others against (its card sets ``reference``: FedAvg, no DP)."""
    return reference_method()


def with_reference(methods: list[str]) -> list[str]:
    """``methods`` with the reference arm (:func:`reference`) put first where it is missing (in place; returned)."""
    if reference() not in methods:
        methods.insert(0, reference())
    return methods


def resolve_methods(spec: str, *, notes: list[str]) -> list[str]:
    """``all`` or a comma list -> the known method and variant names; unknown ones are noted and skipped."""
    names = list(benchmark_names()) if spec == "all" else [m.strip() for m in spec.split(",") if m.strip()]
    out = []
    for name in names:
        if name in METHODS or name in VARIANTS:
            out.append(name)
        else:
            note = f"skipped {name}: unknown method (known: {', '.join(benchmark_names())})"
            notes.append(note)
            print(note, file=sys.stderr)
    return out


# ==================================================================== process and options
def setup_process() -> Callable[[], None]:
    """One thread for torch, quiet Flower logs (the progress bars report instead); returns an undo function."""
    import flwr.common.logger  # noqa: F401 - sets the "flwr" logger's level at import; override it after
    import torch

    threads, level = torch.get_num_threads(), logging.getLogger("flwr").level
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)

    def undo() -> None:
        torch.set_num_threads(threads)
        logging.getLogger("flwr").setLevel(level)

    return undo


def parse_sets(items: Sequence[str] | None) -> dict:
    """``key=value`` pairs (TOML values, as Flower's --run-config) -> dict."""
    from server.launch import parse_run_config

    return parse_run_config(" ".join(items)) if items else {}


def parse_method_sets(items: Sequence[str] | None) -> dict[str, dict]:
    """``method:key=value`` pairs -> {method: {key: value}}."""
    out: dict[str, dict] = {}
    for item in items or ():
        method, _, kv = item.partition(":")
        if not kv:
            raise SystemExit(f"--method-set expects method:key=value, got {item!r}")
        out.setdefault(method, {}).update(parse_sets([kv]))
    return out


def add_federation_arguments(p: argparse.ArgumentParser, *, dataset: str, train_subset: int, test_subset: int,
                             rounds: int, hidden: str, out: str, methods: str, local_epochs: int = 1, lr: float = 0.1,
                             batch_size: int = 32) -> None:
    """Options of the benchmarks that run many methods through :func:`benchmarks.runs.run_point`."""
    p.add_argument("--methods", default=methods, help="'all' or a comma list (variants: " + ", ".join(VARIANTS) + ")")
    p.add_argument("--dataset", default=dataset)
    p.add_argument("--train-subset", type=int, default=train_subset)
    p.add_argument("--test-subset", type=int, default=test_subset)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--local-epochs", type=int, default=local_epochs)
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--hidden", default=hidden)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="extra run-config for every run")
    p.add_argument("--method-set", nargs="*", metavar="METHOD:KEY=VALUE", help="run-config for one method only")
    p.add_argument("--out", default=out)


def plan(args: argparse.Namespace) -> tuple[Path, list[str], list[str], dict[str, dict]]:
    """What a multi-method benchmark starts from: output folder, report notes, methods, per-method run-config."""
    notes: list[str] = []
    return Path(args.out), notes, resolve_methods(args.methods, notes=notes), parse_method_sets(args.method_set)


def common_base(args: argparse.Namespace) -> dict:
    """Run-config shared by every run of a benchmark (from :func:`add_federation_arguments`' options)."""
    base = {"dataset": args.dataset, "train-subset": args.train_subset, "test-subset": args.test_subset,
            "num-rounds": args.rounds, "local-epochs": args.local_epochs, "hidden": args.hidden,
            "batch-size": args.batch_size, "lr": args.lr, "seed": args.seed}
    base.update(parse_sets(args.set))
    return base


def command_line(args: argparse.Namespace) -> str:
    """The command that produced a table (set by the CLI; the provenance line of every report)."""
    return getattr(args, "command_line", "cancelfl-bench")


# ==================================================================== tables
def fmt(v, digits: int = 4) -> str:
    """A table cell: ``-`` for missing / nan, ``inf``, floats to ``digits`` significant digits."""
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if math.isinf(v):
            return "inf"
        return f"{v:.{digits}g}"
    return str(v)


def write_csv(path: Path, rows: list[dict], columns: Sequence[str] | None = None) -> None:
    """``rows`` as CSV (columns: ``columns`` or the first row's keys; missing cells empty)."""
    cols = list(columns) if columns is not None else list(rows[0])
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in cols})


def write_table(rows: list[dict], columns: Sequence[str], out: Path, name: str, *, title: str, command: str,
                notes: Iterable[str] = ()) -> str:
    """Write ``<name>.csv`` and ``<name>.md``; returns the Markdown table."""
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{name}.csv", rows, columns)
    lines = [f"| {' | '.join(columns)} |", f"|{'|'.join('---' for _ in columns)}|"]
    lines += [f"| {' | '.join(fmt(r.get(c)) for c in columns)} |" for r in rows]
    table = "\n".join(lines)
    md = [f"## {title}", "", f"Command: `{command}`", "", table, ""]
    md += [f"- {n}" for n in notes]
    (out / f"{name}.md").write_text("\n".join(md) + "\n")
    return table


def publish(rows: list[dict], columns: Sequence[str], args: argparse.Namespace, name: str, *, title: str,
            notes: Iterable[str], total: float) -> None:
    """Write ``<name>.csv`` and ``<name>.md`` into ``--out``; print the table and the total time."""
    print(write_table(rows, columns, Path(args.out), name, title=title, command=command_line(args), notes=notes))
    print(f"total time: {total:.1f} s")


