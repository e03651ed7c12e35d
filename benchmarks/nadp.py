"""NADP-FL benchmark in the style of the paper's Table 1: accuracy of no-DP, LDP and NADP vs epsilon and N.

    cancelfl-bench nadp [OUT_DIR] [--dataset digits|mnist] [--train-subset 0]
        [--epsilons 0.5,1,2,4] [--clients 10,50,100] [--num-rounds 30] [--lr 2|1] [--clip 1] [--repeats 1]

All methods get the same data, model, rounds, lr, clip, sampling rate and one full-batch local step per round
(where Lemma 1's record sensitivity ``2C lr/|D_i|`` is exact): ``fedavg`` (no DP), ``ldp`` (client-level
DP-FedAvg), ``record-ldp`` (the paper's LDP-FL comparator, Lemma 3: NADP's training, independent noise) and
``nadp`` (Eq. 3, Algorithm 2, Eq. 8).  ``nadp`` vs ``record-ldp`` is the paper's like-for-like comparison;
``ldp`` protects whole clients.  NADP's aggregate noise scales as 1/(eps |D|) and does not grow with N.

Writes ``results.csv``, ``table.md`` (with the command line and acceptance checks) and
``accuracy_vs_epsilon.png`` into OUT_DIR (default ``runs/bench-nadp/``) and prints the table.  DP noise comes
from the OS, so runs differ; ``--repeats`` > 1 reports mean and standard deviation (seeds 42, 43, ...).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import command_line, method_config, private, pyplot

HELP = "NADP-FL vs client-level LDP, record-level LDP and no DP (the paper's Table 1)"

#: The arms: label -> method or variant name (the record-level comparator is a variant declared in common).
ARMS = {"fedavg": "fedavg", "ldp": "ldp", "record-ldp": "nadp-record-ldp", "nadp": "nadp"}
METHODS = tuple(ARMS)
LABELS = {"fedavg": "No-DP", "ldp": "LDP (client-level)", "record-ldp": "LDP (paper, record-level)",
          "nadp": "NADP"}


def run_config(method: str, args: argparse.Namespace, n: int, eps: float, seed: int, out: Path) -> dict:
    """The run-config of one benchmark run (identical settings for every method but the method keys)."""
    registered, extra = method_config(ARMS[method])
    return {
        "dataset": args.dataset, "train-subset": args.train_subset, "hidden": args.hidden, "model": "mlp",
        "num-clients": n, "sample-rate": args.sample_rate, "num-rounds": args.num_rounds,
        "local-epochs": 1, "batch-size": args.batch_size, "lr": args.lr, "clip": args.clip,
        "epsilon": eps, "delta": args.delta, "seed": seed, "out-dir": str(out), **extra, "method": registered,
    }


def one_run(method: str, args: argparse.Namespace, n: int, eps: float, seed: int, tmp: Path) -> dict:
    """Run once in-process; return the figures of interest."""
    from server.launch import run_inprocess

    out = tmp / f"{method}-n{n}-e{eps:g}-s{seed}"
    t0 = time.perf_counter()
    summary = run_inprocess(run_config(method, args, n, eps, seed, out), progress=lambda _s: None)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    return {
        "accuracy": summary["final_accuracy"], "epsilon": summary["epsilon"],
        "epsilon_uplink": summary["epsilon_uplink"], "epsilon_downlink": summary["epsilon_downlink"],
        "epsilon_paper": last.get("epsilon_paper"), "aggregate_noise_std": last.get("aggregate_noise_std"),
        "failed_rounds": len(summary["failed_rounds"]), "time_s": wall,
    }


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _acc(cell: list[dict]) -> tuple[float, float]:
    accs = [100 * r["accuracy"] for r in cell]
    return statistics.fmean(accs), (statistics.stdev(accs) if len(accs) > 1 else 0.0)


def table(results: dict, args: argparse.Namespace) -> str:
    """Markdown table in the layout of the paper's Table 1 (accuracy %, mean over repeats)."""
    eps_list = args.eps_list
    head = "| N | No-DP | " + " | ".join(
        f"eps={e:g} LDP | eps={e:g} rec-LDP | eps={e:g} NADP" for e in eps_list) + " |"
    sep = "|" + "---|" * (2 + 3 * len(eps_list))
    lines = [head, sep]
    for n in args.client_list:
        no_dp = _acc(results[("fedavg", n, None)])[0]
        cells = [str(n), f"{no_dp:.2f}"]
        for e in eps_list:
            ldp = _acc(results[("ldp", n, e)])[0]
            rec = _acc(results[("record-ldp", n, e)])[0]
            nadp = _acc(results[("nadp", n, e)])[0]
            cells += [f"{ldp:.2f}", f"{rec:.2f}", f"{nadp:.2f} ({nadp - rec:+.2f} vs rec-LDP)"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def acceptance(results: dict, args: argparse.Namespace) -> list[str]:
    """Acceptance checks at eps = 1 and N >= 50: NADP >= 20 points above LDP and record-level LDP, within 5 of no-DP."""
    out = []
    for n in args.client_list:
        if n < 50 or 1.0 not in args.eps_list:
            continue
        nadp = _acc(results[("nadp", n, 1.0)])[0]
        ldp = _acc(results[("ldp", n, 1.0)])[0]
        rec = _acc(results[("record-ldp", n, 1.0)])[0]
        no_dp = _acc(results[("fedavg", n, None)])[0]
        out.append(f"N={n}, eps=1: NADP {nadp:.2f} vs LDP {ldp:.2f} -> +{nadp - ldp:.2f} points "
                   f"[{'PASS' if nadp - ldp >= 20 else 'FAIL'} >= 20]; vs no-DP {no_dp:.2f} -> {nadp - no_dp:+.2f} "
                   f"[{'PASS' if no_dp - nadp <= 5 else 'FAIL'} within 5]; vs record-level LDP {rec:.2f} -> "
                   f"{nadp - rec:+.2f} [{'PASS' if nadp - rec >= 20 else 'FAIL'} >= 20]")
    return out


def plot(results: dict, args: argparse.Namespace, path: Path) -> None:
    """Accuracy vs epsilon, one panel per client count."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(args.client_list), figsize=(4.2 * len(args.client_list), 3.6), squeeze=False)
    for ax, n in zip(axes[0], args.client_list, strict=True):
        no_dp = _acc(results[("fedavg", n, None)])[0]
        ax.axhline(no_dp, color="green", ls="--", label=LABELS["fedavg"])
        for m, color in (("ldp", "tab:red"), ("record-ldp", "tab:blue"), ("nadp", "tab:orange")):
            stats = [_acc(results[(m, n, e)]) for e in args.eps_list]
            ax.errorbar(args.eps_list, [s[0] for s in stats], yerr=[s[1] for s in stats], marker="o",
                        color=color, label=LABELS[m], capsize=3)
        ax.set_xscale("log", base=2)
        ax.set_xticks(args.eps_list, [f"{e:g}" for e in args.eps_list])
        ax.set_xlabel(f"epsilon (delta = {args.delta:g})")
        ax.set_title(f"N = {n}, q = {args.sample_rate:g}")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"test accuracy (%) after {args.num_rounds} rounds")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"NADP-FL vs LDP, {args.dataset}" + (f" ({args.train_subset} train)" if args.train_subset else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl-bench nadp``."""
    ap.add_argument("out", nargs="?", default="runs/bench-nadp")
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--train-subset", type=int, default=0)
    ap.add_argument("--epsilons", default="0.5,1,2,4")
    ap.add_argument("--clients", default="10,50,100")
    ap.add_argument("--sample-rate", type=float, default=0.8, help="q (the paper's Table 1 uses 0.8)")
    ap.add_argument("--num-rounds", type=int, default=30)
    ap.add_argument("--lr", type=float, default=None,
                    help="default 2.0 on digits, 1.0 otherwise (no-DP full-batch GD oscillates on MNIST at 2.0)")
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--hidden", default="", help="MLP hidden widths ('' = softmax regression)")
    ap.add_argument("--batch-size", type=int, default=100_000, help=">= |D_i|: one full-batch local step")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--methods", default=",".join(METHODS))


def run(args: argparse.Namespace) -> int:
    """Every (clients, arm, epsilon) cell ``--repeats`` times; the table, the checks and the plot."""
    if args.lr is None:
        args.lr = 2.0 if args.dataset == "digits" else 1.0
    args.eps_list = [float(e) for e in args.epsilons.split(",")]
    args.client_list = [int(n) for n in args.clients.split(",")]
    methods = [m.strip() for m in args.methods.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = command_line(args)
    results: dict = {}
    rows = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmpname:
        tmp = Path(tmpname)
        for n in args.client_list:
            for m in methods:
                for e in (args.eps_list if private(ARMS[m]) else [None]):  # no DP (fedavg): no epsilon
                    cell = []
                    for rep in range(args.repeats):
                        r = one_run(m, args, n, 1.0 if e is None else e, 42 + rep, tmp)
                        cell.append(r)
                        rows.append({"dataset": args.dataset, "num_clients": n, "method": m,
                                     "target_epsilon": e, "seed": 42 + rep, **r})
                        print(f"N={n:4d} {m:10s} eps={_fmt(e, 'g'):>4s} acc={100 * r['accuracy']:6.2f} "
                              f"eps_acct={_fmt(r['epsilon'])} eps_paper={_fmt(r['epsilon_paper'])} "
                              f"time={r['time_s']:.1f}s", flush=True)
                    results[(m, n, e)] = cell
    total = time.perf_counter() - t_start

    with (out / "results.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    md = table(results, args) if set(methods) == set(METHODS) else ""
    checks = acceptance(results, args) if md else []
    settings = (f"dataset={args.dataset} train-subset={args.train_subset} model=mlp hidden='{args.hidden}' "
                f"q={args.sample_rate} rounds={args.num_rounds} local: 1 full-batch step, lr={args.lr}, "
                f"clip={args.clip}, delta={args.delta}, repeats={args.repeats}")
    text = (f"# NADP-FL benchmark (accuracy %, after {args.num_rounds} rounds)\n\n`{command}`\n\n{settings}\n\n"
            f"{md}\n\n" + "\n".join(f"- {c}" for c in checks) + f"\n\nTotal time {total:.0f} s.\n")
    (out / "table.md").write_text(text)
    if md:
        plot(results, args, out / "accuracy_vs_epsilon.png")
    print()
    print(text)
    return 0
