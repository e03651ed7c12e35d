"""Every method out of the box: ``method`` and ``dataset`` set, nothing else (with the acceptance rules).

Each run is ``cancelfl run --run-config 'method="M" dataset="D" seed=S'`` done in-process
(:func:`server.launch.run_inprocess`): the app's defaults plus the method's regime (:func:`protocols.methods.regime`)
for every key left ``"auto"``, at the default epsilon (``--method-set M:KEY=VALUE`` adds keys to method M's runs,
e.g. an option measured before it becomes a default). ``--seeds N`` runs seeds ``42 .. 42 + N - 1`` (``--first-seed``
moves the start; the seed fixes partitioning, sampling, the initial model and the batch order; DP noise always comes
from the OS CSPRNG) for the methods in ``--seeded`` and the first seed for the others. ``defaults.md`` lists per
dataset and method the mean final test accuracy over its seeds and its spread (sample standard deviation, min and
max), the epsilon spent (null = no guarantee in that direction), the privacy unit, the noise check's run ratio (noise
left in the model over the most the clipped updates can move it; > 1 warns) and the mean wall time;
``defaults-runs.csv`` holds every run. The acceptance rules (:data:`RULES`, :data:`FLOOR`) are checked on the means,
on every dataset given. Exit status 1 if a rule fails (the table's notes say which). Every finished run is appended to
``<runs-dir>/rows.jsonl``; ``--resume`` takes the runs found there (same dataset, method and seed) instead of running
them again; ``--tabulate`` runs nothing and tables the recorded runs (the notes list the missing ones, a rule whose
methods lack runs is not checked, and the exit status is 1).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from benchmarks import common
from protocols.methods import method_names, method_spec

HELP = "every method with only method and dataset set (its regime applied): final accuracy and the acceptance rules"

COLUMNS = ("dataset", "method", "unit", "seeds", "final_accuracy", "sd", "min", "max", "epsilon_uplink",
           "epsilon_downlink", "run_ratio", "measured_run_ratio", "learned", "rounds", "total_s", "regime", "status")
RUN_COLUMNS = ("dataset", "method", "seed", "unit", "final_accuracy", "epsilon_uplink", "epsilon_downlink",
               "run_ratio", "measured_run_ratio", "learned", "rounds", "total_s", "regime", "status")
#: The default first seed (the app's default ``seed``).
FIRST_SEED = 42


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl-bench defaults``."""
    parser.add_argument("--datasets", default="digits,mnist", help="comma list of datasets")
    parser.add_argument("--methods", default="all", help="comma list of registered methods, or all")
    parser.add_argument("--seeds", type=int, default=1, help="seeds per method in --seeded (42, 43, ...)")
    parser.add_argument("--first-seed", type=int, default=FIRST_SEED, help="the first of the seeds")
    parser.add_argument("--seeded", default="all",
                        help="comma list of the methods that run every seed, or all; the others run seed 42 only")
    parser.add_argument("--method-set", nargs="*", metavar="METHOD:KEY=VALUE",
                        help="run-config keys added to one method's runs (e.g. ddpsa:ddpsa-noise=\"gaussian\"), "
                             "over its regime")
    parser.add_argument("--out", default="runs/bench-defaults", help="folder of the tables")
    parser.add_argument("--runs-dir", default="", help="folder of the run folders and rows.jsonl ('' = <out>/runs)")
    parser.add_argument("--resume", action="store_true",
                        help="take the runs already in <runs-dir>/rows.jsonl instead of running them again")
    parser.add_argument("--tabulate", action="store_true",
                        help="run nothing: the tables from the runs in <runs-dir>/rows.jsonl (missing ones are listed)")


def chance(dataset: str) -> float:
    """Share of the most frequent class in the dataset's test set."""
    from protocols.config import RunConfig
    from protocols.task.data import dataset_for
    from strategies.run.notes import chance_level

    return chance_level(dataset_for(RunConfig(dataset=dataset)).y_test)


def run_one(method: str, dataset: str, seed: int, runs: Path, settings: dict | None = None) -> dict:
    """One default run with ``seed`` in a fresh folder under ``runs``; a refused or failed run gets the reason in ``status``.

    ``settings``: run-config keys added to the run (``--method-set``).
    """
    from server.launch import run_inprocess

    row = {"dataset": dataset, "method": method, "seed": seed, "unit": method_spec(method).guarantee("record").unit,
           "status": "ok"}
    folder = runs / f"{dataset}-{method}-s{seed}"
    shutil.rmtree(folder, ignore_errors=True)  # a fresh privacy ledger: a left-over folder would continue its own
    t0 = time.perf_counter()
    try:
        s = run_inprocess({**(settings or {}), "method": method, "dataset": dataset, "seed": seed,
                           "out-dir": str(folder)},
                          progress=lambda _line: None)
    except Exception as err:  # noqa: BLE001 - a benchmark row records the failure and goes on
        row.update(status=f"failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}",
                   total_s=time.perf_counter() - t0)
        return row
    check = s.get("noise_check") or {}
    row.update(final_accuracy=s["final_accuracy"], epsilon_uplink=s["epsilon_uplink"],
               epsilon_downlink=s["epsilon_downlink"], run_ratio=check.get("run_ratio"),
               measured_run_ratio=(check.get("measured") or {}).get("run_ratio"),
               learned=s["learning_check"]["learned"],
               rounds=s["config"]["num-rounds"], total_s=time.perf_counter() - t0,
               regime=" ".join(f"{k}={v}" for k, v in s["regime"].items()))
    return row


def summarize(rows: list[dict]) -> list[dict]:
    """One row per (dataset, method): the mean accuracy over its seeds and its spread.

    Spread: sample sd (null for one seed), min, max; also the largest run ratio and the mean wall time; the other
    cells come from the first run.  A failed run makes the mean null and the status names it.
    """
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["method"]), []).append(r)
    out = []
    for group in groups.values():
        accs = [r.get("final_accuracy") for r in group]
        ok = [a for a in accs if a is not None]
        row = {c: group[0].get(c) for c in COLUMNS if c in group[0]}
        ratios = [r["run_ratio"] for r in group if r.get("run_ratio") is not None]
        bad = [f"seed {r['seed']}: {r['status']}" for r in group if r["status"] != "ok"]
        row.update(seeds=len(group), final_accuracy=statistics.fmean(accs) if len(ok) == len(accs) else None,
                   sd=statistics.stdev(ok) if len(ok) > 1 else None, min=min(ok, default=None),
                   max=max(ok, default=None), run_ratio=max(ratios, default=None),
                   learned=all(r.get("learned") for r in group),
                   total_s=statistics.fmean(r.get("total_s") or 0.0 for r in group),
                   status="; ".join(bad) or "ok")
        out.append(row)
    return out


#: (method, reference, margin, datasets): ``method``'s mean at least ``reference``'s mean + ``margin`` at the
#: default epsilon (1), on the large datasets (100 clients) unless the rule names others.
RULES: tuple[tuple[str, str, float, tuple[str, ...]], ...] = (
    ("nadp", "cdp", -0.015, ()), ("niss", "cdp", -0.015, ()), ("nadp", "fedavg", -0.03, ()),
    ("niss", "fedavg", -0.03, ()), ("ddpsa", "cdp", -0.05, ()), ("mpddp", "mpcdp", -0.03, ()), ("ladp", "ldp", 0.0, ()),
)
#: Every DP method's floor: chance + 20 points on the large datasets, 0.5 on the small ones; a method's card
#: exempts it on a size class (``MethodSpec.floor_exempt``).
FLOOR = {"large": 0.20, "small": 0.5}


def acceptance(rows: list[dict], chance_of: dict[str, float]) -> list[str]:
    """The failed acceptance rules on the per-method rows (:func:`summarize`), one sentence each (empty = all hold)."""
    from protocols.methods import dataset_size_class

    failed = []
    for dataset, floor in chance_of.items():
        acc = {r["method"]: r.get("final_accuracy") for r in rows if r["dataset"] == dataset}
        size = dataset_size_class(dataset)
        large = size == "large"
        for method, a in acc.items():
            spec = method_spec(method)
            if not spec.units or size in spec.floor_exempt:  # no DP (fedavg), or exempt on its card
                continue
            need = floor + FLOOR["large"] if large else FLOOR["small"]
            if a is None or a < need:
                failed.append(f"{dataset}: {method} {common.fmt(a)} is below {need:.3f}"
                              + (" (chance + 0.20)" if large else ""))
        for a, b, margin, only in RULES:
            if (only and dataset not in only) or (not only and not large):
                continue
            if acc.get(a) is not None and acc.get(b) is not None and acc[a] < acc[b] + margin:
                how = f"more than {abs(margin) * 100:g} points below" if margin < 0 else "below"
                failed.append(f"{dataset}: {a} {acc[a]:.4f} is {how} {b} {acc[b]:.4f}")
    return failed


def _names(spec: str) -> list[str]:
    return list(method_names()) if spec == "all" else [m.strip() for m in spec.split(",") if m.strip()]


def _recorded(path: Path) -> dict[tuple[str, str, int], dict]:
    """The runs in ``rows.jsonl`` by (dataset, method, seed); the last line of a key wins."""
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {(r["dataset"], r["method"], r["seed"]): r for r in rows}


def run(args: argparse.Namespace) -> int:
    """Run the table, write ``defaults.csv``/``.md`` and ``defaults-runs.csv`` into ``--out``; 1 if a rule fails."""
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be >= 1, got {args.seeds}")
    from protocols.config import ConfigError

    try:
        settings = common.parse_method_sets(args.method_set)
    except ConfigError as err:
        raise SystemExit(f"--method-set: {err}") from err
    if any({"method", "dataset", "seed", "out-dir"} & kv.keys() for kv in settings.values()):
        raise SystemExit("--method-set must not give method, dataset, seed or out-dir (the benchmark sets them)")
    out = Path(args.out)
    runs = Path(args.runs_dir) if args.runs_dir else out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    methods, seeded = _names(args.methods), set(_names(args.seeded))
    seeds = [args.first_seed + i for i in range(args.seeds)]
    done = _recorded(runs / "rows.jsonl") if args.resume or args.tabulate else {}
    t0 = time.perf_counter()
    rows, missing = [], []
    for seed in seeds:  # seed-major: every method has its first seed before any has its second
        for dataset in datasets:
            for method in methods:
                if seed != seeds[0] and method not in seeded:
                    continue
                r = done.get((dataset, method, seed))
                if r is None and args.tabulate:
                    missing.append(f"{dataset} {method} seed {seed}")
                    continue
                if r is None:
                    r = run_one(method, dataset, seed, runs, settings.get(method))
                    if r["status"] == "ok":
                        with (runs / "rows.jsonl").open("a") as fh:
                            fh.write(json.dumps(r) + "\n")
                rows.append(r)
                print(f"{dataset:>14} {method:>10} seed {seed}: acc={common.fmt(r.get('final_accuracy'))} "
                      f"ratio={common.fmt(r.get('run_ratio'))} {common.fmt(r.get('total_s'), 3)}s {r['status']}",
                      flush=True)
    order = {(d, m): i for i, (d, m) in enumerate((d, m) for d in datasets for m in methods)}
    summary = sorted(summarize(rows), key=lambda r: order[(r["dataset"], r["method"])])
    chance_of = {d: chance(d) for d in datasets}
    failed = acceptance(summary, chance_of)
    if missing:  # an incomplete table cannot pass
        failed.append(f"{len(missing)} runs not recorded, their rules unchecked or checked on fewer seeds")
    out.mkdir(parents=True, exist_ok=True)
    common.write_csv(out / "defaults-runs.csv", sorted(rows, key=lambda r: (order[(r["dataset"], r["method"])],
                                                                             r["seed"])), RUN_COLUMNS)
    notes = ["seeds: " + ", ".join(map(str, seeds)) + " for "
             + (("every method" if args.seeded == "all" else ", ".join(m for m in methods if m in seeded))
                + (f", seed {seeds[0]} for the others" if args.seeded != "all" and len(seeds) > 1 else ""))
             + "; final_accuracy is the mean over a method's seeds, sd the sample standard deviation "
               "(- for one seed), min and max the extremes; every run is in defaults-runs.csv",
             *([f"--method-set: {' '.join(args.method_set)}"] if settings else []),
             "chance (most frequent test class): " + ", ".join(f"{d} {c:.3f}" for d, c in chance_of.items()),
             "run_ratio: noise left in the model over the run / the most the clipped updates can move it "
             "(protocols/privacy/signal.py), the largest over the seeds; above 1 the run warns",
             "measured_run_ratio: the same with the signal the rounds actually released in place of the clip "
             "bound (null: none measurable), first seed; learned: the run's learning check (5 points above "
             "chance, else it warns) on every seed",
             *([f"tabulated from {runs / 'rows.jsonl'}: runs made by earlier invocations (each run's wall time is "
                "its total_s)"] if args.tabulate else []),
             *([f"not run (left out of the means): {', '.join(missing)}"] if missing else []),
             *(["acceptance: all rules hold"] if not failed else [f"acceptance FAILED: {f}" for f in failed])]
    common.publish(summary, COLUMNS, args, "defaults", title="Every method with its defaults", notes=notes,
                   total=time.perf_counter() - t0)
    for f in failed:
        print(f"acceptance FAILED: {f}", flush=True)
    return 1 if failed else 0
