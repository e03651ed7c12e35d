"""Common machinery of every cancelfl strategy.

A method's server side is a :class:`CancelStrategy` (a Flower ``Strategy``):
``configure_train`` may run extra message phases through the Grid it receives
(key exchange, share relay) before returning the train messages;
``aggregate_train`` returns the new global model.  The runner
(:mod:`server.runner`) drives rounds, evaluates centrally and asks the strategy
for :meth:`privacy_report` and :meth:`round_report` to log each round.

Message layout (all methods): the server sends ``RecordDict({"arrays":
ArrayRecord, "config": ConfigRecord})``; a client replies with ``"arrays"``
(its upload) and ``"metrics"`` (``num-examples`` and method figures).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from logging import WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from client.wire import Weights, from_record, to_record
from protocols.config import RunConfig


class RoundFailed(RuntimeError):
    """A round cannot produce a correct aggregate (raised, never a silent wrong model)."""


def split_replies(replies: Iterable[Message]) -> tuple[list[Message], list[str]]:
    """Separate good replies from failures, describing each failure."""
    good, errors = [], []
    for r in replies:
        if r.has_error():
            errors.append(f"node {r.metadata.src_node_id}: {r.error.reason}")
        else:
            good.append(r)
    return good, errors


def wait_for_nodes(grid: Grid, count: int, timeout: float) -> list[int]:
    """Block until ``count`` nodes are connected (deployment nodes register over ~10 s)."""
    deadline = time.time() + timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= count:
            return nodes
        if time.time() > deadline:
            raise RoundFailed(f"only {len(nodes)} of the {count} expected nodes connected within {timeout:.0f} s "
                              "(run-config 'num-clients')")
        time.sleep(1.0)


class CancelStrategy(Strategy):
    """Base strategy: client sampling, weighted aggregation, reporting hooks."""

    #: Dtype of model arrays on the wire.
    wire_dtype: type = np.float32

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.sampled: list[int] = []
        self._round_report: dict[str, float] = {}

    # --------------------------------------------------------------- sampling
    def sample_nodes(self, grid: Grid, server_round: int) -> list[int]:
        """Sample ``clients-per-round`` nodes, deterministically from (seed, round)."""
        nodes = wait_for_nodes(grid, self.cfg.num_clients, self.cfg.round_timeout)
        rng = np.random.default_rng([self.cfg.seed, server_round, 0x5A3])
        k = min(self.cfg.clients_per_round, len(nodes))
        # Sample positions, not ids: node ids are up to 2**64 and numpy would turn them into floats.
        self.sampled = sorted(nodes[int(i)] for i in rng.choice(len(nodes), size=k, replace=False))
        return self.sampled

    def make_messages(self, nodes: Iterable[int], content_fn, message_type: str = "train") -> list[Message]:
        """One message per node with content from ``content_fn(node_id) -> RecordDict``."""
        return [Message(content_fn(n), n, message_type) for n in nodes]

    def exchange(self, grid: Grid, nodes: Iterable[int], content_fn, action: str) -> tuple[dict[int, Message], list[str]]:
        """Run one extra ``query.<action>`` phase; returns good replies by node and errors."""
        msgs = self.make_messages(nodes, content_fn, f"query.{action}")
        replies = grid.send_and_receive(msgs, timeout=self.cfg.round_timeout)
        good, errors = split_replies(replies)
        for e in errors:
            log(WARNING, "phase %s: %s", action, e.splitlines()[0])
        return {r.metadata.src_node_id: r for r in good}, errors

    # ------------------------------------------------------------ Flower API
    def train_config(self, server_round: int) -> ConfigRecord:
        """Per-round config sent with the model (methods extend it)."""
        return ConfigRecord({"round": server_round})

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Sample clients and send them the global model."""
        self._round_report = {}
        nodes = self.sample_nodes(grid, server_round)
        cfg_rec = self.train_config(server_round)
        return self.make_messages(nodes, lambda _n: RecordDict({"arrays": arrays, "config": cfg_rec}))

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Weighted average (by ``num-examples``) of the uploaded arrays."""
        good, errors = split_replies(replies)
        if errors:
            for e in errors:
                log(WARNING, "round %d: %s", server_round, e.splitlines()[0])
        if not good:
            raise RoundFailed(f"round {server_round}: no client replied ({len(errors)} errors)")
        weights = [self.weight_of(r) for r in good]
        uploads = [from_record(r.content["arrays"]) for r in good]
        agg = weighted_average(uploads, weights)
        return to_record(agg, self.wire_dtype), self.mean_metrics(good)

    def weight_of(self, reply: Message) -> float:
        """Aggregation weight of one reply (default: its number of examples)."""
        return float(reply.content["metrics"]["num-examples"])

    @staticmethod
    def mean_metrics(replies: list[Message]) -> MetricRecord:
        """Example-weighted mean of every numeric client metric."""
        total = sum(float(r.content["metrics"]["num-examples"]) for r in replies)
        keys = set().union(*(r.content["metrics"].keys() for r in replies)) - {"num-examples"}
        out = {k: sum(float(r.content["metrics"].get(k, 0.0)) * float(r.content["metrics"]["num-examples"])
                      for r in replies) / total for k in keys}
        out["num-examples"] = total
        return MetricRecord(out)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """No federated evaluation: the server evaluates the global model centrally."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Unused (see :meth:`configure_evaluate`)."""
        return None

    def close(self) -> None:
        """Release what the strategy holds between rounds (nothing by default); called once after the run."""

    def summary(self) -> None:
        """Log the method and its key parameters."""
        log(20, "cancelfl method %s: %s", self.cfg.method, self.describe())

    # -------------------------------------------------------- reporting hooks
    def describe(self) -> dict[str, float | str]:
        """Key parameters of the method (logged and stored in summary.json)."""
        return {}

    def privacy_report(self, server_round: int) -> dict[str, float]:
        """Epsilon spent after ``server_round`` rounds: keys ``epsilon`` (+ uplink/downlink)."""
        return {}

    def round_report(self) -> dict[str, float]:
        """Extra per-round figures (e.g. cancellation residual), reset every round."""
        return dict(self._round_report)

    def report(self, **values: float) -> None:
        """Record per-round figures for :meth:`round_report`."""
        self._round_report.update({k: float(v) for k, v in values.items()})


def weighted_average(uploads: list[dict[str, np.ndarray]], weights: list[float]) -> Weights:
    """Σ w_i x_i / Σ w_i per array, in float64."""
    total = float(sum(weights))
    if total <= 0:
        raise RoundFailed("aggregation weights sum to zero")
    out: Weights = OrderedDict()
    for k in uploads[0]:
        acc = np.zeros_like(uploads[0][k], dtype=np.float64)
        for up, w in zip(uploads, weights, strict=True):
            acc += (w / total) * up[k]
        out[k] = acc
    return out
