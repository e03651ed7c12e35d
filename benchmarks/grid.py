"""Methods x epsilon x clients side by side: accuracy, reported epsilon, round time, bytes.

    cancelfl-bench grid [--methods all] [--epsilons 1,8] [--clients 10,50] [--dataset mnist] ...

Writes ``results.csv``, ``results.md`` (with the command that produced it),
``accuracy_vs_epsilon.png`` and ``round_time.png`` into ``--out``.  FedSGD for every method
(one full-batch step per round, as nadp, mpddp and ddpsa require): same optimiser, so accuracy
differences come from the privacy mechanisms.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from benchmarks import common
from benchmarks.runs import add_ratios, run_point, warm_up

HELP = "methods x epsilon x clients"

COLUMNS = ("name", "epsilon", "clients", "status", "final_accuracy", "epsilon_reported", "epsilon_uplink",
           "epsilon_downlink", "round_s", "client_s", "server_s", "deployed_s", "deployed_s_x_fedavg",
           "bytes_down", "bytes_up", "bytes_per_client_round")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl-bench grid`` (the defaults run for several minutes)."""
    common.add_federation_arguments(p, dataset="mnist", train_subset=6000, test_subset=2000, rounds=15, hidden="32",
                             out="runs/bench/grid", methods="all", batch_size=100000, lr=0.5)
    p.add_argument("--epsilons", default="1,8")
    p.add_argument("--clients", default="10,50")


def run(args: argparse.Namespace) -> int:
    """Every (method, epsilon, clients) point; a method without DP (fedavg) once per client count (no epsilon)."""
    from tqdm import tqdm

    out, notes, methods, msets = common.plan(args)
    epsilons = [float(e) for e in args.epsilons.split(",")]
    clients = [int(k) for k in args.clients.split(",")]
    base = common.common_base(args)
    points = [(m, e, k) for k in clients for m in methods for e in (epsilons if common.private(m) else [epsilons[0]])]
    t0 = time.perf_counter()
    warm_up(base, clients, out)
    rows = []
    bar = tqdm(points, desc="grid", unit="run", dynamic_ncols=True)
    for m, e, k in bar:
        bar.set_postfix_str(f"{m} eps={e:g} K={k}")
        r = run_point(m, e, k, base, msets, out / "runs" / f"{m}-eps{e:g}-k{k}")
        rows.append(r.as_row())
        tqdm.write(f"{m:>16} eps={e:<5g} K={k:<4} acc={common.fmt(r.final_accuracy)} eps_rep={common.fmt(r.epsilon_reported)} "
                   f"round={common.fmt(r.round_s)}s client={common.fmt(r.client_s)}s server={common.fmt(r.server_s)}s {r.status}")
    add_ratios(rows)
    total = time.perf_counter() - t0
    notes.append(f"total benchmark time {total:.0f} s ({len(points)} runs + warm-up) on this machine")
    notes.append("fedavg has no epsilon: it is run once per client count and drawn as a dashed line")
    notes.append("bytes_up includes uploads that bypass the Flower grid (ddpsa: secret shares pushed to its "
                 "intermediate servers, from the clients' share_bytes metric)")
    notes.append("epsilon_reported/uplink/downlink as the method reports them after the last round (inf = no "
                 "guarantee); the configured epsilon is the whole-run budget of every method")
    notes.append("keys the grid leaves unset take each method's regime (protocols/methods/)")
    plot(rows, out)
    common.publish(rows, COLUMNS, args, "results", title="Privacy-utility-cost grid", notes=notes, total=total)
    print(f"wrote {out}/results.csv, results.md, accuracy_vs_epsilon.png, round_time.png")
    return 0


def plot(rows: list[dict], out: Path) -> None:
    """accuracy_vs_epsilon.png (one panel per client count) and round_time.png."""
    plt = common.pyplot()
    clients = sorted({r["clients"] for r in rows})
    names = list(dict.fromkeys(r["name"] for r in rows))
    fig, axes = plt.subplots(1, len(clients), figsize=(6 * len(clients), 4.5), squeeze=False)
    for ax, k in zip(axes[0], clients, strict=True):
        for i, n in enumerate(names):
            pts = sorted((r["epsilon"], r["final_accuracy"]) for r in rows
                         if r["name"] == n and r["clients"] == k and r["status"].startswith(("ok", "failed")))
            if not pts:
                continue
            if not common.private(n):
                ax.axhline(pts[0][1], ls="--", color="k", label=f"{n} (no DP)")
                continue
            ax.plot(*zip(*pts, strict=True), marker="o", label=n, color=plt.cm.tab20(i % 20))
        ax.set_xscale("log")
        eps_ticks = sorted({r["epsilon"] for r in rows if common.private(r["name"])})
        ax.set_xticks(eps_ticks, [f"{e:g}" for e in eps_ticks])
        ax.minorticks_off()
        ax.set_xlabel("epsilon (as configured)")
        ax.set_ylabel("final test accuracy")
        ax.set_title(f"{k} clients")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    common.save_figure(fig, out / "accuracy_vs_epsilon.png")

    eps_ref = {}
    for r in rows:  # one bar per method and client count: the run at the smallest epsilon
        key = (r["name"], r["clients"])
        if r["status"].startswith(("ok", "failed")) and (key not in eps_ref or r["epsilon"] < eps_ref[key]["epsilon"]):
            eps_ref[key] = r
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(clients), 1)
    x = np.arange(len(names))
    for j, k in enumerate(clients):
        srv = [eps_ref.get((n, k), {}).get("server_s", np.nan) for n in names]
        cli = [eps_ref.get((n, k), {}).get("client_s", np.nan) for n in names]
        rnd = [eps_ref.get((n, k), {}).get("round_s", np.nan) for n in names]
        axes[0].bar(x + j * width, rnd, width, label=f"{k} clients")
        axes[1].bar(x + j * width, srv, width, label=f"server, {k} clients", color=plt.cm.tab20(2 * j))
        axes[1].bar(x + j * width, cli, width, bottom=srv, label=f"one client, {k} clients", color=plt.cm.tab20(2 * j + 1))
    axes[0].set_title("mean round time, in-process (clients sequential)")
    axes[1].set_title("deployed estimate: server + one client (parallel clients)")
    for ax in axes:
        ax.set_xticks(x + width * (len(clients) - 1) / 2, names, rotation=45, ha="right")
        ax.set_ylabel("seconds per round")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    common.save_figure(fig, out / "round_time.png")
