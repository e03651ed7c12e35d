"""Common machinery of every cancelfl strategy: sampling, reply checks, stage defaults, reporting.

A method's server side is a :class:`CancelStrategy` (a Flower ``Strategy``).  A round is the sequence of
stages of :mod:`strategies.stages` (keys -> plan -> train -> recover -> aggregate -> account); a method
overrides the stages it needs (:meth:`~CancelStrategy.exchange_keys`, :meth:`~CancelStrategy.plan`,
:meth:`~CancelStrategy.train_content`, :meth:`~CancelStrategy.charge_release`,
:meth:`~CancelStrategy.recover`, :meth:`~CancelStrategy.aggregate`, :meth:`~CancelStrategy.account`).
The stages that talk to clients receive the grid; per-round data lives in the
:class:`~strategies.stages.RoundState`.  Privacy accounts live in ``self.privacy``
(:class:`~protocols.privacy.PrivacyLedger`).

The round loop (:mod:`strategies.run.loop`) drives rounds, evaluates centrally and asks
the strategy for :meth:`privacy_report` and :meth:`round_report` to log each round.

Message layout (all methods): the server sends ``RecordDict({"arrays":
ArrayRecord, "config": ConfigRecord})``; a client replies with ``"arrays"``
(its upload) and ``"metrics"`` (:func:`protocols.wire.common.train_metrics`:
its number of examples and method figures).  Config and metric keys belong to
the message classes of :mod:`protocols.wire`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from protocols.arrays import flatten, weighted_average
from protocols.config import ConfigError, RunConfig
from protocols.methods import METHODS
from protocols.privacy import PerUnitAccountant, PrivacyLedger
from protocols.privacy.signal import NoiseEstimate, Release
from protocols.start_checks import start_checks
from protocols.wire.arrays import array_view, from_record
from protocols.wire.common import TrainIns, mean_metrics, num_examples
from protocols.wire.ledger import SpentReport
from protocols.wire.settings import KEY as SETTINGS_KEY
from protocols.wire.settings import settings_config
from strategies.records import to_record
from strategies.run.loop import FlowerTask, run_rounds
from strategies.stages import (
    ForgetsUnresponsive,
    RoundState,
    close_round,
    open_round,
    split_replies,
    train_messages,
    wait_for_nodes,
)
from strategies.validation import ReplyScreen, RoundFailed, Strikes, UploadSpec, spec_like


class CancelStrategy(Strategy):
    """Base strategy: the round template, client sampling, weighted aggregation, reporting hooks."""

    #: Dtype of model arrays on the wire.
    wire_dtype: type = np.float32
    #: Start-of-run details in Flower's log (the round loop sets it from ``--verbose``).
    verbose: bool = False
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
        #: The current (or last) round's state, set by :func:`strategies.stages.open_round`.
        self._state: RoundState | None = None
        #: The method's privacy accounts (no guarantee until a method sets its accountants).
        self.privacy = PrivacyLedger(cfg.delta)
        #: Largest ``num-examples`` a reply may claim (the largest partition, set by the runner); None = unknown.
        self.max_examples: int | None = None
        #: The last successful round's release, set by FedSGD methods whose server optimizer steps with a noisy
        #: gradient (not the model change); :meth:`released` prefers it.
        self.last_release: Release | None = None
        #: node -> reason of every reply excluded this round (:mod:`strategies.validation`).
        self.excluded: dict[int, str] = {}
        #: Consecutive exclusions per node; ``strikes.banned`` nodes are no longer sampled.
        self.strikes = Strikes(cfg.max_strikes)
        #: Participants of the current round whose upload arrived (set by the train stage, :func:`strategies.stages.receive`).
        self.uploaded: set[int] = set()
        #: The global model the current round's participants were sent.
        self.round_model: ArrayRecord | None = None
        self._sampled_once = False
        #: Every node id the run has seen connected (kept in the checkpoint: a resumed run tells renumbered nodes).
        self.nodes_seen: set[int] = set()

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int | None = None,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None, evaluate_fn=None) -> Result:
        """Flower's ``Strategy.start`` for your own ServerApp: the same round loop as ``cancelfl run``.

        Runs :func:`strategies.run.loop.run_rounds`, so checkpoints, ``resume``, accounting, the noise and
        learning checks, ``metrics.jsonl``, ``summary.json`` and ``report.md`` work as in the cancelfl app
        (folder: run-config ``out-dir``, default a fresh ``runs/<time>-<method>``), after the start checks of the run
        config (:func:`protocols.start_checks.start_checks`; the clients' records are yours: not checked).

        Args:
            grid: the ServerApp's grid.
            initial_arrays: the initial global model.
            num_rounds: default and maximum: run-config ``num-rounds`` (the noise is calibrated for it).
            timeout: per-round reply timeout (default: run-config ``round-timeout``).
            train_config: unused (the method sends its own configuration).
            evaluate_config: unused (the server evaluates centrally with ``evaluate_fn``).
            evaluate_fn: Flower's ``evaluate_fn(server_round, arrays) -> MetricRecord | None``; its ``loss``
                and ``accuracy`` feed the metrics, the divergence stop and the learning check.

        Returns:
            Flower's ``Result``: the final global model and the central evaluation per round.

        Raises:
            ConfigError: ``num_rounds`` above run-config ``num-rounds``, or settings every client would refuse.
        """
        rounds = self.cfg.num_rounds if num_rounds is None else int(num_rounds)
        if rounds > self.cfg.num_rounds:
            raise ConfigError(f"start(num_rounds={rounds}): the strategy's noise is calibrated for num-rounds="
                              f"{self.cfg.num_rounds}; build it with num_rounds={rounds} to spend epsilon over more rounds")
        for note in start_checks(self.cfg, records=False):
            log(WARNING, "%s", note)
        if timeout is not None and timeout != self.cfg.round_timeout:
            self.cfg = dataclasses.replace(self.cfg, round_timeout=float(timeout))
        task = FlowerTask(initial_arrays, evaluate_fn)
        outcome = run_rounds(self, grid, task, num_rounds=rounds, progress=lambda line: log(INFO, "%s", line))
        result = Result(arrays=outcome.arrays)
        for row in outcome.rows:
            result.evaluate_metrics_serverapp[int(row["round"])] = MetricRecord(
                {k: float(row[k]) for k in ("test_loss", "test_accuracy", "epsilon") if row.get(k) is not None})
        return result

    # --------------------------------------------------------------- sampling
    def sample_nodes(self, grid: Grid, server_round: int) -> list[int]:
        """Sample ``clients-per-round`` of the connected nodes, deterministically from (seed, round).

        The first sampling waits (up to ``node-timeout`` s) for all ``num-clients`` nodes; later rounds take
        the nodes connected now (a node that left is not waited for, one that came back is sampled again)
        and wait only while fewer than ``min-clients`` are there.  Banned nodes (:attr:`strikes`) are skipped.
        A key phase that samples the roster itself (:attr:`strategies.key_phase.KeyPhase.samples_roster`) gets
        every usable node.
        """
        cfg = self.cfg
        minimum = min(cfg.min_clients, cfg.num_clients)
        want = minimum if self._sampled_once else cfg.num_clients
        nodes = wait_for_nodes(grid, want, cfg.node_timeout, minimum=minimum, exclude=self.strikes.banned)
        self._sampled_once = True
        self.nodes_seen.update(int(n) for n in nodes)
        if getattr(self.keys, "samples_roster", False):  # the key phase draws the roster's public sample
            self.sampled = nodes
            return nodes
        rng = np.random.default_rng([self.cfg.seed, server_round, 0x5A3])
        k = min(self.cfg.clients_per_round, len(nodes))
        # Sample positions, not ids: node ids are up to 2**64 and numpy would turn them into floats.
        self.sampled = sorted(nodes[int(i)] for i in rng.choice(len(nodes), size=k, replace=False))
        return self.sampled

    def schedule_left(self, first: int, last: int) -> tuple[dict[int, int], int] | None:
        """Rounds ``first..last`` that sample each node under a public schedule, and the most any node gets.

        The pairwise methods' key phase draws each round's sample from the roster (public before round 1,
        :meth:`strategies.key_phase.KeyPhase.schedule_left`); None for the others (any round may sample any node).
        """
        left = getattr(self.keys, "schedule_left", None)
        return None if left is None else left(first, last)

    def make_messages(self, nodes: Iterable[int], content_fn, message_type: str = "train") -> list[Message]:
        """One message per node with content from ``content_fn(node_id) -> RecordDict``.

        Each carries the strategy's settings (:mod:`protocols.wire.settings`): the client acts on them.
        """
        settings = settings_config(self.cfg)
        contents = {n: content_fn(n) for n in nodes}
        for content in contents.values():
            content[SETTINGS_KEY] = ConfigRecord(settings)
        return [Message(content, n, message_type) for n, content in contents.items()]

    def exchange(self, grid: Grid, nodes: Iterable[int], content_fn, action: str) -> tuple[dict[int, Message], list[str]]:
        """Run one extra ``query.<action>`` phase; returns good replies by node and errors."""
        msgs = self.make_messages(nodes, content_fn, f"query.{action}")
        replies = grid.send_and_receive(msgs, timeout=self.cfg.round_timeout)
        good, errors = split_replies(replies)
        for e in errors:
            log(WARNING, "phase %s: %s", action, e.splitlines()[0])
        return {r.metadata.src_node_id: r for r in good}, errors

    # ------------------------------------------------- Flower's Strategy API
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Sampling, the keys and plan stages, then the train messages (:mod:`strategies.stages`)."""
        return train_messages(self, open_round(self, grid, server_round, arrays))

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The recover, aggregate and account stages on the replies, without a grid.

        A round that needs a recovery phase (pairwise methods with dropouts or double masking) fails here:
        drive those with :func:`strategies.stages.run_round` (as :meth:`start` does).

        Raises:
            RoundFailed: as :func:`strategies.stages.close_round`, or no state of ``server_round``.
        """
        state = self._state
        if state is None or state.round != server_round:
            raise RoundFailed(f"round {server_round}: no round state (configure_train did not run for this round)")
        return close_round(self, None, state, replies)

    # ------------------------------------------------------------ reply checks
    def screen(self, state: RoundState, by_node: dict[int, Message]) -> dict[int, Message]:
        """Exclude replies that fail :mod:`strategies.validation`; record reasons and strikes; the rest go on.

        Excluded participants are, for the method, participants without an upload (pairwise methods treat
        them as dropouts); :attr:`excluded` names them with their reasons.
        """
        pre = {n: why for n, r in by_node.items() if (why := self.reply_problem(state, n, r)) is not None}
        # (a method may already have excluded nodes this round, e.g. niss the senders of rejected payloads)
        checked = {n: r for n, r in by_node.items() if n not in pre}
        screen = ReplyScreen(self.upload_spec(state), max_examples=self.max_examples)
        result = screen.screen(checked, lambda n, flat: self.update_of(state, n, flat),
                               lambda n: self.norm_limit(state, n))
        self.excluded.update(pre)
        self.excluded.update(result.excluded)
        for node, why in sorted(self.excluded.items()):
            log(WARNING, "round %d: node %s excluded: %s", state.round, node, why)
        accepted = [n for n in sorted(result.accepted) if n not in self.excluded]
        self.strikes.record(state.round, self.excluded, accepted)
        return {n: by_node[n] for n in accepted}

    def reply_problem(self, state: RoundState, node: int, reply: Message) -> str | None:
        """A method's own check of one reply before the common ones (a reason excludes it); default: none."""
        return None

    def upload_spec(self, state: RoundState) -> UploadSpec:
        """Names, shapes and dtypes of an upload; default: those of the global model, float32 or float64."""
        return spec_like(self.round_model) if self.round_model is not None else {}

    def model_dim(self) -> int:
        """Entries of the round's global model (0 before the first round)."""
        return sum(math.prod(a.shape) for a in self.round_model.values()) if self.round_model is not None else 0

    def update_of(self, state: RoundState, node: int, flat: np.ndarray) -> np.ndarray:
        """The part of a flattened upload whose norm is bounded; default: upload minus the global model."""
        if self.round_model is None:
            return flat
        return flat - np.concatenate([array_view(a).ravel() for a in self.round_model.values()])

    def norm_limit(self, state: RoundState, node: int) -> float | None:
        """Largest honest norm of :meth:`update_of` (clipping plus a Gaussian tail bound of the noise).

        None: the method guarantees no bound; the round's median rule applies
        (:data:`strategies.validation.OUTLIER_FACTOR`).
        """
        return None

    # ------------------------------------------------------------------ stages
    def begin_round(self, arrays: ArrayRecord) -> None:
        """Reset the per-round reports before sampling; ``arrays``: the global model the round starts from."""
        self._round_report = {}
        self._state = None
        self.excluded = {}
        self.round_model = arrays

    def exchange_keys(self, grid: Grid, st: RoundState) -> None:
        """Keys stage: fill ``st.keys`` and narrow ``st.participants`` to the nodes with keys; default: nothing."""

    def plan(self, grid: Grid, st: RoundState) -> RoundState:
        """Plan stage: calibration and extra phases; returns the round's state (a method's subclass); default: ``st``."""
        return st

    def train_config(self, server_round: int) -> dict[str, Any]:
        """Config fields every participant gets with the model (default: the round number)."""
        return TrainIns(server_round).to_config()

    def train_content(self, st: RoundState, node: int, arrays: ArrayRecord) -> RecordDict:
        """Train stage: the message of ``node``; default: the global model and :meth:`train_config`."""
        return RecordDict({"arrays": arrays, "config": ConfigRecord(self.train_config(st.round))})

    def charge_release(self, st: RoundState) -> None:
        """Train stage: compose what the train messages commit the participants to releasing; default: nothing.

        Runs before the messages leave (the runner's pending checkpoint keeps it).  What only the replies
        determine is composed by :meth:`account`.
        """

    def recover(self, grid: Grid | None, st: RoundState) -> None:
        """Recover stage: remove self-masks and pair noise orphaned by ``st.dropped``; default: nothing.

        May narrow ``st.replies`` and sets ``st.recovery``; the pairwise methods implement it
        (:class:`strategies.recovery.PairwiseRecovery`).  ``grid`` None: a phase that needs it fails the round.
        """

    def aggregate(self, st: RoundState) -> ArrayRecord | None:
        """Aggregate stage: weighted average (:meth:`weight_of`, default ``num-examples``) of ``st.replies``."""
        by_node = st.replies
        nodes = sorted(by_node)
        weights = [self.weight_of(by_node[n]) for n in nodes]
        uploads = [from_record(by_node[n].content["arrays"]) for n in nodes]
        if sum(weights) <= 0:
            raise RoundFailed("aggregation weights sum to zero")
        return to_record(weighted_average(uploads, weights), self.wire_dtype)

    def account(self, st: RoundState) -> None:
        """Account stage: compose what the replies determined (survivors, recovery); default: nothing.

        Runs once the aggregate stage has started (``st.aggregating``), also when it failed.
        """

    def account_revealed(self, st: RoundState) -> None:
        """Charge the uploads what a failed recovery's answers strip (``st.failed_recovery``); default: nothing."""

    def weight_of(self, reply: Message) -> float:
        """Aggregation weight of one reply (default: its number of examples)."""
        return float(num_examples(reply.content["metrics"]))

    def record_client_spending(self, by_node: Mapping[int, Message]) -> None:
        """Each participant's lifetime epsilon as its own ledger reports it (:class:`protocols.wire.ledger.SpentReport`).

        Kept in :attr:`client_epsilon` (node -> epsilon, ``inf`` = no guarantee; the runner writes it per round)
        and reported as ``client_epsilon_max`` (over the clients with a finite figure).
        """
        spent = {node: rep.epsilon for node, r in by_node.items()
                 if "metrics" in r.content and (rep := SpentReport.from_metrics(r.content["metrics"])) is not None}
        self.client_epsilon: dict[int, float] = spent
        finite = [e for e in spent.values() if math.isfinite(e)]
        if finite:
            self.report(client_epsilon_max=max(finite))

    @staticmethod
    def mean_metrics(replies: list[Message]) -> MetricRecord:
        """Example-weighted mean of every numeric client metric."""
        return MetricRecord(mean_metrics([r.content["metrics"] for r in replies]))

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """No federated evaluation: the server evaluates the global model centrally."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Unused (see :meth:`configure_evaluate`)."""
        return None

    def close(self) -> None:
        """Release what the strategy holds between rounds (nothing by default); called once after the run."""

    # ------------------------------------------------------------ checkpoint (server/checkpoint.py)
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue this strategy, as JSON types.

        The privacy ledger (every accountant, so epsilon continues where it was); a method with more
        cross-round state extends it.
        """
        out = {"privacy": self.privacy.to_state(), "strikes": self.strikes.to_state(),
               "nodes": [str(n) for n in sorted(self.nodes_seen)]}
        schedule = getattr(self.keys, "schedule_state", None)
        if schedule is not None and (kept := schedule()) is not None:
            out["schedule"] = kept  # the public schedule, known to the budget guard before the first key phase
        return out

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state_dict`, on a freshly built strategy of the same run config.

        A node id the earlier run did not see starts from the dearest earlier account (renumbered nodes of a
        resumed simulation or deployment: :meth:`~protocols.privacy.accountant.PerUnitAccountant.renumbered`).
        """
        self.privacy = PrivacyLedger.from_state(state["privacy"])
        if "strikes" in state:
            self.strikes.load_state(state["strikes"])
        if "schedule" in state and hasattr(self.keys, "load_schedule"):
            self.keys.load_schedule(state["schedule"])
        earlier = [int(n) for n in state.get("nodes", [])]
        for acc in self.unit_accounts():
            acc.renumbered(earlier, self.cfg.delta)

    def unit_accounts(self) -> list[PerUnitAccountant]:
        """Every per-client account of the method (its ledger's; a method with more extends the list)."""
        return self.privacy.per_unit()

    def summary(self) -> None:
        """Log the method and its key parameters."""
        log(20, "cancelfl method %s: %s", self.cfg.method, self.describe())

    # -------------------------------------------------------- reporting hooks
    def describe(self) -> dict[str, float | str]:
        """Key parameters of the method (logged and stored in summary.json)."""
        return {}

    def noise_estimate(self, num_params: int) -> NoiseEstimate | None:
        """Expected DP noise norm in a round's aggregate vs the clip-bounded signal norm (None: no DP noise).

        Called by the runner after round 1 (so round-dependent calibrations exist) for the noise check
        (:mod:`protocols.privacy.signal`).  ``num_params``: entries of the model.
        """
        return None

    def released(self, previous: ArrayRecord, new: ArrayRecord, num_params: int) -> Release | None:
        """The round just aggregated as released, with its noise power, for the measured noise check.

        Called by the runner after every successful round (:class:`protocols.privacy.signal.MeasuredSignal`).
        FedSGD methods whose server optimizer steps with a noisy *gradient* set :attr:`last_release` to that
        gradient when they aggregate (the model change is the optimizer's step, not what was released).
        Otherwise: the change of the global model, ``new - previous``, and the square of
        :meth:`noise_estimate`'s per-round noise norm (the space it states: "model update").
        """
        if self.last_release is not None:
            return self.last_release
        est = self.noise_estimate(num_params)
        if est is None:
            return None
        delta = flatten(from_record(new)) - flatten(from_record(previous))
        return Release(delta, est.noise_norm ** 2)

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

    def exclusions(self) -> dict[str, str]:
        """Excluded nodes of this round with their reasons (node ids as strings, for JSON)."""
        return {str(n): why for n, why in sorted(self.excluded.items())}

    def report(self, **values: float) -> None:
        """Record per-round figures for :meth:`round_report`."""
        self._round_report.update({k: float(v) for k, v in values.items()})


def _path(target: object) -> str:
    """``module:qualname`` of a class, or the import path a method card names."""
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"  # type: ignore[attr-defined]


def registered_method(cls: type) -> str | None:
    """The registry name of a strategy class (or of its nearest registered base class); None if none."""
    by_class = {_path(spec.strategy): name for name, spec in METHODS.items()}
    return next((by_class[_path(k)] for k in cls.__mro__ if _path(k) in by_class), None)


def _check_method(cls: type, cfg: RunConfig) -> RunConfig:
    """``cfg``, unless it names a method whose strategy ``cls`` (another method's) is not: ConfigError naming the fix."""
    own, target = registered_method(cls), _path(METHODS[cfg.method].strategy)
    if own is None or any(_path(k) == target for k in cls.__mro__):
        return cfg
    raise ConfigError(f"{cls.__name__} runs method '{own}' but its settings say method='{cfg.method}'; drop 'method' "
                      f"from the run config (pyproject [tool.flwr.app.config] or --run-config), or build "
                      f"{target.replace(':', '.')} (strategies.registry.build_strategy builds a run config's own)")


def config_for(cls: type, cfg: RunConfig | None, options: Mapping[str, object]) -> RunConfig:
    """The :class:`RunConfig` of a strategy built as ``cls(cfg)`` or ``cls(**options)``.

    ``options`` are run-config keys as Python names (``num_clients=10``, ``nadp_lambda=2.0``) or, through
    ``**{"num-clients": 10}``, as run-config keys; they are validated like ``--run-config`` (unknown keys and
    bad values raise :class:`protocols.config.ConfigError`), on top of ``cfg`` if given.  ``method`` defaults to
    the class's registered method; a method whose strategy is another class is refused (ConfigError).
    """
    if cfg is not None and not options:
        return _check_method(cls, cfg)
    raw = {} if cfg is None else cfg.to_mapping()
    raw.update({str(k).replace("_", "-"): v for k, v in options.items()})
    method = registered_method(cls)
    if "method" not in raw and method is not None:
        raw["method"] = method
    return _check_method(cls, RunConfig.from_mapping(raw))


__all__ = ["CancelStrategy", "RoundFailed", "RoundState", "config_for", "registered_method", "split_replies",
           "wait_for_nodes"]
