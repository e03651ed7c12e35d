"""Flower's SecAgg+ on the same model and data as the cancelfl methods: the secure-aggregation reference.

A legacy ``NumPyClient`` that trains like the cancelfl FedAvg client, wrapped in Flower's
``secaggplus_mod`` and driven by ``SecAggPlusWorkflow`` (legacy ``DefaultWorkflow``) through the
same in-process grid the benchmarks observe; the same legacy app without SecAgg+ is its baseline.
"""

from __future__ import annotations

import math
import time

import numpy as np


def share_counts(spec: str, k: int) -> list[int]:
    """SecAgg+ ``num_shares`` values for ``k`` clients ('all' = k); an even value below k is made odd.

    Flower 1.41's workflow sends an even ``num_shares`` to the clients *before* bumping it to the next odd
    number for its neighbour graph, so the clients create one share too few and fail (IndexError).
    """
    out = []
    for s in spec.split(","):
        s = s.strip()
        n = min(k if s in ("all", "k", "K") else int(s), k)
        if n < k and n % 2 == 0:
            n += 1
        out.append(n)
    return list(dict.fromkeys(out))


def legacy_fedavg_client(raw: dict, clients: int):
    """``(client_fn, initial weights)`` of a legacy ``NumPyClient`` that trains like the cancelfl FedAvg client.

    Same model, partition and SGD settings as the run config ``raw`` (seeded per partition); the SecAgg+
    references (this module, :mod:`benchmarks.recovery`) wrap it in ``secaggplus_mod``.
    """
    from flwr.app import Context
    from flwr.client import NumPyClient

    from protocols.config import RunConfig
    from protocols.task.data import client_partition, dataset_for
    from protocols.task.models import build_model, get_weights, set_weights
    from protocols.task.training import train

    cfg = RunConfig.from_mapping(raw)
    ds = dataset_for(cfg)
    w0 = get_weights(build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed))
    keys = list(w0)

    class BenchClient(NumPyClient):
        """Trains like the cancelfl FedAvg client."""

        def __init__(self, pid: int) -> None:
            self.pid = pid

        def fit(self, parameters, config):
            x, y = client_partition(cfg, self.pid, clients)
            model = build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed)
            set_weights(model, dict(zip(keys, parameters, strict=True)))
            train(model, x, y, epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr, seed=cfg.seed + self.pid)
            return [v.astype(np.float32) for v in get_weights(model).values()], len(y), {}

    def client_fn(context: Context):
        return BenchClient(int(context.node_config["partition-id"])).to_client()

    return client_fn, w0


def secaggplus_reference(base: dict, clients: int, num_shares: int, threshold: float, rounds: int = 1) -> dict:
    """Flower's SecAgg+ on the same model/data, in-process; figures for the legacy app with and without it."""
    from flwr.app import Context, RecordDict
    from flwr.client import ClientApp as LegacyClientApp
    from flwr.client.mod import secaggplus_mod
    from flwr.common import ndarrays_to_parameters
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.strategy import FedAvg as LegacyFedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

    from benchmarks.adversary.observe import ObservedLocalGrid
    from server.defaults import app_defaults
    from server.local_grid import SERVER_NODE_ID
    from strategies.validation import payload_bytes

    raw = {**app_defaults(), **base, "num-clients": clients, "method": "fedavg"}
    client_fn, w0 = legacy_fedavg_client(raw, clients)

    results = {}
    for label, secure in (("secagg+ fedavg", False), (f"secagg+ (shares={num_shares})", True)):
        app = LegacyClientApp(client_fn=client_fn, mods=[secaggplus_mod] if secure else [])
        grid = ObservedLocalGrid(app, clients, raw)
        grid.isolate_messages = True
        sent, recv = {}, {}

        def hook(msgs, replies, sent=sent, recv=recv) -> None:
            for m in msgs:
                sent[m.metadata.dst_node_id] = sent.get(m.metadata.dst_node_id, 0) + payload_bytes(m.content)
            for r in replies:
                if not r.has_error():
                    recv[r.metadata.src_node_id] = recv.get(r.metadata.src_node_id, 0) + payload_bytes(r.content)

        grid.hooks = [hook]
        strategy = LegacyFedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=clients,
                                min_available_clients=clients,
                                initial_parameters=ndarrays_to_parameters([v.astype(np.float32) for v in w0.values()]))
        ctx = LegacyContext(Context(run_id=1, node_id=SERVER_NODE_ID, node_config={}, state=RecordDict(), run_config={}),
                            config=ServerConfig(num_rounds=rounds), strategy=strategy)
        per_round = []
        fit = SecAggPlusWorkflow(num_shares=num_shares, reconstruction_threshold=threshold) if secure else None

        def timed_fit(g, c, fit=fit, per_round=per_round, grid=grid, sent=sent, recv=recv) -> None:
            from flwr.server.workflow.default_workflows import default_fit_workflow

            before = sum(grid.client_time.values())
            sent.clear()
            recv.clear()
            t = time.perf_counter()
            (fit or default_fit_workflow)(g, c)
            wall = time.perf_counter() - t
            ct = sum(grid.client_time.values()) - before
            per_round.append((wall, ct, sum(sent.values()) / clients, sum(recv.values()) / clients))

        from flwr.server.workflow.constant import MAIN_PARAMS_RECORD

        DefaultWorkflow(fit_workflow=timed_fit)(grid, ctx)
        final = [a.numpy() for a in ctx.state.array_records[MAIN_PARAMS_RECORD].values()]
        if all(np.array_equal(f, np.asarray(v, dtype=np.float32)) for f, v in zip(final, w0.values(), strict=True)):
            raise RuntimeError(f"{label}: the workflow halted without aggregating (see Flower's log above)")
        timed = per_round[1:] or per_round
        wall, ct, bdown, bup = (float(np.mean([p[i] for p in timed])) for i in range(4))
        results[label] = {"name": label, "clients": clients, "status": "ok", "round_s": wall,
                          "client_s": ct / clients, "server_s": max(wall - ct, 0.0),
                          "deployed_s": max(wall - ct, 0.0) + ct / clients, "bytes_down": bdown, "bytes_up": bup,
                          "bytes_per_client_round": bdown + bup, "final_accuracy": math.nan}
    secure_row = results[f"secagg+ (shares={num_shares})"]
    plain = results["secagg+ fedavg"]
    for col in ("client_s", "server_s", "deployed_s"):
        secure_row[f"{col}_x_legacy"] = secure_row[col] / plain[col] if plain[col] > 0 else math.nan
    return secure_row | {"legacy_fedavg_client_s": plain["client_s"], "legacy_fedavg_server_s": plain["server_s"]}
