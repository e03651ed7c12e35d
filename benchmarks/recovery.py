"""Cost of dropout recovery per surviving client, next to Flower's SecAgg+ with the same dropouts.

    cancelfl-bench recovery [--clients 100] [--dropouts 0.1,0.3] [--methods nadp,niss,mpddp] ...

cancelfl (:mod:`strategies.recovery`): one in-process round per method and dropout rate on the complete graph (the
worst case), drops from run-config ``fault-drop-rate``; reported: the recovery phase's client time per survivor,
the server's time (including removing the revealed noise) and the phase's bytes per survivor.

Flower's SecAgg+ (``SecAggPlusWorkflow`` + ``secaggplus_mod``, same model and data, ``--secagg-shares`` shares,
threshold ``--secagg-threshold``): the same fraction drops before ``collect_masked_vectors`` and its ``unmask``
stage is measured the same way.  SecAgg+ runs that stage every round, as does cancelfl's double masking
(``self-mask``); its direct reveal runs only in rounds with dropouts.  Times are CPU seconds
(``time.process_time``, so machine load does not inflate them) of sequential in-process clients; a deployment
adds one round trip per phase.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import numpy as np

from benchmarks import common

HELP = "cost of dropout recovery per surviving client vs Flower's SecAgg+"

COLUMNS = ("name", "clients", "dropout", "dropped", "survivors", "status", "client_s", "server_s", "bytes_down",
           "bytes_up", "bytes_per_survivor", "pairs")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl-bench recovery``."""
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--dropouts", default="0.1,0.3", help="fractions of the sampled clients that drop")
    p.add_argument("--methods", default="nadp,niss,mpddp")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--hidden", default="16")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--secagg-shares", default="all", help="SecAgg+ num_shares ('all' = every client)")
    p.add_argument("--secagg-threshold", type=float, default=0.5, help="SecAgg+ reconstruction threshold (fraction)")
    p.add_argument("--no-secagg", action="store_true", help="skip the SecAgg+ rows (its unmask costs minutes at 100)")
    p.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="extra run-config for the cancelfl runs")
    p.add_argument("--out", default="runs/bench/recovery")


class _CpuClock:
    """Stands in for the ``time`` module of :mod:`server.local_grid`: its per-client timer becomes CPU time."""

    perf_counter = staticmethod(time.process_time)


def _cpu_grid(base_cls: type, phase_of, drop_in=None):
    """A grid class measuring CPU seconds of one phase: the clients' and the whole exchange's, and its bytes.

    ``phase_of(messages) -> str`` names a call's phase; ``drop_in(phase, messages)`` filters messages (drops).
    """
    from strategies.validation import payload_bytes

    class CpuGrid(base_cls):  # type: ignore[misc, valid-type]
        stats: dict

        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            phase = phase_of(messages) if messages else ""
            if drop_in is not None:
                messages = drop_in(self, phase, messages)
            before = sum(self.client_time.values())
            t0 = time.process_time()
            replies = list(super().send_and_receive(messages, timeout=timeout))
            st = self.stats.setdefault(phase, {"cpu": 0.0, "client": 0.0, "down": 0, "up": 0, "nodes": 0})
            st["cpu"] += time.process_time() - t0
            st["client"] += sum(self.client_time.values()) - before
            st["down"] += sum(payload_bytes(m.content) for m in messages)
            st["up"] += sum(payload_bytes(r.content) for r in replies if not r.has_error())
            st["nodes"] = len(messages)
            return replies

    return CpuGrid


def _base(args: argparse.Namespace) -> dict:
    return {"dataset": args.dataset, "hidden": args.hidden, "num-clients": args.clients, "num-rounds": 1,
            "seed": args.seed, "local-epochs": 1, "graph": "complete", **common.parse_sets(args.set)}


def cancelfl_row(method: str, rate: float, args: argparse.Namespace, out: Path) -> dict:
    """One round of ``method`` with ``fault-drop-rate = rate``; the recovery phase's cost per survivor."""
    from server import local_grid
    from server.launch import run_inprocess
    from server.local_grid import LocalGrid

    row: dict = {"name": f"cancelfl {method}", "clients": args.clients, "dropout": rate}
    grids: list = []

    def factory(client_app, num_nodes: int, run_config: dict):
        grid = _cpu_grid(LocalGrid, lambda msgs: msgs[0].metadata.message_type)(client_app, num_nodes, run_config)
        grid.stats = {}
        grids.append(grid)
        return grid

    out_dir = out / "runs" / f"{method}-{rate}"  # the runs themselves (git-ignored under docs/results)
    clock, local_grid.time = local_grid.time, _CpuClock  # type: ignore[assignment]
    try:
        run_inprocess({**_base(args), "method": method, "fault-drop-rate": rate, "out-dir": str(out_dir)},
                      progress=lambda _s: None, grid_factory=factory)
    except Exception as err:  # noqa: BLE001 - a benchmark row reports the failure and goes on
        return row | {"status": f"error: {type(err).__name__}: {err}"[:120]}
    finally:
        local_grid.time = clock  # type: ignore[assignment]
    r = json.loads((out_dir / "metrics.jsonl").read_text().splitlines()[0])
    st = grids[0].stats.get("query.recover")
    survivors = args.clients - int(r.get("dropped", 0))
    if st is None or r["failed"]:
        return row | {"dropped": int(r.get("dropped", 0)), "survivors": survivors,
                      "status": "failed" if r["failed"] else "no recovery"}
    n = max(survivors, 1)
    return row | {
        "dropped": int(r["dropped"]), "survivors": survivors, "status": "ok", "client_s": st["client"] / n,
        "server_s": st["cpu"] - st["client"] + r.get("recovery_server_s", 0.0),
        "bytes_down": st["down"] / n, "bytes_up": st["up"] / n, "bytes_per_survivor": (st["down"] + st["up"]) / n,
        "pairs": r.get("recovered_pairs"),
    }


def secagg_row(rate: float, args: argparse.Namespace) -> dict:
    """Flower's SecAgg+ with ``round(rate * clients)`` clients dropping before ``collect_masked_vectors``."""
    from flwr.app import Context, Message, RecordDict
    from flwr.client import ClientApp as LegacyClientApp
    from flwr.client.mod import secaggplus_mod
    from flwr.common import ndarrays_to_parameters
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.strategy import FedAvg as LegacyFedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

    from benchmarks.secagg import legacy_fedavg_client, share_counts
    from server import local_grid
    from server.defaults import app_defaults
    from server.local_grid import SERVER_NODE_ID, LocalGrid

    k = args.clients
    shares = share_counts(args.secagg_shares, k)[0]
    raw = {**app_defaults(), **_base(args), "method": "fedavg"}
    client_fn, w0 = legacy_fedavg_client(raw, k)

    def stage_of(m) -> str:
        try:
            return str(m.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE])
        except KeyError:
            return ""

    drop: set[int] = set()

    def drop_in(_grid, phase: str, messages: list) -> list:
        if phase == Stage.COLLECT_MASKED_VECTORS:
            return [m for m in messages if m.metadata.dst_node_id not in drop]
        return messages

    def isolated(messages: list) -> str:
        return stage_of(messages[0])

    class DropGrid(_cpu_grid(LocalGrid, isolated, drop_in)):  # type: ignore[misc]
        """Delivers a private copy of every message (secaggplus_mod edits the content in place)."""

        def send_and_receive(self, messages, *, timeout=None):
            copies = [Message(copy.deepcopy(m.content), m.metadata.dst_node_id, m.metadata.message_type,
                              group_id=m.metadata.group_id) for m in messages]
            return super().send_and_receive(copies, timeout=timeout)

    grid = DropGrid(LegacyClientApp(client_fn=client_fn, mods=[secaggplus_mod]), k, raw)
    rng = np.random.default_rng([args.seed, 1, 0xFA17])
    drop.update(grid.node_ids[int(i)] for i in rng.choice(k, size=round(rate * k), replace=False))
    grid.stats = {}
    strategy = LegacyFedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=k, min_available_clients=k,
                            initial_parameters=ndarrays_to_parameters([v.astype(np.float32) for v in w0.values()]))
    ctx = LegacyContext(Context(run_id=1, node_id=SERVER_NODE_ID, node_config={}, state=RecordDict(), run_config={}),
                        config=ServerConfig(num_rounds=1), strategy=strategy)
    workflow = SecAggPlusWorkflow(num_shares=shares, reconstruction_threshold=args.secagg_threshold)
    unmask = workflow.unmask_stage
    server_extra = {"s": 0.0}

    def timed_unmask(g, c, state, unmask=unmask):
        t0 = time.process_time()
        before = grid.stats.get(Stage.UNMASK, {}).get("cpu", 0.0)
        try:
            return unmask(g, c, state)
        finally:  # the stage's own work outside the message exchange (reconstruction, mask regeneration)
            server_extra["s"] += (time.process_time() - t0) - (grid.stats.get(Stage.UNMASK, {}).get("cpu", 0.0)
                                                              - before)

    workflow.unmask_stage = timed_unmask  # type: ignore[method-assign]
    row: dict = {"name": f"Flower SecAgg+ (shares={shares}, t={args.secagg_threshold})", "clients": k,
                 "dropout": rate, "dropped": len(drop), "survivors": k - len(drop)}
    clock, local_grid.time = local_grid.time, _CpuClock  # type: ignore[assignment]
    try:
        DefaultWorkflow(fit_workflow=workflow)(grid, ctx)
    except Exception as err:  # noqa: BLE001
        return row | {"status": f"error: {type(err).__name__}: {err}"[:120]}
    finally:
        local_grid.time = clock  # type: ignore[assignment]
    st = grid.stats.get(Stage.UNMASK)
    if st is None:
        return row | {"status": "no unmask stage (halted)"}
    n = max(st["nodes"], 1)
    return row | {"status": "ok", "client_s": st["client"] / n, "server_s": st["cpu"] - st["client"]
                  + server_extra["s"], "bytes_down": st["down"] / n, "bytes_up": st["up"] / n,
                  "bytes_per_survivor": (st["down"] + st["up"]) / n, "pairs": math.nan}


def run(args: argparse.Namespace) -> int:
    """Recovery cost per surviving client for each method and dropout rate, then SecAgg+ with the same drops."""
    out = Path(args.out)
    rates = [float(r) for r in args.dropouts.split(",")]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    t0 = time.perf_counter()
    rows = []
    for rate in rates:
        for m in methods:
            rows.append(cancelfl_row(m, rate, args, out))
            print(rows[-1], flush=True)
        if not args.no_secagg:
            rows.append(secagg_row(rate, args))
            print(rows[-1], flush=True)
    notes = [
        "cancelfl: complete pairing graph, one round, run-config fault-drop-rate; CPU seconds: client_s = the "
        "recovery phase's ClientApp time per surviving client, server_s = the phase's CPU minus the clients' plus "
        "the removal of the revealed noise from the aggregate; bytes = request + reply of the recovery phase per "
        "surviving client",
        "SecAgg+: the same fraction drops before collect_masked_vectors; its unmask stage measured the same way "
        "(it runs in every round, also without dropouts)",
        f"dataset {args.dataset}, MLP hidden {args.hidden!r}, {args.clients} clients, seed {args.seed}; in-process, "
        "sequential clients (deployment adds one round trip per phase)",
    ]
    common.publish(rows, COLUMNS, args, "recovery", title="Cost of dropout recovery per surviving client",
                   notes=notes, total=time.perf_counter() - t0)
    return 0 if all(r.get("status") == "ok" for r in rows) else 1
