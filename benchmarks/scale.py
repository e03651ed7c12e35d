"""Per-client and server cost of a round as the number of clients per round grows, with and without dropouts.

    cancelfl-bench scale [--methods fedavg,nadp,niss,mpddp,ddpsa] [--clients 10,100,300,1000]
        [--engine inprocess|simulation] [--dropouts 0,0.1] ...

Every method runs ``--rounds`` rounds (default 2) at every client count and dropout rate; round 1 (the key
phase, Ray's start-up under simulation) is not timed.  Sparse pairing by default: nadp and niss 8-out, mpddp
80-out (:data:`benchmarks.common.SPARSE_PAIRING`); ddpsa goes through its 3 local intermediate servers.
``--dropouts``: run-config ``fault-drop-rate``, the share of each round's clients whose train message is withheld
after the key phase (:mod:`strategies.run.faults`), so the survivors run the method's recovery; the planning
assumption ``dropout-rate`` (or a card's own ``MethodSpec.dropout_plan`` key) is set to the same rate (the
methods plan their noise for it).  The model is digits-sized (a 64-16-10 MLP): the table is about what the
protocols cost per client, not about training.

Columns (means over the timed rounds):

* ``client_s``: one client's time.  In-process: the mean ClientApp time of a client over all phases.  Under
  simulation: the time the round spends in client phases x the ClientApps that run at once (one per core) /
  the clients, i.e. a client's share of the workers' time, Flower's per-message cost included.
* ``server_s``: the server's own time: the round's wall time minus the time spent waiting for clients.
* ``bytes_down`` / ``bytes_up``: payload bytes per participating client (ddpsa's uplink includes its shares to
  the intermediate servers).
* ``peak_rss_mb``: the mean over clients of the peak resident memory of the process that ran them (under
  simulation a Ray worker; in-process the whole benchmark process, server included).
* ``neighbours``: the mean number of neighbours a pairwise method's client has (its pair-noise cost is linear in
  it); ``-`` for methods without pairing.

Writes ``scale.csv``, ``scale.md`` and ``scale.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np

from benchmarks import common
from benchmarks.overhead import simulation_point
from benchmarks.runs import RunResult, run_point, warm_up
from protocols.methods import METHODS

HELP = "per-client and server cost per round from 10 to 1,000 clients, with dropouts"

COLUMNS = ("name", "clients", "dropouts", "status", "client_s", "server_s", "round_s", "bytes_down", "bytes_up",
           "peak_rss_mb", "neighbours", "total_s")

#: What ``cancelfl-bench reproduce`` compares (column -> relative tolerance; text columns exactly) and the row key.
FIGURES: dict[str, float] = {"status": 0.0, "bytes_down": 0.05, "bytes_up": 0.05, "neighbours": 0.05,
                             "client_s": 0.5, "server_s": 0.5, "peak_rss_mb": 0.25}
KEY = ("name", "clients", "dropouts")
TITLE = "Per-client and server cost vs clients per round"

#: niss pairs as nadp (8-out) at scale; its complete-graph default costs every client K - 1 share seeds.
SCALE_PAIRING = [*common.SPARSE_PAIRING, 'niss:graph="n-out"', "niss:n-out=8"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl-bench scale``."""
    common.add_federation_arguments(p, dataset="digits", train_subset=0, test_subset=0, rounds=2, hidden="16",
                                    out="runs/bench/scale", methods="fedavg,nadp,niss,mpddp,ddpsa", local_epochs=1,
                                    batch_size=100000)
    p.set_defaults(method_set=SCALE_PAIRING)
    p.add_argument("--epsilon", type=float, default=1.0)
    p.add_argument("--clients", default="10,100,300,1000", help="comma list of clients per round")
    p.add_argument("--engine", choices=("inprocess", "simulation"), default="inprocess",
                   help="inprocess: the in-process grid (clients one after another); simulation: Flower's simulation "
                        "runtime (private SuperLink, Ray, one CPU per ClientApp), as `cancelfl run --engine simulation`")
    p.add_argument("--dropouts", default="0", help="comma list of run-config fault-drop-rate values, e.g. 0,0.1")


def run(args: argparse.Namespace) -> int:
    """One row per (client count, dropout rate, method)."""
    from tqdm import tqdm

    out, notes, methods, msets = common.plan(args)
    base = common.common_base(args)
    base.setdefault("sample-rate", 1.0)
    base.setdefault("divergence-factor", 0.0)  # a cost benchmark: a noisy run must not stop before it is timed
    clients = [int(k) for k in args.clients.split(",")]
    rates = [float(d) for d in args.dropouts.split(",")]
    simulation = args.engine == "simulation"
    t0 = time.perf_counter()
    if not simulation:
        warm_up(base, clients, out)
    rows = []
    own_plans = {n: spec.dropout_plan for n in methods if (spec := METHODS.get(n)) is not None and spec.dropout_plan}
    todo = [(d, k, m) for k in clients for d in rates for m in methods]
    for d, k, m in tqdm(todo, desc="scale", unit="run", dynamic_ncols=True):
        run_dir = out / "runs" / f"{m}-k{k}-d{d:g}"
        # The planning assumption at the fault's rate: run-config dropout-rate, or the card's own key.
        sets = {**msets, **{n: {key: min(d, 0.49), **msets.get(n, {})} for n, key in own_plans.items()}}
        row = point(m, args.epsilon, k, d, {**base, "fault-drop-rate": d, "dropout-rate": min(d, 0.49)}, sets, run_dir,
                    simulation=simulation)
        rows.append(row)
        common.write_table(rows, COLUMNS, out, "scale", title=TITLE, command=common.command_line(args),
                           notes=["partial: the run has not finished"])  # what is done survives an interrupted run
        tqdm.write(f"{m:>6} K={k:<5} drop={d:<4g} client={common.fmt(row['client_s'])}s "
                   f"server={common.fmt(row['server_s'])}s down={common.fmt(row['bytes_down'])} "
                   f"up={common.fmt(row['bytes_up'])} rss={common.fmt(row['peak_rss_mb'])}MiB "
                   f"neighbours={common.fmt(row['neighbours'])} {row['status']}")
    total = time.perf_counter() - t0
    notes += run_notes(args, total, own_plans)
    plot(rows, out / "scale.png")
    common.publish(rows, COLUMNS, args, "scale", title=TITLE, notes=notes, total=total)
    return 0


def run_notes(args: argparse.Namespace, total: float, own_plans: dict[str, str]) -> list[str]:
    """The notes under a finished table: setting, column meanings, total time (``own_plans``: a card's planning key)."""
    simulation = args.engine == "simulation"
    return [
        f"engine={args.engine}, dataset={args.dataset} (every client holds its 1/K share), hidden={args.hidden!r}, "
        f"local-epochs={args.local_epochs}, full-batch, epsilon={args.epsilon}, {args.rounds} rounds (round 1 not "
        "timed); the model is tiny on purpose: the figures are the protocols' cost per client and per round",
        "dropouts: run-config fault-drop-rate (the share of each round's clients whose train message is withheld "
        "after the key phase; the survivors run the method's recovery) and the planning assumption dropout-rate"
        + "".join(f" ({name}: {key})" for name, key in own_plans.items()) + ", both at that rate",
        "client_s: " + ("the round's time in client phases x parallel ClientApps (one per core) / clients, Flower's "
                        "per-message cost included" if simulation else "mean ClientApp time of one client, all phases")
        + "; server_s: round wall time minus the time spent waiting for clients; bytes per participating client",
        "peak_rss_mb: mean over clients of the peak RSS of the process that ran them ("
        + ("a Ray worker)" if simulation else "in-process: the whole benchmark process, server included)"),
        f"total time {total:.0f} s; load average {os.getloadavg()[0]:.0f} on {os.cpu_count()} cores at the end (the "
        "machine was shared: times are wall times under that load, bytes and neighbours do not depend on it)",
    ]


def point(name: str, epsilon: float, clients: int, dropouts: float, base: dict, method_sets: dict[str, dict],
          run_dir: Path, *, simulation: bool) -> dict:
    """One table row: the run's figures plus the per-round ones read from its ``metrics.jsonl``."""
    if simulation:
        r: RunResult = simulation_point(name, epsilon, clients, base, method_sets, run_dir)
        if r.status.startswith("error") and not timed_rows(run_dir / "metrics.jsonl"):  # e.g. Ray did not start
            r = simulation_point(name, epsilon, clients, base, method_sets, run_dir)
    else:
        r = run_point(name, epsilon, clients, base, method_sets, run_dir)
    row = {"peak_rss_mb": math.nan, **r.as_row(), "dropouts": dropouts}
    timed = timed_rows(run_dir / "metrics.jsonl")
    if simulation and r.status.startswith("error") and (done := _budget_stop(run_dir)) and timed and timed[0]["round"] > 1:
        # The budget guard ended the run early (a method that cannot raise its noise after dropouts): rounds
        # 2..done still measure the round's cost.
        row.update(status=f"ok; stopped by the privacy budget after round {done}", round_s=_mean(timed, "round_time_s"),
                   bytes_down=_mean(timed, "bytes_sent_per_client"), bytes_up=_mean(timed, "bytes_received_per_client"),
                   peak_rss_mb=_mean(timed, "client_peak_rss_mb"))
    elif not (r.status == "ok" or r.status.startswith("failed")):
        timed = []
    row["neighbours"] = _mean(timed, "neighbours")
    if simulation and timed:
        waiting = [sum(t["phase_time_s"].values()) for t in timed]
        slots = [min(os.cpu_count() or 1, max(int(t["clients"]), 1)) for t in timed]
        row["server_s"] = float(np.mean([t["round_time_s"] - w for t, w in zip(timed, waiting, strict=True)]))
        row["client_s"] = float(np.mean([w * s / max(int(t["clients"]), 1)
                                         for t, w, s in zip(timed, waiting, slots, strict=True)]))
        off_grid = _mean(timed, "client_off_grid_bytes")
        if not math.isnan(off_grid):  # in-process, runs.run_point counts it from the replies
            row["bytes_up"] += off_grid
    row["bytes_per_client_round"] = row["bytes_down"] + row["bytes_up"]
    return row


def timed_rows(path: Path) -> list[dict]:
    """The rows of a run's ``metrics.jsonl`` after round 1 that did not fail (all rows when there is one round)."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["round"] > 1 and not r["failed"]] or [r for r in rows if not r["failed"]]


def _budget_stop(run_dir: Path) -> int:
    """Rounds completed when the privacy budget stopped the run in ``run_dir``, else 0."""
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    return int(summary.get("rounds_completed") or 0) if summary.get("stopped_for") == "privacy budget" else 0


def _mean(rows: list[dict], key: str) -> float:
    vals = [float(r[key]) for r in rows if r.get(key) is not None]
    return float(np.mean(vals)) if vals else math.nan


def plot(rows: list[dict], path: Path) -> None:
    """Per-client time, server time, bytes and peak memory against the number of clients (log-log)."""
    plt = common.pyplot()
    panels = (("client_s", "one client, s/round"), ("server_s", "server, s/round"),
              ("bytes_per_client_round", "bytes per client per round"), ("peak_rss_mb", "peak memory per client, MiB"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    for name, d in dict.fromkeys((r["name"], r["dropouts"]) for r in rows):
        ok = sorted((r for r in rows if (r["name"], r["dropouts"]) == (name, d) and r["status"].startswith("ok")),
                    key=lambda r: r["clients"])
        if not ok:
            continue
        for ax, (col, _) in zip(axes, panels, strict=True):
            ax.plot([r["clients"] for r in ok], [r[col] for r in ok], marker="o", linestyle="-" if d == 0 else "--",
                    label=f"{name}" + (f" drop {d:g}" if d else ""))
    for ax, (_, title) in zip(axes, panels, strict=True):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("clients per round")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    common.save_figure(fig, path)
