"""Common machinery of every cancelfl strategy: the round template and its hooks.

A method's server side is a :class:`CancelStrategy` (a Flower ``Strategy``).
The base writes the round skeleton once (:meth:`CancelStrategy.configure_train`,
:meth:`CancelStrategy.aggregate_train`); a method overrides small hooks:

* :meth:`~CancelStrategy.prepare_round` -- after sampling: extra message
  phases through the Grid (key exchange, share relay), calibration; returns the
  round's :class:`RoundState` (methods subclass it);
* :meth:`~CancelStrategy.train_content` -- the train message of one participant;
* :meth:`~CancelStrategy.after_replies` -- bookkeeping on the good train replies
  (by default: a key phase forgets the participants that did not reply);
* :meth:`~CancelStrategy.aggregate` -- the new global model from the
  participants' replies;
* :meth:`~CancelStrategy.account_round` -- compose what the round releases into
  the method's :class:`~protocols.privacy.PrivacyLedger` (``self.privacy``).

The runner (:mod:`server.runner`) drives rounds, evaluates centrally and asks
the strategy for :meth:`privacy_report` (read from ``self.privacy``, written
once here) and :meth:`round_report` to log each round.

Message layout (all methods): the server sends ``RecordDict({"arrays":
ArrayRecord, "config": ConfigRecord})``; a client replies with ``"arrays"``
(its upload) and ``"metrics"`` (:func:`client.messages.common.train_metrics`:
its number of examples and method figures).  Config and metric keys belong to
the message classes of :mod:`client.messages`.
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from logging import WARNING
from typing import Protocol

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from client.messages.common import TrainIns, mean_metrics, num_examples
from client.wire import Weights, from_record, to_record
from protocols.config import RunConfig
from protocols.methods import METHODS
from protocols.privacy import PrivacyLedger


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


class ForgetsUnresponsive(Protocol):
    """What the template needs of a key phase (:class:`strategies.key_phase.KeyPhase`)."""

    def forget_unresponsive(self, participants: Iterable[int], replies: Iterable[Message]) -> None: ...


@dataclass
class RoundState:
    """What the server keeps between ``configure_train`` and ``aggregate_train`` of one round.

    Methods subclass it with their round's secrets and plan (e.g. ``NadpRound(RoundState)``).
    """

    round: int
    #: Nodes sent a train message this round (replies from anyone else are ignored).
    participants: list[int]


class CancelStrategy(Strategy):
    """Base strategy: the round template, client sampling, weighted aggregation, reporting hooks."""

    #: Dtype of model arrays on the wire.
    wire_dtype: type = np.float32
    #: The key phase of a pairwise-noise method (``self.keys = KeyPhase(cfg)``,
    #: :mod:`strategies.key_phase`); None for the others.
    keys: ForgetsUnresponsive | None = None

    def __init_subclass__(cls, **kwargs: object) -> None:
        """Every strategy also takes keyword arguments: ``NadpStrategy(epsilon=1.0, clip=1.0, num_clients=10)``.

        A subclass's ``__init__(self, cfg)`` is wrapped to accept ``cfg`` or run-config options instead
        (:func:`config_for`); the wrapped body still receives a validated :class:`RunConfig`.
        """
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None or getattr(init, "takes_options", False):
            return

        @functools.wraps(init)
        def __init__(self, cfg: RunConfig | None = None, /, **options: object) -> None:
            init(self, config_for(type(self), cfg, options))

        __init__.takes_options = True  # type: ignore[attr-defined]
        cls.__init__ = __init__  # type: ignore[method-assign]

    def __init__(self, cfg: RunConfig | None = None, /, **options: object) -> None:
        cfg = config_for(type(self), cfg, options)
        self.cfg = cfg
        self.sampled: list[int] = []
        self._round_report: dict[str, float] = {}
        #: The current (or last) round's state, set by :meth:`configure_train`.
        self._state: RoundState | None = None
        #: The method's privacy accounts (no guarantee until a method sets its accountants).
        self.privacy = PrivacyLedger(cfg.delta)

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

    # ------------------------------------------------- round template (Flower API)
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Sample, prepare the round (:meth:`prepare_round`), send each participant its train message."""
        self._round_report = {}
        self._state = None
        nodes = self.sample_nodes(grid, server_round)
        state = self.prepare_round(grid, server_round, nodes, arrays)
        self._state = state
        messages = self.make_messages(state.participants, lambda node: self.train_content(state, node, arrays))
        self.account_round(state)  # the participants are told to train and upload: count the release now
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Split the replies, run :meth:`after_replies`, aggregate the participants' good replies."""
        state = self._state
        if state is None or state.round != server_round:
            raise RoundFailed(f"round {server_round}: no round state (configure_train did not run for this round)")
        good, errors = split_replies(replies)
        for e in errors:
            log(WARNING, "round %d: %s", server_round, e.splitlines()[0])
        self.after_replies(state, good)
        participants = set(state.participants)
        by_node = {r.metadata.src_node_id: r for r in good if r.metadata.src_node_id in participants}
        if not by_node:
            raise RoundFailed(f"round {server_round}: no participant replied ({len(errors)} errors)")
        arrays = self.aggregate(state, by_node, errors)
        return arrays, self.mean_metrics(list(by_node.values()))

    # ------------------------------------------------------------------- hooks
    def prepare_round(self, grid: Grid, server_round: int, nodes: list[int], arrays: ArrayRecord) -> RoundState:
        """Everything between sampling and the train messages (extra phases, calibration); default: nothing."""
        return RoundState(server_round, list(nodes))

    def train_config(self, server_round: int) -> ConfigRecord:
        """Config every participant gets with the model (default: the round number)."""
        return TrainIns(server_round).to_config()

    def train_content(self, state: RoundState, node: int, arrays: ArrayRecord) -> RecordDict:
        """The train message of ``node``: the global model and :meth:`train_config`."""
        return RecordDict({"arrays": arrays, "config": self.train_config(state.round)})

    def account_round(self, state: RoundState) -> None:
        """Compose the round's releases into ``self.privacy`` (once its train messages exist); default: nothing.

        Releases only known from the replies (dropouts, un-noised uploads) are composed in :meth:`aggregate`.
        """

    def after_replies(self, state: RoundState, good: list[Message]) -> None:
        """Bookkeeping on the round's good replies; a key phase forgets the participants that failed."""
        if self.keys is not None:
            self.keys.forget_unresponsive(state.participants, good)

    def aggregate(self, state: RoundState, by_node: dict[int, Message], errors: list[str]) -> ArrayRecord | None:
        """Weighted average (:meth:`weight_of`, by default ``num-examples``) of the uploaded arrays."""
        nodes = sorted(by_node)
        weights = [self.weight_of(by_node[n]) for n in nodes]
        uploads = [from_record(by_node[n].content["arrays"]) for n in nodes]
        return to_record(weighted_average(uploads, weights), self.wire_dtype)

    def weight_of(self, reply: Message) -> float:
        """Aggregation weight of one reply (default: its number of examples)."""
        return float(num_examples(reply.content["metrics"]))

    @staticmethod
    def mean_metrics(replies: list[Message]) -> MetricRecord:
        """Example-weighted mean of every numeric client metric."""
        return mean_metrics([r.content["metrics"] for r in replies])

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
        """Epsilon spent so far, read from ``self.privacy``: ``epsilon``, ``epsilon_uplink``, ``epsilon_downlink``.

        ``inf`` where the method gives no guarantee; the ledger's extra accounts go to the round report
        (``epsilon_<name>``).  ``server_round`` is the round just finished (the accountants hold the releases).
        """
        extra = self.privacy.extra_report()
        if extra:
            self.report(**extra)
        return self.privacy.report()

    def round_report(self) -> dict[str, float]:
        """Extra per-round figures (e.g. cancellation residual), reset every round."""
        return dict(self._round_report)

    def report(self, **values: float) -> None:
        """Record per-round figures for :meth:`round_report`."""
        self._round_report.update({k: float(v) for k, v in values.items()})


def registered_method(cls: type) -> str | None:
    """The registry name of a strategy class (or of its nearest registered base class); None if none."""
    by_class = {spec.strategy: name for name, spec in METHODS.items()}
    for klass in cls.__mro__:
        name = by_class.get(f"{klass.__module__}:{klass.__qualname__}")
        if name is not None:
            return name
    return None


def config_for(cls: type, cfg: RunConfig | None, options: Mapping[str, object]) -> RunConfig:
    """The :class:`RunConfig` of a strategy built as ``cls(cfg)`` or ``cls(**options)``.

    ``options`` are run-config keys as Python names (``num_clients=10``, ``nadp_lambda=2.0``) or, through
    ``**{"num-clients": 10}``, as run-config keys; they are validated like ``--run-config`` (unknown keys and
    bad values raise :class:`protocols.config.ConfigError`), on top of ``cfg`` if given.  ``method`` defaults to
    the class's registered method.
    """
    if cfg is not None and not options:
        return cfg
    raw = {} if cfg is None else cfg.to_mapping()
    raw.update({str(k).replace("_", "-"): v for k, v in options.items()})
    method = registered_method(cls)
    if "method" not in raw and method is not None:
        raw["method"] = method
    return RunConfig.from_mapping(raw)


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
