"""Flower's SecAgg+ (FedAvg under ``SecAggPlusWorkflow``) as a Flower app of its own: the cost benchmark's reference.

The same legacy client as :mod:`benchmarks.secagg` (trains like the cancelfl FedAvg client, wrapped in
``secaggplus_mod``), driven by ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))``.  It runs in-process on
a :class:`server.local_grid.LocalGrid` (:func:`run_rounds`) or, as a FAB of its own (:func:`write_app`), under
Flower's simulation runtime or a deployment, next to the cancelfl app on the same SuperLink.

Every round writes one line of ``metrics.jsonl`` into run-config ``out-dir`` with the fields of the cancelfl round
loop's (``round_time_s``, ``bytes_sent_per_client``, ``bytes_received_per_client``, ``phase_time_s`` keyed by SecAgg+
stage, ``dropped``, ``failed``) and, with ``CANCELFL_TRACE`` set, the loop's ``round`` trace event
(:mod:`protocols.trace`).  Run-config ``fault-drop-rate``: that fraction of the round's clients (as
:func:`strategies.run.faults.fault_drops` counts them) gets no ``collect_masked_vectors`` message, so the unmask
stage reconstructs their masks.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from flwr.app import Context, Message, RecordDict
from flwr.client import ClientApp as LegacyClientApp
from flwr.client.mod import secaggplus_mod
from flwr.server import ServerApp

from protocols.trace import trace, traced_cpu, tracing
from strategies.run.grid import MeteredGrid
from strategies.validation import payload_bytes

#: The app's run-config keys and defaults (the FAB declares exactly these); the task keys mean what they mean for
#: the cancelfl app.  ``secagg-shares`` 0 = every client; ``secagg-threshold``: reconstruction threshold (fraction).
CONFIG: dict[str, object] = {"dataset": "digits", "hidden": "32", "train-subset": 0, "test-subset": 0,
                             "num-clients": 10, "num-rounds": 4, "seed": 42, "local-epochs": 1, "batch-size": 32,
                             "lr": 0.1, "fault-drop-rate": 0.0, "secagg-shares": 0, "secagg-threshold": 0.5,
                             "out-dir": ""}

#: The method name the app's rows and trace events carry.
NAME = "secagg+"


def _task_config(run_config: Mapping) -> dict:
    """The cancelfl run-config of the task (FedAvg's client on the same model and data)."""
    from server.defaults import app_defaults

    keys = {k: run_config[k] for k in CONFIG if k in run_config and not k.startswith("secagg-")}
    return {**app_defaults(), **keys, "method": "fedavg"}


def _client_fn(context: Context):
    from benchmarks.secagg import legacy_fedavg_client

    raw = _task_config(context.run_config)
    return legacy_fedavg_client(raw, int(raw["num-clients"]))[0](context)


#: The ClientApp: the legacy FedAvg client behind Flower's ``secaggplus_mod``.
client_app = LegacyClientApp(client_fn=_client_fn, mods=[secaggplus_mod])

#: The ServerApp: :func:`run_rounds` on the grid Flower gives it.
server_app = ServerApp()


@server_app.main()
def _main(grid, context: Context) -> None:
    run_rounds(grid, dict(context.run_config), context=context)


def _stage(message: Message) -> str:
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    try:
        return str(message.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE])
    except KeyError:
        return message.metadata.message_type


class StageGrid(MeteredGrid):
    """:class:`MeteredGrid` whose phase times are keyed by SecAgg+ stage; drops clients before collect.

    ``copies``: deliver a private copy of every message (``secaggplus_mod`` edits the content in place, which an
    in-process grid would hand back to the server).
    """

    def __init__(self, inner, *, rate: float, seed: int, copies: bool) -> None:
        super().__init__(inner, seed=seed)
        self.rate, self.copies, self.round = float(rate), copies, 0
        self.dropped: set[int] = set()

    def send_and_receive(self, messages, *, timeout=None):
        """Send one stage's messages (less the dropped clients' at collect); bytes and time per stage."""
        from flwr.common.secure_aggregation.secaggplus_constants import Stage

        messages = list(messages)
        if not messages:
            return []
        stage = _stage(messages[0])
        if stage == Stage.COLLECT_MASKED_VECTORS and self.rate > 0:
            nodes = sorted(m.metadata.dst_node_id for m in messages)
            count = max(min(int(round(self.rate * len(nodes))), len(nodes) - 1), 0)
            rng = np.random.default_rng([self.seed, self.round, 0xFA17])  # as strategies.run.faults
            self.dropped = {nodes[int(i)] for i in rng.choice(len(nodes), size=count, replace=False)}
            for m in messages:  # counted as sent, never delivered (as the cancelfl loop's fault injection)
                if m.metadata.dst_node_id in self.dropped:
                    self.sent[m.metadata.dst_node_id] += payload_bytes(m.content)
            messages = [m for m in messages if m.metadata.dst_node_id not in self.dropped]
        if self.copies:
            messages = [Message(copy.deepcopy(m.content), m.metadata.dst_node_id, m.metadata.message_type,
                                group_id=m.metadata.group_id) for m in messages]
        replies = list(super().send_and_receive(messages, timeout=timeout))
        mtype = messages[0].metadata.message_type if messages else ""
        if mtype != stage:
            self.phase_times[stage] += self.phase_times.pop(mtype, 0.0)
        return replies


def run_rounds(grid, run_config: dict, *, context: Context | None = None, copies: bool = False) -> list[dict]:
    """Run-config ``num-rounds`` SecAgg+ FedAvg rounds on ``grid``; returns (and writes) one row per round.

    Args:
        grid: the grid the ServerApp gets (or a LocalGrid of :data:`client_app`).
        run_config: the app's run-config (:data:`CONFIG` keys).
        context: the ServerApp's context (None: a fresh one, in-process).
        copies: deliver message copies (in-process grids).
    """
    from flwr.common import ndarrays_to_parameters
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.strategy import FedAvg as LegacyFedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_PARAMS_RECORD

    from benchmarks.secagg import legacy_fedavg_client, share_counts
    from server.local_grid import SERVER_NODE_ID

    raw = {**CONFIG, **run_config}
    k, rounds = int(raw["num-clients"]), int(raw["num-rounds"])
    shares = share_counts("all" if int(raw["secagg-shares"]) <= 0 else str(raw["secagg-shares"]), k)[0]
    w0 = legacy_fedavg_client(_task_config(raw), k)[1]
    sgrid = StageGrid(grid, rate=float(raw["fault-drop-rate"]), seed=int(raw["seed"]), copies=copies)
    strategy = LegacyFedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=k, min_available_clients=k,
                            initial_parameters=ndarrays_to_parameters([v.astype(np.float32) for v in w0.values()]))
    if context is None:
        context = Context(run_id=1, node_id=SERVER_NODE_ID, node_config={}, state=RecordDict(), run_config={})
    ctx = LegacyContext(context, config=ServerConfig(num_rounds=rounds), strategy=strategy)
    workflow = SecAggPlusWorkflow(num_shares=shares, reconstruction_threshold=float(raw["secagg-threshold"]))
    out = Path(str(raw["out-dir"])) if raw["out-dir"] else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text("")
    rows: list[dict] = []

    def params(c) -> list[np.ndarray]:
        return [a.numpy().copy() for a in c.state.array_records[MAIN_PARAMS_RECORD].values()]

    def timed_fit(g, c) -> None:
        sgrid.reset()
        sgrid.round += 1
        sgrid.dropped = set()
        before = params(c)
        cpu0 = traced_cpu() if tracing() else 0.0
        t0, t0_wall, own0 = time.perf_counter(), time.time(), time.process_time()
        workflow(g, c)
        wall, t_end, own = time.perf_counter() - t0, time.time(), time.process_time() - own0
        cpu = traced_cpu() - cpu0 if tracing() else 0.0
        failed = all(np.array_equal(a, b) for a, b in zip(before, params(c), strict=True))
        row = {"round": sgrid.round, "round_time_s": wall,
               "bytes_sent_per_client": sum(sgrid.sent.values()) / max(len(sgrid.sent), 1),
               "bytes_received_per_client": sum(sgrid.received.values()) / max(len(sgrid.received), 1),
               "clients": len(sgrid.received), "phase_time_s": dict(sgrid.phase_times),
               "dropped": len(sgrid.dropped), "failed": failed, "method": NAME, "num_shares": shares}
        rows.append(row)
        if out is not None:
            with (out / "metrics.jsonl").open("a") as fh:
                fh.write(json.dumps(row) + "\n")
        trace("round", round=sgrid.round, method=NAME, t=t0_wall, t_end=t_end, t_evaluated=t_end, t_next=time.time(),
              cpu=cpu, server_cpu=own)

    DefaultWorkflow(fit_workflow=timed_fit)(sgrid, ctx)
    return rows


def write_app(folder: Path) -> Path:
    """Write this app's Flower project (``pyproject.toml`` only; the code is this installed module) into ``folder``.

    Returns:
        ``folder``, for ``flwr run <folder>``.
    """
    from server.flower_commands import toml_value

    folder.mkdir(parents=True, exist_ok=True)
    config = "\n".join(f"{k} = {toml_value(v)}" for k, v in CONFIG.items())
    (folder / "pyproject.toml").write_text(f"""[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "cancelfl-secaggplus-bench"
version = "0.1.0"
description = "Flower's SecAgg+ FedAvg: the cancelfl cost benchmark's reference"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "cancelfl"

[tool.flwr.app.components]
serverapp = "benchmarks.secagg_app:server_app"
clientapp = "benchmarks.secagg_app:client_app"

[tool.flwr.app.config]
{config}
""")
    return folder
