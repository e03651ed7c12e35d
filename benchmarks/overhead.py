"""Cost per round of each method against FedAvg, and Flower's SecAgg+ as a reference.

    cancelfl-bench overhead [--methods fedavg,nadp,mpddp] [--clients 100] [--engine inprocess|simulation]
        [--repeats 1] [--no-secagg] [--secagg-shares all,11] ...

``--engine inprocess`` splits each round into client and server time on the in-process grid
(:mod:`benchmarks.runs`) and adds Flower's SecAgg+ on the same model and data
(:mod:`benchmarks.secagg`); ``--engine simulation`` times whole rounds under Flower's
simulation runtime.  Repeats are interleaved and reported as medians.  Writes
``overhead.csv``/``overhead.md`` (and ``overhead_repeats.*``) and ``overhead.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from benchmarks import common
from benchmarks.runs import RunResult, add_ratios, peak_rss, point_config, run_point, short_error, warm_up
from benchmarks.secagg import secaggplus_reference, share_counts

HELP = "client/server time and bytes vs FedAvg, and SecAgg+"

COLUMNS = ("name", "clients", "status", "client_s", "client_s_x_fedavg", "server_s", "server_s_x_fedavg",
           "deployed_s", "deployed_s_x_fedavg", "round_s", "round_s_x_fedavg", "bytes_down", "bytes_up",
           "bytes_per_client_round", "legacy_fedavg_client_s", "legacy_fedavg_server_s", "final_accuracy",
           "first_round_s", "phases")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl-bench overhead``."""
    common.add_federation_arguments(p, dataset="mnist", train_subset=6000, test_subset=1000, rounds=3, hidden="32",
                             out="runs/bench/overhead", methods="fedavg,nadp,mpddp")
    p.set_defaults(method_set=common.SPARSE_PAIRING)
    p.add_argument("--epsilon", type=float, default=1.0)
    p.add_argument("--clients", default="100")
    p.add_argument("--engine", choices=("inprocess", "simulation"), default="inprocess",
                   help="inprocess: compute cost through the in-process grid (client/server split, SecAgg+ "
                        "reference); simulation: round wall time under Flower's simulation runtime")
    p.add_argument("--repeats", type=int, default=1,
                   help="interleaved repeats per method; medians are reported (the machine's speed drifts)")
    p.add_argument("--no-secagg", action="store_true")
    p.add_argument("--secagg-shares", default="all,11",
                   help="SecAgg+ num_shares values ('all' = every client, i.e. SecAgg; even values are made odd)")
    p.add_argument("--secagg-rounds", type=int, default=1, help="SecAgg+ rounds (all timed; caches are warm)")
    p.add_argument("--secagg-threshold", type=float, default=0.5, help="reconstruction threshold (fraction)")


def run(args: argparse.Namespace) -> int:
    """Per-round client/server time and bytes of each method vs FedAvg, plus Flower's SecAgg+."""
    from tqdm import tqdm

    out, notes, methods, msets = common.plan(args)
    common.with_reference(methods)
    base = common.common_base(args)
    clients = [int(k) for k in args.clients.split(",")]
    t0 = time.perf_counter()
    simulation = args.engine == "simulation"
    if not simulation:
        warm_up(base, clients, out)
    repeats = max(1, args.repeats)
    # Repeats are interleaved (fedavg, nadp, mpddp, fedavg, ...) so a slow spell of a shared machine hits
    # every method; each ratio is taken against FedAvg of the same repeat, then the median is reported.
    todo = [(rep, m, k) for rep in range(repeats) for k in clients for m in methods]
    raw: list[dict] = []
    point = simulation_point if simulation else run_point
    bar = tqdm(todo, desc="overhead", unit="run", dynamic_ncols=True)
    for rep, m, k in bar:
        bar.set_postfix_str(f"{m} K={k}" + (f" repeat {rep + 1}/{repeats}" if repeats > 1 else ""))
        r = point(m, args.epsilon, k, base, msets, out / "runs" / (f"{m}-k{k}" + (f"-r{rep}" if repeats > 1 else "")))
        raw.append({**r.as_row(), "repeat": rep})
        tqdm.write(f"{m:>16} K={k:<4} client={common.fmt(r.client_s)}s server={common.fmt(r.server_s)}s "
                   f"round={common.fmt(r.round_s)}s bytes={common.fmt(r.bytes_down + r.bytes_up)} {r.status}")
    for rep in range(repeats):
        add_ratios([r for r in raw if r["repeat"] == rep])
    rows = median_over_repeats(raw)
    if repeats > 1:
        common.write_table(raw, ("repeat", *COLUMNS), out, "overhead_repeats", title="Overhead, every repeat",
                           command=common.command_line(args), notes=[])
    if not args.no_secagg and not simulation:  # SecAgg+ runs through the legacy API on the in-process grid only
        for k in clients:
            for shares in share_counts(args.secagg_shares, k):
                try:
                    rows.append(secaggplus_reference(base, k, shares, args.secagg_threshold, args.secagg_rounds))
                except Exception as err:  # noqa: BLE001 - reported in the table, not fatal
                    traceback.print_exc(limit=6, file=sys.stderr)
                    rows.append({"name": f"secagg+ (shares={shares})", "clients": k,
                                 "status": f"error: {type(err).__name__}: {short_error(err)}"})
                tqdm.write(f"{rows[-1]['name']:>16} K={k:<4} client={common.fmt(rows[-1].get('client_s'))}s "
                           f"server={common.fmt(rows[-1].get('server_s'))}s {rows[-1]['status']}")
    # The method rows hold medians of per-repeat ratios; SecAgg+ rows are compared with FedAvg's median row.
    add_ratios([r for r in rows if r["name"] == common.reference() or str(r["name"]).startswith("secagg+")])
    total = time.perf_counter() - t0
    if repeats > 1:
        notes.append(f"{repeats} interleaved repeats per method: every figure is the median over the repeats, "
                     "*_x_fedavg the median of the per-repeat ratios to FedAvg (all repeats: overhead_repeats.md)")
    if simulation:
        notes.append("engine = simulation: round_s is the median wall time of rounds 2.. under Flower's simulation "
                     "runtime (private SuperLink, a ClientApp per message); client_s/server_s are not measured there")
    notes += [
        "client_s: mean ClientApp time of one client per round (all phases); server_s: round wall time minus the "
        "sum of client times; deployed_s = server_s + client_s (clients in parallel); *_x_fedavg: ratio to "
        "FedAvg at the same client count in this run",
        "secagg+: Flower's SecAggPlusWorkflow (legacy DefaultWorkflow) with secaggplus_mod on a legacy NumPyClient "
        "that trains the same model on the same data, driven through the same in-process LocalGrid; "
        "'secagg+ fedavg' is the same legacy app without SecAgg+ (its own baseline)",
        f"total time {total:.0f} s",
    ]
    plot(rows, out / "overhead.png")
    common.publish(rows, COLUMNS, args, "overhead", title="Overhead per round vs FedAvg", notes=notes, total=total)
    return 0


def median_over_repeats(raw: list[dict]) -> list[dict]:
    """One row per (name, clients): the median of every numeric column over the repeats (first-seen order)."""
    groups: dict[tuple, list[dict]] = {}
    for r in raw:
        groups.setdefault((r["name"], r["clients"]), []).append(r)
    rows = []
    for group in groups.values():
        row = {k: v for k, v in group[0].items() if k != "repeat"}
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "clients":
                vals = [float(g[key]) for g in group if isinstance(g.get(key), (int, float)) and not math.isnan(g[key])]
                row[key] = float(np.median(vals)) if vals else math.nan
        bad = [g["status"] for g in group if g["status"] != "ok"]
        row["status"] = bad[0] if bad else "ok"
        rows.append(row)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Per-client and server time per round for each method (grouped by client count)."""
    plt = common.pyplot()
    ok = [r for r in rows if r.get("status", "").startswith("ok")]
    if not ok:
        return
    labels = [f"{r['name']}\nK={r['clients']}" for r in ok]
    x = np.arange(len(ok))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(ok)), 4.5))
    if all(math.isnan(float(r.get("client_s", math.nan))) for r in ok):  # simulation engine: round time only
        ax.bar(x, [r["round_s"] for r in ok], 0.5, label="round wall time (Flower simulation runtime)")
    else:
        ax.bar(x - 0.2, [r["client_s"] for r in ok], 0.4, label="one client per round")
        ax.bar(x + 0.2, [r["server_s"] for r in ok], 0.4, label="server per round")
    ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    common.save_figure(fig, path)


def simulation_point(name: str, epsilon: float, clients: int, base: dict, method_sets: dict[str, dict],
                     out_dir: Path) -> RunResult:
    """One federation under Flower's simulation runtime (private SuperLink, one ClientApp per message).

    Round time here includes what a real Flower runtime adds per message phase
    (scheduling the ClientApp, moving the messages through the SuperLink), which
    the in-process grid leaves out.  Rounds after the first are timed (the first
    includes Ray's start-up and, for pairwise methods, the session key phase).
    """
    from server.deploy import run_simulation

    return _engine_point(name, epsilon, clients, base, method_sets, out_dir, run_simulation, "simulation")


def deployment_point(cluster, name: str, epsilon: float, clients: int, base: dict, method_sets: dict[str, dict],
                     out_dir: Path) -> RunResult:
    """One federation submitted to ``cluster``, a running deployment: real processes or containers.

    ``cluster``: a :class:`server.deploy.LocalCluster` or :class:`benchmarks.compose.ComposeStack`, anything whose
    ``submit(run_config) -> exit code`` leaves the run's ``metrics.jsonl`` in its ``out-dir``.

    Timed as :func:`simulation_point`; ``clients`` must be the cluster's SuperNodes.
    """
    return _engine_point(name, epsilon, clients, base, method_sets, out_dir, cluster.submit, "deployment")


def _engine_point(name: str, epsilon: float, clients: int, base: dict, method_sets: dict[str, dict], out_dir: Path,
                  submit, engine: str) -> RunResult:
    import json

    method, ov = point_config(name, epsilon, clients, base, method_sets, out_dir)
    res = RunResult(name, method, epsilon, clients)
    t0 = time.perf_counter()
    try:
        code = submit(ov)
    except Exception as err:  # noqa: BLE001 - the benchmark records any failure and goes on
        res.status = f"error: {type(err).__name__}: {short_error(err)}"
        return res
    res.total_s = time.perf_counter() - t0
    metrics = out_dir / "metrics.jsonl"
    if code != 0 or not metrics.exists():
        res.status = f"error: {engine} exit code {code}"
        return res
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    res.rounds = len(rows)
    timed = [r for r in rows if r["round"] > 1 and not r["failed"]] or rows
    res.round_s = float(np.median([r["round_time_s"] for r in timed]))
    res.deployed_s = res.round_s
    res.bytes_down = float(np.mean([r["bytes_sent_per_client"] for r in timed]))
    res.bytes_up = float(np.mean([r["bytes_received_per_client"] for r in timed]))
    res.final_accuracy = rows[-1].get("test_accuracy", math.nan)
    res.extra["first_round_s"] = rows[0]["round_time_s"]
    res.extra["peak_rss_mb"] = peak_rss(timed)
    res.extra["phases"] = "+".join(sorted(timed[-1].get("phase_time_s", {})))
    if any(r["failed"] for r in rows):
        res.status = f"failed {sum(r['failed'] for r in rows)}/{len(rows)} rounds"
    return res
