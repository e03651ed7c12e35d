"""What a whole round costs per method, with and without dropouts: phases, bytes, wall time and CPU.

    cancelfl-bench cost [--engine inprocess|simulation|deployment] [--clients 10] [--rounds 4]
        [--dropouts 0,0.1] [--methods fedavg,nadp,niss,mpddp] [--no-secagg] [--out runs/bench/cost]

Arms: FedAvg; each pairwise method (nadp, niss, mpddp) as it runs by default, with double masking
(``self-mask = true``: a Shamir-shared self-mask on every upload, unmasked in a ``query.recover`` phase every
round) and without it (``self-mask = false``: pair noise only, its direct reveal only in rounds with dropouts);
Flower's SecAgg+ (FedAvg under ``SecAggPlusWorkflow``, :mod:`benchmarks.secagg_app`).  Dropouts come from
run-config ``fault-drop-rate`` (the round's train messages of that fraction of clients are withheld, after the key
phase); SecAgg+ drops the same fraction before ``collect_masked_vectors``.

Per arm and dropout rate, medians over the timed rounds (round 1, with start-up and the key phase, is left out):
``phases`` (the round's message phases), ``round_s`` (wall time of the round, evaluation excluded),
``bytes_down``/``bytes_up`` (payload bytes per client), ``server_cpu_s`` (the ServerApp process's CPU seconds in
the round; in-process less the clients'), ``client_cpu_s`` (CPU seconds of one client's ClientApp calls in the
round: in-process and deployment) and ``cluster_cpu_s`` (simulation and deployment: every process of the run).
CPU figures come from the round trace (:mod:`protocols.trace`), which every engine writes with ``CANCELFL_TRACE``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

from benchmarks import common
from benchmarks.roundtrace import median
from protocols.trace import TRACE_ENV

HELP = "a whole round per method with and without dropouts: phases, bytes, time, CPU; vs Flower's SecAgg+"

COLUMNS = ("name", "masking", "engine", "clients", "dropout", "dropped", "status", "phases", "phase_count",
           "phase_s", "round_s", "round_s_x_fedavg", "extra_round_s", "server_cpu_s", "client_cpu_s",
           "cluster_cpu_s", "bytes_down", "bytes_up", "bytes_per_client", "extra_bytes", "first_round_s", "retried")

#: What ``cancelfl-bench reproduce`` compares (column -> relative tolerance; text columns exactly) and the row key:
#: the round's structure and bytes (times and CPU move with the machine's load).
FIGURES: dict[str, float] = {"status": 0.0, "phases": 0.0, "phase_count": 0.0, "bytes_per_client": 0.05,
                             "extra_bytes": 0.1}
KEY = ("name", "masking", "dropout")

#: The arms' masking column.
NOW, TODAY = "double masking", "pair noise only"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl-bench cost``."""
    p.add_argument("--engine", choices=("inprocess", "simulation", "deployment"), default="inprocess")
    p.add_argument("--clients", type=int, default=10, help="clients (deployment: SuperNodes)")
    p.add_argument("--rounds", type=int, default=4, help="rounds per run; round 1 is not timed")
    p.add_argument("--dropouts", default="0,0.1", help="fault-drop-rate values")
    p.add_argument("--methods", default="fedavg,nadp,niss,mpddp")
    p.add_argument("--no-today", action="store_true", help="leave out the arms without double masking")
    p.add_argument("--no-secagg", action="store_true", help="leave out Flower's SecAgg+")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--hidden", default="32")
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--epsilon", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="extra run-config for the cancelfl runs")
    p.add_argument("--retries", type=int, default=0, help="runs again a run that ended in an error (not a failed "
                                                          "round), up to this many times; the row says so")
    p.add_argument("--out", default="runs/bench/cost")


def arms(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    """(name, masking, run-config) of every cancelfl arm; SecAgg+ is added by :func:`run`."""
    from protocols.methods import METHODS
    from protocols.methods.pairwise import PairwiseOptions

    out: list[tuple[str, str, dict]] = []
    for m in [m.strip() for m in args.methods.split(",") if m.strip()]:
        if PairwiseOptions in METHODS[m].options:  # the methods with the self-mask option
            out.append((m, NOW, {"method": m, "self-mask": True}))
            if not args.no_today:
                out.append((m, TODAY, {"method": m, "self-mask": False}))
        else:
            out.append((m, "-", {"method": m}))
    return out


def _base(args: argparse.Namespace) -> dict:
    return {"dataset": args.dataset, "hidden": args.hidden, "num-clients": args.clients, "num-rounds": args.rounds,
            "seed": args.seed, "local-epochs": args.local_epochs, "batch-size": args.batch_size, "lr": args.lr,
            "epsilon": args.epsilon, "sample-rate": 1.0, "divergence-factor": 0.0, **common.parse_sets(args.set)}


def _secagg_config(args: argparse.Namespace) -> dict:
    from benchmarks.secagg_app import CONFIG

    base = _base(args)
    return {k: base[k] for k in CONFIG if k in base}


# ==================================================================== engines
class _CpuClock:
    """Stands in for the ``time`` module of :mod:`server.local_grid`: its per-client timer becomes CPU time."""

    perf_counter = staticmethod(time.process_time)


def _call_log_grid(base_cls: type, calls: list[tuple[float, float]]):
    """``base_cls`` (a LocalGrid) that logs ``(time.time() at the end, clients' CPU seconds)`` of every exchange."""

    class CallLogGrid(base_cls):  # type: ignore[misc, valid-type]
        def send_and_receive(self, messages, *, timeout=None):
            before = sum(self.client_time.values())
            replies = list(super().send_and_receive(messages, timeout=timeout))
            calls.append((time.time(), sum(self.client_time.values()) - before))
            return replies

    return CallLogGrid


@contextlib.contextmanager
def inprocess_engine(args: argparse.Namespace, calls: list):
    """``submit(overrides, secagg) -> exit code`` running in this process; client CPU logged into ``calls``."""
    from benchmarks.secagg_app import client_app, run_rounds
    from server import local_grid
    from server.launch import run_inprocess
    from server.local_grid import LocalGrid

    grid_cls = _call_log_grid(LocalGrid, calls)

    def submit(overrides: dict, secagg: bool) -> int:
        if secagg:
            run_rounds(grid_cls(client_app, int(overrides["num-clients"]), overrides), overrides, copies=True)
        else:
            run_inprocess(overrides, progress=lambda _s: None,
                          grid_factory=lambda app, n, raw: grid_cls(app, n, raw))
        return 0

    clock, local_grid.time = local_grid.time, _CpuClock  # type: ignore[assignment]
    try:
        yield submit
    finally:
        local_grid.time = clock  # type: ignore[assignment]


@contextlib.contextmanager
def simulation_engine(args: argparse.Namespace, app_dir: Path):
    """One private simulation-mode SuperLink for every run; ``submit(overrides, secagg)`` = ``flwr run``."""
    from server.flower_commands import flower_env, submit, superlink_cmd, write_connection
    from server.processes import Processes, free_port, wait_for_port, workspace

    with workspace(None) as work:
        env = flower_env(work / "flwr-home")
        procs = Processes(work, env)
        try:
            port = free_port()
            procs.start("superlink", superlink_cmd(port, work, simulation=True, tls=None))
            wait_for_port(port, procs=procs)
            conn = write_connection(work / "flwr-home", f"127.0.0.1:{port}")
            federation = f"num-supernodes={args.clients} client-resources-num-cpus=1"

            def run(overrides: dict, secagg: bool) -> int:
                from server.defaults import APP_DIR

                return submit(work, env, conn, overrides, federation_config=federation,
                              app_dir=app_dir if secagg else APP_DIR)

            yield run
        finally:
            procs.close()


@contextlib.contextmanager
def deployment_engine(args: argparse.Namespace, app_dir: Path):
    """A :class:`server.deploy.LocalCluster` of ``--clients`` SuperNodes; ``submit(overrides, secagg)``."""
    from server.deploy import LocalCluster
    from server.flower_commands import submit

    with LocalCluster(args.clients) as cluster:
        print(f"[deployment] warm ClientApps ready after {cluster.wait_warm():.1f} s", flush=True)

        def run(overrides: dict, secagg: bool) -> int:
            if secagg:
                return submit(cluster.work, cluster.env, cluster.connection, overrides, app_dir=app_dir)
            return cluster.submit(overrides)

        yield run


def warm_up(engine: Callable[[dict, bool], int], args: argparse.Namespace, folder: Path) -> None:
    """Unrecorded 2-round runs of cancelfl's app and of the SecAgg+ app before the timed ones.

    Each app's first run on a SuperLink installs its FAB on every node and fills the nodes' partition caches; without
    these runs the first timed run of each app (FedAvg's, the reference) absorbs that and every ratio to it comes out
    low.  Their trace lines come before every timed run's offset.
    """
    engine({**_base(args), "method": "fedavg", "num-rounds": 2, "fault-drop-rate": 0.0,
            "out-dir": str(folder / "warm-cancelfl")}, False)
    if not args.no_secagg:
        engine({**_secagg_config(args), "num-rounds": 2, "out-dir": str(folder / "warm-secagg")}, True)


# ==================================================================== one run -> one row
def _events(trace_file: Path, offset: int) -> list[dict]:
    if not trace_file.exists():
        return []
    with trace_file.open("rb") as fh:
        fh.seek(offset)
        lines = fh.read().decode(errors="replace").splitlines()
    events = []
    for line in lines:
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return events


def reduce_run(rows: list[dict], events: list[dict], calls: list[tuple[float, float]], *, rate: float,
               clients: int, engine: str) -> dict:
    """One table row from a run's ``metrics.jsonl`` rows, its trace events and (in-process) the clients' CPU log.

    Medians over the timed rounds (round > 1, not failed; a one-round run: round 1); phases as the last timed
    round ran them, ``phase_s`` their median wall times.
    """
    timed = [r for r in rows if r["round"] > 1 and not r["failed"]] or [r for r in rows[:1] if not r["failed"]]
    failed = sum(bool(r["failed"]) for r in rows)
    out: dict = {"dropped": median([r.get("dropped") if r.get("dropped") is not None
                                     else max(min(int(round(rate * clients)), clients - 1), 0) for r in timed]),
                 "first_round_s": rows[0]["round_time_s"] if rows else math.nan}
    if not timed:
        return out | {"status": f"failed {failed}/{len(rows)} rounds" if rows else "no rounds"}
    phases = list(timed[-1].get("phase_time_s", {}))
    phase_s = [median([r.get("phase_time_s", {}).get(p, math.nan) for r in timed]) for p in phases]
    out |= {"status": "ok" if not failed else f"failed {failed}/{len(rows)} rounds", "phases": "+".join(phases),
            "phase_count": len(phases), "phase_s": "+".join(common.fmt(v, 2) for v in phase_s),
            "round_s": median([r["round_time_s"] for r in timed]),
            "bytes_down": median([r["bytes_sent_per_client"] for r in timed]),
            "bytes_up": median([r["bytes_received_per_client"] for r in timed])}
    out["bytes_per_client"] = out["bytes_down"] + out["bytes_up"]
    by_round = {e["round"]: e for e in events if e.get("event") == "round"}
    server, client, cluster = [], [], []
    for r in timed:
        ev = by_round.get(r["round"])
        if ev is None:
            continue
        n = max(int(r.get("clients") or clients), 1)
        in_round = [c for t, c in calls if ev["t"] <= t <= ev["t_end"]]
        apps = [float(e.get("cpu", math.nan)) for e in events
                if e.get("event") == "clientapp" and ev["t"] <= e.get("t_fork", -1) <= ev["t_end"]]
        if engine == "inprocess":
            server.append(float(ev["server_cpu"]) - sum(in_round))
            client.append(sum(in_round) / n)
        else:
            server.append(float(ev["server_cpu"]))
            cluster.append(float(ev.get("cpu", math.nan)) or math.nan)
            client.append(sum(apps) / n if apps else math.nan)
    out |= {"server_cpu_s": median(server), "client_cpu_s": median(client), "cluster_cpu_s": median(cluster)}
    return out


def _ratios(rows: list[dict]) -> None:
    """Columns against other rows at the same dropout rate.

    ``round_s_x_fedavg``: round time over FedAvg's; ``extra_round_s``/``extra_bytes``: a double-masked row's round
    time and bytes per client less the same method's without double masking.
    """
    ref = {r["dropout"]: r.get("round_s", math.nan) for r in rows if r["name"] == common.reference()}
    today = {(r["name"], r["dropout"]): r for r in rows if r["masking"] == TODAY and r.get("status") == "ok"}
    for r in rows:
        den = ref.get(r["dropout"], math.nan)
        num = r.get("round_s", math.nan)
        r["round_s_x_fedavg"] = num / den if den and not math.isnan(den) and not math.isnan(num) else math.nan
        base = today.get((r["name"], r["dropout"])) if r["masking"] == NOW and r.get("status") == "ok" else None
        if base is not None:
            r["extra_round_s"] = r["round_s"] - base["round_s"]
            r["extra_bytes"] = r["bytes_per_client"] - base["bytes_per_client"]


def _measure(engine, overrides: dict, secagg: bool, run_dir: Path, trace_file: Path, calls: list, rate: float,
             args: argparse.Namespace) -> dict:
    """One run through ``engine``, reduced to its figures (:func:`reduce_run`) or an ``error`` status."""
    offset = trace_file.stat().st_size if trace_file.exists() else 0
    calls.clear()
    try:
        code = engine(overrides, secagg)
    except Exception as err:  # noqa: BLE001 - the row reports the failure and the benchmark goes on
        return {"status": f"error: {type(err).__name__}: {str(err)[:100]}"}
    metrics = run_dir / "metrics.jsonl"
    if code != 0 or not metrics.exists():
        return {"status": f"error: exit code {code}"}
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    if not lines:  # e.g. Flower's simulation runtime could not start Ray
        return {"status": "error: the run ended before its first round"}
    return reduce_run(lines, _events(trace_file, offset), calls, rate=rate, clients=args.clients, engine=args.engine)


# ==================================================================== the benchmark
def run(args: argparse.Namespace) -> int:
    """Every arm at every dropout rate in one engine; one row each."""
    from benchmarks.secagg_app import write_app

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in args.dropouts.split(",")]
    todo = [(name, masking, cfg, rate, False) for rate in rates for name, masking, cfg in arms(args)]
    if not args.no_secagg:
        todo += [("Flower SecAgg+", "SecAgg+", {}, rate, True) for rate in rates]
        todo.sort(key=lambda t: t[3])
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    rows: list[dict] = []
    calls: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(prefix="cancelfl-cost-") as tmp, contextlib.ExitStack() as stack:
        trace_file = Path(tmp) / "trace.jsonl"
        stack.enter_context(mock.patch.dict(os.environ, {TRACE_ENV: str(trace_file)}))
        app_dir = write_app(Path(tmp) / "secagg-app")
        engine: Callable[[dict, bool], int]
        if args.engine == "deployment":
            engine = stack.enter_context(deployment_engine(args, app_dir))
        elif args.engine == "simulation":
            engine = stack.enter_context(simulation_engine(args, app_dir))
        else:
            engine = stack.enter_context(inprocess_engine(args, calls))
        if args.engine in ("deployment", "simulation"):
            warm_up(engine, args, Path(tmp))
        for name, masking, cfg, rate, secagg in todo:
            run_dir = (out / "runs" / f"{name.split()[-1]}-{masking.split()[0]}-{rate}").resolve()
            overrides = ({**_secagg_config(args), "fault-drop-rate": rate, "out-dir": str(run_dir)} if secagg
                         else {**_base(args), **cfg, "fault-drop-rate": rate, "out-dir": str(run_dir)})
            base = {"name": name, "masking": masking, "engine": args.engine, "clients": args.clients, "dropout": rate}
            for attempt in range(1 + max(args.retries, 0)):
                row = base | _measure(engine, overrides, secagg, run_dir, trace_file, calls, rate, args)
                if attempt:
                    row["retried"] = attempt
                if not str(row["status"]).startswith("error"):
                    break
                print(f"{name} {masking} dropout={rate}: {row['status']} (attempt {attempt + 1})", flush=True)
            rows.append(row)
            common.write_table(rows, COLUMNS, out, "cost", title="Cost of a round (incomplete: the run goes on)",
                               command=common.command_line(args))
            print(f"{name:>14} {masking:>15} dropout={rate}: round={common.fmt(row.get('round_s'))}s "
                  f"phases={row.get('phases')} bytes={common.fmt(row.get('bytes_per_client'))} {row['status']}",
                  flush=True)
    _ratios(rows)
    total = time.perf_counter() - t0
    load_end = os.getloadavg()
    notes = [
        f"engine {args.engine}, {args.clients} clients, dataset {args.dataset}, MLP hidden {args.hidden!r}, "
        f"local-epochs {args.local_epochs}, batch-size {args.batch_size}, lr {args.lr}, epsilon {args.epsilon}, "
        f"seed {args.seed}; " + (f"{args.rounds} rounds, round 1 (start-up, key phase) not timed: medians over "
                                 f"rounds 2..{args.rounds}" if args.rounds > 1 else "1 round (timed)")
        + (f"; run-config {' '.join(args.set)}" if args.set else ""),
        f"masking: '{NOW}' = self-mask = true (the default: a Shamir-shared self-mask on every upload, a "
        f"query.recover phase every round); '{TODAY}' = self-mask = false (pair noise only; its direct reveal runs "
        "only in rounds with dropouts); SecAgg+ = FedAvg under Flower's SecAggPlusWorkflow (every client shares with "
        "every other, threshold 0.5), its phases are its stages",
        "dropout: run-config fault-drop-rate, round(rate x clients) clients' train messages withheld each round after "
        "the key phase (SecAgg+: before collect_masked_vectors); dropped: clients dropped per timed round",
        "round_s: wall time of the round (server-side evaluation excluded); bytes_down/bytes_up: payload bytes per "
        "client per round (the dropped clients' withheld messages count as sent); server_cpu_s: ServerApp CPU "
        "seconds in the round (in-process: the process's CPU less the clients'); client_cpu_s: one client's "
        "ClientApp CPU seconds per round (in-process: its calls; deployment: its per-message ClientApp processes; "
        "simulation: not measured); cluster_cpu_s: every process of the run (SuperLink, SuperNodes, ClientApps, "
        "ServerApp; simulation: also Ray's workers)",
        f"load average {load_start[0]:.2f}/{load_start[1]:.2f}/{load_start[2]:.2f} at start, "
        f"{load_end[0]:.2f}/{load_end[1]:.2f}/{load_end[2]:.2f} at the end (2-core machine shared with other jobs); "
        f"total time {total:.0f} s",
    ]
    if args.engine in ("deployment", "simulation"):
        notes.append("before the timed runs, an unrecorded 2-round run of each app (FAB install, partition caches"
                     + ("; after every SuperNode's warm ClientApp was ready)" if args.engine == "deployment" else ")"))
    if args.engine == "deployment":
        notes.append(f"deployment: a SuperLink and {args.clients} SuperNodes as processes on 127.0.0.1 "
                     "(server.deploy.LocalCluster, warm ClientApp processes, short polls)")
    common.publish(rows, COLUMNS, args, "cost", title=f"Cost of a round with and without dropouts ({args.engine})",
                   notes=notes, total=total)
    return 0 if all(r.get("status") == "ok" for r in rows) else 1
