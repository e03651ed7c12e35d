"""Every method out of the box: ``method`` and ``dataset`` set, nothing else (with the acceptance rules).

Each run is ``cancelfl run --run-config 'method="M" dataset="D"'`` done in-process
(:func:`server.launch.run_inprocess`): the app's defaults plus the method's regime
(:func:`protocols.methods.regime`) for every key left ``"auto"``, at the default epsilon.
The table lists the final test accuracy, the epsilon spent (null = no guarantee in that
direction), the privacy unit, the noise check's run ratio (noise left in the model over the
most the clipped updates can move it; > 1 warns) and the wall time, and checks the
acceptance rules (:data:`RULES`, :data:`FLOOR`) on every dataset given.  Exit status 1 if a rule
fails (the table says which).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks import common
from protocols.methods import METHOD_NAMES, method_spec

HELP = "every method with only method and dataset set (its regime applied): final accuracy and the acceptance rules"

COLUMNS = ("dataset", "method", "unit", "final_accuracy", "epsilon_uplink", "epsilon_downlink", "run_ratio",
           "measured_run_ratio", "learned", "rounds", "total_s", "regime", "status")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl-bench defaults``."""
    parser.add_argument("--datasets", default="digits,mnist", help="comma list of datasets")
    parser.add_argument("--methods", default="all", help="comma list of registered methods, or all")
    parser.add_argument("--out", default="runs/bench-defaults")


def chance(dataset: str) -> float:
    """Share of the most frequent class in the dataset's test set."""
    from protocols.config import RunConfig
    from protocols.task.data import dataset_for
    from strategies.run.notes import chance_level

    return chance_level(dataset_for(RunConfig(dataset=dataset)).y_test)


def run_one(method: str, dataset: str, out: Path) -> dict:
    """One default run; a refused or failed run gets the reason in ``status``."""
    from server.launch import run_inprocess

    row = {"dataset": dataset, "method": method, "unit": method_spec(method).guarantee("record").unit, "status": "ok"}
    t0 = time.perf_counter()
    try:
        s = run_inprocess({"method": method, "dataset": dataset, "out-dir": str(out / f"{dataset}-{method}")},
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


#: (method, reference, margin, datasets): ``method`` at least ``reference + margin`` at the default epsilon (1),
#: on the large datasets (100 clients) unless the rule names others.
RULES: tuple[tuple[str, str, float, tuple[str, ...]], ...] = (
    ("nadp", "cdp", -0.015, ()), ("niss", "cdp", -0.015, ()), ("nadp", "fedavg", -0.03, ()),
    ("niss", "fedavg", -0.03, ()), ("ddpsa", "cdp", -0.05, ()), ("mpddp", "mpcdp", -0.03, ()), ("ladp", "ldp", 0.0, ()),
)
#: Every DP method's floor: chance + 20 points on the large datasets; 0.5 on the small ones except the MP family.
FLOOR = {"large": 0.20, "small": 0.5}
#: The method families the floor of a dataset size class does not hold for (the MP family on the small datasets).
FLOOR_EXEMPT: dict[str, tuple[str, ...]] = {"small": ("mpddp",)}


def acceptance(rows: list[dict], chance_of: dict[str, float]) -> list[str]:
    """The failed acceptance rules, one sentence each (empty = all hold)."""
    from protocols.methods import dataset_size_class

    failed = []
    for dataset, floor in chance_of.items():
        acc = {r["method"]: r.get("final_accuracy") for r in rows if r["dataset"] == dataset}
        size = dataset_size_class(dataset)
        large = size == "large"
        for method, a in acc.items():
            spec = method_spec(method)
            if not spec.units or spec.family in FLOOR_EXEMPT.get(size, ()):  # no DP (fedavg), or exempt
                continue
            need = floor + FLOOR["large"] if large else FLOOR["small"]
            if a is None or a < need:
                failed.append(f"{dataset}: {method} {a} is below {need:.3f}" + (" (chance + 0.20)" if large else ""))
        for a, b, margin, only in RULES:
            if (only and dataset not in only) or (not only and not large):
                continue
            if acc.get(a) is not None and acc.get(b) is not None and acc[a] < acc[b] + margin:
                how = f"more than {abs(margin) * 100:g} points below" if margin < 0 else "below"
                failed.append(f"{dataset}: {a} {acc[a]:.3f} is {how} {b} {acc[b]:.3f}")
    return failed


def run(args: argparse.Namespace) -> int:
    """Run the table, write ``defaults.csv``/``defaults.md`` into ``--out``; 1 if an acceptance rule fails."""
    out = Path(args.out)
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    methods = list(METHOD_NAMES) if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    t0 = time.perf_counter()
    rows = []
    for dataset in datasets:
        for method in methods:
            rows.append(run_one(method, dataset, out))
            r = rows[-1]
            print(f"{dataset:>14} {method:>10}: acc={common.fmt(r.get('final_accuracy'))} "
                  f"ratio={common.fmt(r.get('run_ratio'))} {common.fmt(r.get('total_s'), 3)}s {r['status']}", flush=True)
    chance_of = {d: chance(d) for d in datasets}
    failed = acceptance(rows, chance_of)
    notes = ["chance (most frequent test class): " + ", ".join(f"{d} {c:.3f}" for d, c in chance_of.items()),
             "run_ratio: noise left in the model over the run / the most the clipped updates can move it "
             "(protocols/privacy/signal.py); above 1 the run warns",
             "measured_run_ratio: the same with the signal the rounds actually released in place of the clip "
             "bound (null: none measurable); learned: the run's learning check (5 points above chance, else it warns)",
             *(["acceptance: all rules hold"] if not failed else [f"acceptance FAILED: {f}" for f in failed])]
    common.publish(rows, COLUMNS, args, "defaults", title="Every method with its defaults", notes=notes,
                   total=time.perf_counter() - t0)
    return 1 if failed else 0
