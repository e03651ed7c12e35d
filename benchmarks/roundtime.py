"""Round time of every method as a ratio to FedAvg's, with realistic local data.

    cancelfl-bench roundtime                      # MNIST, 10 clients x ~6,000 examples, in-process
    cancelfl-bench roundtime --engine simulation --clients 100 --rounds 3 --repeats 2
    cancelfl-bench roundtime --engine deployment --clients 4 --dataset digits --rounds 4 --repeats 2
    cancelfl-bench roundtime --engine compose --clients 4 --dataset digits --rounds 4 --repeats 2

Every method trains FedAvg's local workload (``local-epochs``, ``batch-size``, ``lr``, ``hidden`` given
explicitly), so the ratio is what its privacy machinery costs on top; the mpddp family is FedSGD by design (one
full-batch gradient per round).  Repeats are interleaved, each ratio is taken against the FedAvg run of the same
repeat and the median is reported; round 1 (imports, caches, the first key phase) is excluded.

``round_s``: the round's wall time (in-process the clients run one after another).  ``client_s`` (in-process
only): one client's mean time per round.  ``peak_rss_mb``: the mean over clients of their process's peak
resident memory (meaningful under simulation; in-process it is the whole process's).  Writes
``roundtime.csv``/``roundtime.md`` into ``--out``; with ``--trace`` (deployment) also ``trace.jsonl`` and
``roundtrace.md``, where each round's time goes (:mod:`benchmarks.roundtrace`).

Engines: ``inprocess`` (the in-process grid), ``simulation`` (Flower's simulation runtime), ``deployment`` (``cancelfl
deploy``'s processes on loopback: :class:`server.deploy.LocalCluster`), ``compose`` (``docker/docker-compose.yml`` in
containers of a private Docker engine, TLS and node identities: :class:`benchmarks.compose.ComposeStack`; needs root
and the engine's tools).  Deployment and compose read each run's round times from its ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import time
from pathlib import Path
from unittest import mock

from benchmarks import common
from benchmarks.overhead import deployment_point, median_over_repeats, simulation_point
from benchmarks.roundtrace import write_breakdown
from benchmarks.runs import RunResult, add_ratios, point_config, run_point, warm_up
from protocols.trace import TRACE_ENV

HELP = "round time of every method vs FedAvg with realistic local data (with per-method goals)"

def goals(deployment: bool) -> dict[str, float]:
    """Each method's round-time goal, a multiple of FedAvg's round in the same run; a method without one has none.

    The card's ``round_time_goal``, or its ``deployment_round_time_goal`` across processes (``deployment``).
    """
    from protocols.methods import METHODS

    picked = {name: spec.deployment_round_time_goal if deployment else spec.round_time_goal
              for name, spec in METHODS.items()}
    return {name: goal for name, goal in picked.items() if goal is not None}

#: What ``cancelfl-bench reproduce`` compares (column -> relative tolerance; text columns exactly) and the row key.
FIGURES: dict[str, float] = {"status": 0.0, "round_s_x_fedavg": 0.15, "client_s_x_fedavg": 0.2, "peak_rss_x_fedavg": 0.2,
                             "bytes_per_client_round": 0.05}
KEY = ("name",)

COMPOSE_NOTE = ("engine=compose: docker/docker-compose.yml on a private Docker engine (host networking), SuperNodes "
                "over TLS to the SuperLink, each with its identity key and the roster (require-identity), the 3 DDP-SA "
                "servers of the compose file; each run submitted with the image's flwr run (service submit)")

COLUMNS = ("name", "clients", "status", "round_s", "round_s_x_fedavg", "goal", "meets_goal", "client_s",
           "client_s_x_fedavg", "server_s", "peak_rss_mb", "peak_rss_x_fedavg", "bytes_per_client_round",
           "final_accuracy")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl-bench roundtime``."""
    common.add_federation_arguments(p, dataset="mnist", train_subset=0, test_subset=1000, rounds=3, hidden="64",
                                    out="runs/bench/roundtime", methods="fedavg,ldp,cdp,nadp,niss,mpddp,ladp,ddpsa",
                                    local_epochs=2, lr=0.1, batch_size=32)
    p.add_argument("--epsilon", type=float, default=1.0)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--engine", choices=("inprocess", "simulation", "deployment", "compose"), default="inprocess")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians of per-repeat ratios")
    p.add_argument("--trace", action="store_true",
                   help="deployment: trace every message and write where the round's time goes (roundtrace.md)")


def run(args: argparse.Namespace) -> int:
    """Interleaved repeats of every method at one client count; a table of ratios to FedAvg with the goals."""
    out, notes, methods, msets = common.plan(args)
    common.with_reference(methods)
    base = common.common_base(args)
    base.setdefault("sample-rate", 1.0)
    # Timing only: a noisy run whose loss grows (e.g. ldp at epsilon 1) must not stop before its rounds are timed.
    base.setdefault("divergence-factor", 0.0)
    k = int(args.clients)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if args.engine == "deployment":
            from server.deploy import LocalCluster

            if args.trace:  # every process of the cluster inherits it (protocols.trace)
                out.mkdir(parents=True, exist_ok=True)
                trace_file = out / "trace.jsonl"
                trace_file.unlink(missing_ok=True)
                stack.enter_context(mock.patch.dict(os.environ, {TRACE_ENV: str(trace_file.resolve())}))
            servers = _intermediate_servers(methods, k, args.epsilon, base, msets)
            cluster = stack.enter_context(LocalCluster(k, intermediate_servers=servers))
            point = functools.partial(deployment_point, cluster)
        elif args.engine == "compose":
            from benchmarks.compose import ComposeStack

            compose = stack.enter_context(ComposeStack(k, out_dir=out / "runs", say=_say))
            point = functools.partial(deployment_point, compose)
        elif args.engine == "simulation":
            point = simulation_point
        else:
            point = run_point
            warm_up(base, [k], out)
        if args.engine == "deployment":
            _say(f"warm ClientApps ready after {cluster.wait_warm():.1f} s", "deployment")
        if args.engine in ("deployment", "compose"):
            _warm_cluster(point, args.epsilon, k, base, out)
        raw = _timed_runs(args, methods, point, k, base, msets, out)
    rows = _ratios(raw, args.repeats, goals(args.engine in ("deployment", "compose")))
    total = time.perf_counter() - t0
    per_client = "~" + str(round(60000 / k)) if args.train_subset == 0 and args.dataset == "mnist" else "its share"
    notes += [
        f"engine={args.engine}, {k} clients with {per_client} training examples each, dataset={args.dataset}, "
        f"local-epochs={args.local_epochs}, batch-size={args.batch_size}, lr={args.lr}, hidden={args.hidden!r}, "
        f"epsilon={args.epsilon}, {args.rounds} rounds (round 1 not timed)",
        f"{args.repeats} interleaved repeats; every figure is the median over repeats, *_x_fedavg the median of the "
        "per-repeat ratios to FedAvg",
        "round_s: round wall time (in-process: clients one after another, i.e. all clients' compute + server; "
        "simulation: what a Flower user waits); client_s: one client's time per round (in-process only)",
        "peak_rss_mb: mean over clients of the peak RSS of the process that ran them (simulation: a Ray worker "
        "per ClientApp slot; in-process: the whole benchmark process)",
        *([COMPOSE_NOTE] if args.engine == "compose" else []),
        f"total time {total:.0f} s",
    ]
    common.publish(rows, COLUMNS, args, "roundtime", title="Round time per method vs FedAvg", notes=notes,
                   total=total)
    if args.engine == "deployment" and args.trace:
        print(f"breakdown: {write_breakdown(out / 'trace.jsonl', out)}")
    return 0


def _warm_cluster(point, epsilon: float, clients: int, base: dict, out) -> None:
    """An unrecorded 2-round reference run on a fresh cluster, so that no timed run pays its start-up.

    The SuperNodes' warm ClientApps import their libraries (seconds of CPU each) and every node installs the FAB
    and caches its partition on its first messages; without this the first timed run (the reference) absorbs it
    and every ratio to it comes out low.  Its trace lines are dropped.
    """
    point(common.reference(), epsilon, clients, {**base, "num-rounds": 2}, {}, out / "runs" / "_warmup")
    if trace_file := os.environ.get(TRACE_ENV):
        Path(trace_file).unlink(missing_ok=True)


def _say(msg: str, engine: str = "compose") -> None:
    from tqdm import tqdm

    tqdm.write(f"[{engine}] {msg}")


def _intermediate_servers(methods: list[str], clients: int, epsilon: float, base: dict, msets: dict) -> int:
    """Intermediate servers the deployment cluster starts: the most any method's run needs (its ``local_services``).

    A run config the app refuses needs none here (its row records the refusal).
    """
    from protocols.config import RunConfig
    from protocols.methods import local_services
    from server.defaults import app_defaults

    need = 0
    for m in methods:
        ov = point_config(m, epsilon, clients, base, msets, Path("."))[1]
        try:
            need = max(need, local_services(RunConfig.from_mapping({**app_defaults(), **ov})))
        except ValueError:
            continue
    return need


def _timed_runs(args: argparse.Namespace, methods: list[str], point, k: int, base: dict, msets: dict,
                out) -> list[dict]:
    """Every (repeat, method) run, interleaved; one row each."""
    from tqdm import tqdm

    raw: list[dict] = []
    todo = [(rep, m) for rep in range(max(1, args.repeats)) for m in methods]
    for rep, m in (bar := tqdm(todo, desc="roundtime", unit="run", dynamic_ncols=True)):
        bar.set_postfix_str(f"{m} repeat {rep + 1}/{args.repeats}")
        run_dir = out / "runs" / f"{m}-r{rep}"
        r: RunResult = point(m, args.epsilon, k, base, msets, run_dir)
        row = {"peak_rss_mb": math.nan, **r.as_row(), "repeat": rep}  # a failed run has no RSS figure
        raw.append(row)
        tqdm.write(f"{m:>8} repeat {rep}: round={common.fmt(r.round_s)}s client={common.fmt(r.client_s)}s "
                   f"rss={common.fmt(row['peak_rss_mb'])}MiB acc={common.fmt(r.final_accuracy)} {r.status}")
    return raw


def _ratios(raw: list[dict], repeats: int, goals: dict[str, float]) -> list[dict]:
    """Per-repeat ratios to FedAvg, then medians over repeats, with each method's goal."""
    for rep in range(max(1, repeats)):
        rows_rep = [r for r in raw if r["repeat"] == rep]
        add_ratios(rows_rep)
        ref = next((r for r in rows_rep if r["name"] == common.reference()), None)
        for r in rows_rep:
            den = (ref or {}).get("peak_rss_mb", math.nan)
            r["peak_rss_x_fedavg"] = r["peak_rss_mb"] / den if den and not math.isnan(den) else math.nan
    rows = median_over_repeats(raw)
    for r in rows:
        goal = goals.get(r["name"])
        r["goal"] = f"<= {goal}x" if goal else "-"
        ratio = r.get("round_s_x_fedavg", math.nan)
        r["meets_goal"] = "-" if goal is None or math.isnan(ratio) else ("yes" if ratio <= goal else "NO")
    return rows
