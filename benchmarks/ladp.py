"""LaDP-FL vs full local DP at the same per-round epsilon: accuracy and injected noise.

    cancelfl-bench ladp [OUT_DIR] [--eps 30 60 120] [--rounds 10] [--repeats 1]

Arms (all through :func:`server.launch.run_inprocess`, method ``ladp`` unless noted):

* ``fedavg``      -- no noise (utility upper bound; same local training);
* ``full-ldp``    -- every layer noised with the smallest LaDP sigma ``c0 Delta_f / eps``
  (R = 0, B at the KL floor: P_j = B for all layers) = the paper's "Full DP" baseline
  with the same corrected Gaussian constant;
* ``ladp-R3``     -- LaDP, R = 3 (only the 64x64 input layer, norm ~4.6, is noised), B =
  1e-6 (KL scale of one round);
* ``ladp-R1``     -- LaDP, R = 1 (weights noised, biases not), B = 1e-6;
* ``ladp-R0-kl``  -- LaDP, R = 0, B = 1e-4: every layer noised, KL adaptivity only.

Figures per arm: final test accuracy, cumulative noise = sum over rounds of the mean
per-client L2 norm of the injected noise (the paper's Table III metric), reduction vs
full LDP, mean number of noised layers, the composed epsilon of the noised layers
(exact Gaussian composition) and the reported model-level epsilon (inf when some layer
was released without noise).  Writes ``results.csv`` and ``results.md`` to OUT_DIR
(default ``runs/bench-ladp/``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import time
from pathlib import Path

from benchmarks.common import private

HELP = "LaDP-FL vs full local DP at the same per-round epsilon: accuracy and injected noise"

ARMS = ("fedavg", "full-ldp", "ladp-R3", "ladp-R1", "ladp-R0-kl")


def arm_config(name: str) -> dict:
    """Run-config of an arm (see the module docstring)."""
    from client.methods.ladp import MIN_KL  # imported here: the client stack is slow to import for --help

    return {
        "fedavg": {"method": "fedavg"},
        "full-ldp": {"method": "ladp", "ladp-norm-threshold": 0.0, "ladp-kl-cap": MIN_KL},
        "ladp-R3": {"method": "ladp", "ladp-norm-threshold": 3.0, "ladp-kl-cap": 1e-6},
        "ladp-R1": {"method": "ladp", "ladp-norm-threshold": 1.0, "ladp-kl-cap": 1e-6},
        "ladp-R0-kl": {"method": "ladp", "ladp-norm-threshold": 0.0, "ladp-kl-cap": 1e-4},
    }[name]


def noised(name: str) -> bool:
    """Whether an arm trains with DP (its method's card lists privacy units; the fedavg arm has none)."""
    return private(arm_config(name)["method"])


def _rows(out: Path) -> list[dict]:
    """metrics.jsonl of a run."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_arm(name: str, eps: float, args: argparse.Namespace, repeat: int, out_root: Path) -> dict:
    """One run; returns its figures."""
    from server.launch import run_inprocess

    out = out_root / "runs" / f"{name}-eps{eps:g}-r{repeat}"
    overrides = {
        **arm_config(name), "dataset": args.dataset, "num-clients": args.clients, "num-rounds": args.rounds,
        "local-epochs": args.local_epochs, "epsilon": eps, "seed": 42 + repeat, "out-dir": str(out),
    }
    if args.train_subset:
        overrides["train-subset"] = args.train_subset
    t0 = time.perf_counter()
    summary = run_inprocess(overrides, progress=lambda _s: None)
    rows = _rows(out)
    dp = noised(name)
    return {
        "arm": name, "eps_per_round": eps, "repeat": repeat,
        "R": overrides.get("ladp-norm-threshold", ""), "B": overrides.get("ladp-kl-cap", ""),
        "accuracy": summary["final_accuracy"],
        "cum_noise_l2": sum(r["total_noise_norm"] for r in rows) if dp else 0.0,
        "noised_layers": statistics.mean(r["noised_layers"] for r in rows) if dp else 0.0,
        "eps_noised_layers": rows[-1]["epsilon_noised_layers"] if dp else math.inf,
        "eps_reported": math.inf if summary["epsilon"] is None else summary["epsilon"],
        "time_s": time.perf_counter() - t0,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl-bench ladp``."""
    p.add_argument("out_dir", nargs="?", default="runs/bench-ladp")
    p.add_argument("--eps", type=float, nargs="+", default=[30.0, 60.0, 120.0], help="per-round epsilons")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--dataset", default="digits")
    p.add_argument("--train-subset", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    """Run every arm at every epsilon, print the table, write CSV and Markdown."""
    out_root = Path(args.out_dir)
    out_root.mkdir(parents=True, exist_ok=True)

    results = []
    for eps in args.eps:
        for name in args.arms:
            if not noised(name) and eps != args.eps[0]:
                continue  # no noise: one run is enough
            for rep in range(args.repeats):
                res = run_arm(name, eps, args, rep, out_root)
                results.append(res)
                print(f"  {name:11s} eps={eps:<6g} rep={rep} acc={res['accuracy']:.3f} "
                      f"noise={res['cum_noise_l2']:.4g} ({res['time_s']:.0f} s)", flush=True)

    # Mean over repeats.
    table = []
    keys = sorted({(r["eps_per_round"], r["arm"]) for r in results}, key=lambda k: (k[0], ARMS.index(k[1])))
    for eps, arm in keys:
        rs = [r for r in results if r["eps_per_round"] == eps and r["arm"] == arm]
        row = {**rs[0], "accuracy": statistics.mean(r["accuracy"] for r in rs),
               "cum_noise_l2": statistics.mean(r["cum_noise_l2"] for r in rs),
               "time_s": statistics.mean(r["time_s"] for r in rs), "repeats": len(rs)}
        row.pop("repeat")
        table.append(row)
    for row in table:
        full = next((r for r in table if r["arm"] == "full-ldp" and r["eps_per_round"] == row["eps_per_round"]), None)
        row["noise_vs_full_pct"] = (100.0 * (1 - row["cum_noise_l2"] / full["cum_noise_l2"])
                                    if full and noised(row["arm"]) else float("nan"))

    cols = ["eps_per_round", "arm", "R", "B", "accuracy", "cum_noise_l2", "noise_vs_full_pct", "noised_layers",
            "eps_noised_layers", "eps_reported", "repeats", "time_s"]
    with (out_root / "results.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(table)

    def fmt(v) -> str:
        if isinstance(v, float):
            return "inf" if math.isinf(v) else ("-" if math.isnan(v) else f"{v:.4g}")
        return str(v)

    header = (f"LaDP-FL vs full LDP ({args.dataset}, {args.clients} clients, {args.rounds} rounds, "
              f"local-epochs {args.local_epochs}, {args.repeats} repeat(s)); cumulative noise = sum over rounds "
              "of the mean per-client noise L2 norm; eps = exact Gaussian composition at delta=1e-5")
    md = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in table]
    (out_root / "results.md").write_text("\n".join(md) + "\n")
    print()
    print("\n".join(md))
    print(f"\nwrote {out_root / 'results.csv'} and {out_root / 'results.md'}")
    return 0
