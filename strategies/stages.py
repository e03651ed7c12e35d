"""The round as explicit stages: keys -> plan -> train -> recover -> aggregate -> account.

Each stage is a method of the :class:`~strategies.base.CancelStrategy` that receives the round's
:class:`RoundState` and, where it talks to clients, the Flower ``Grid`` (as the stages of Flower's SecAgg+
workflow do); no strategy keeps the grid.  :func:`run_round` drives one round:

1. sampling (:meth:`~strategies.base.CancelStrategy.sample_nodes`) creates the state;
2. ``exchange_keys(grid, st)`` -- key phase of the pairwise methods (``st.keys``, ``st.participants``);
3. ``plan(grid, st) -> st`` -- calibration and extra phases (niss shares, ddpsa servers); returns the
   method's state (a :class:`RoundState` subclass);
4. train -- :func:`train_messages` (``train_content`` per participant, then ``charge_release``: what the
   messages commit the clients to releasing is charged *before* they leave, so a crash keeps the charge),
   the send, and :func:`receive` (good replies screened into ``st.replies``, ``st.dropped``);
5. ``recover(grid, st)`` -- pairwise methods: dropout recovery / unmasking (``st.recovery``);
6. ``aggregate(st) -> ArrayRecord | None`` -- the new global model;
7. ``account(st)`` -- compose what the replies determined (survivors, recovery shortfall); runs whenever
   ``aggregate`` started, also when it failed (the uploads reached the server).

:func:`open_round` (1-3) and :func:`close_round` (the end of 4, then 5-7) are the two halves around the send;
``CancelStrategy.configure_train`` / ``aggregate_train`` (Flower's ``Strategy`` API) wrap them, without a grid
for the recovery stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any, Protocol

from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from protocols.config import ConfigError, RunConfig
from protocols.wire.common import UNMASK_RECORD
from protocols.wire.settings import MISMATCH
from strategies.pipelined import carried_requests, finish_previous, with_update
from strategies.validation import RoundFailed, non_finite_arrays

#: The stages of a round, in order.
STAGES = ("keys", "plan", "train", "recover", "aggregate", "account")


@dataclass
class RoundState:
    """One round, as the stages fill it in.  Methods subclass it with their plan (e.g. ``NadpRound``).

    ``round`` and ``participants`` (nodes sent a train message; replies from anyone else are ignored) are set
    by sampling, narrowed by the keys and plan stages.  The keyword fields are filled by the stages.
    """

    round: int
    participants: list[int]
    #: The key stage's :class:`strategies.key_phase.KeyRound` (pairwise methods; None otherwise).
    keys: Any = field(default=None, kw_only=True)
    #: Participants' good replies after the reply checks (narrowed by the recover stage), by node.
    replies: dict[int, Message] = field(default_factory=dict, kw_only=True)
    #: Error replies of the train phase (one line each).
    errors: list[str] = field(default_factory=list, kw_only=True)
    #: Participants whose upload arrived (excluded ones included).
    uploaded: set[int] = field(default_factory=set, kw_only=True)
    #: Participants whose upload is not aggregated (no reply, error, excluded).
    dropped: list[int] = field(default_factory=list, kw_only=True)
    #: The recover stage's :class:`strategies.recovery.RecoveryOutcome` (pairwise methods, when a phase ran).
    recovery: Any = field(default=None, kw_only=True)
    #: Set when the aggregate stage starts: the account stage then charges what the replies released.
    aggregating: bool = field(default=False, kw_only=True)
    #: Every participant's good reply before the reply checks, by node (what the next stages may read besides
    #: the upload, e.g. the previous round's unmasking answers: :mod:`strategies.pipelined`).
    arrived: dict[int, Message] = field(default_factory=dict, kw_only=True)
    #: Set by the recover stage when the round is unmasked in the next round's train messages
    #: (run-config ``unmask-next-round``): its aggregate and account stages run then.
    deferred: bool = field(default=False, kw_only=True)
    #: A recover stage that failed after survivors revealed pair material: its outcome (what they revealed), for
    #: :meth:`Stages.account_revealed`.
    failed_recovery: Any = field(default=None, kw_only=True)


class ForgetsUnresponsive(Protocol):
    """What the train stage needs of a key phase (:class:`strategies.key_phase.KeyPhase`)."""

    def forget_unresponsive(self, participants: Iterable[int], replies: Iterable[Message]) -> None: ...


class Stages(Protocol):
    """What the driver needs of a strategy (:class:`strategies.base.CancelStrategy` implements it)."""

    cfg: RunConfig
    keys: ForgetsUnresponsive | None
    round_model: ArrayRecord | None
    excluded: dict[int, str]
    uploaded: set[int]
    _state: RoundState | None

    def begin_round(self, arrays: ArrayRecord) -> None: ...
    def sample_nodes(self, grid: Grid, server_round: int) -> list[int]: ...
    def exchange_keys(self, grid: Grid, st: RoundState) -> None: ...
    def plan(self, grid: Grid, st: RoundState) -> RoundState: ...
    def make_messages(self, nodes: Iterable[int], content_fn: Callable[[int], RecordDict],
                      message_type: str = "train") -> list[Message]: ...
    def train_content(self, st: RoundState, node: int, arrays: ArrayRecord) -> RecordDict: ...
    def charge_release(self, st: RoundState) -> None: ...
    def screen(self, st: RoundState, by_node: dict[int, Message]) -> dict[int, Message]: ...
    def recover(self, grid: Grid | None, st: RoundState) -> None: ...
    def record_client_spending(self, by_node: dict[int, Message]) -> None: ...
    def aggregate(self, st: RoundState) -> ArrayRecord | None: ...
    def account(self, st: RoundState) -> None: ...
    def account_revealed(self, st: RoundState) -> None: ...
    def mean_metrics(self, replies: list[Message]) -> MetricRecord: ...


def split_replies(replies: Iterable[Message]) -> tuple[list[Message], list[str]]:
    """Separate good replies from failures, describing each failure.

    Raises:
        ConfigError: a client refused the strategy's settings (another method configured on the client side).
    """
    good, errors = [], []
    for r in replies:
        if r.has_error():
            if MISMATCH in r.error.reason:
                line = next(ln for ln in r.error.reason.splitlines() if MISMATCH in ln)
                raise ConfigError(line[line.index(MISMATCH):])
            errors.append(f"node {r.metadata.src_node_id}: {r.error.reason}")
        else:
            good.append(r)
    return good, errors


def wait_for_nodes(grid: Grid, want: int, timeout: float, *, minimum: int | None = None,
                   exclude: Iterable[int] = ()) -> list[int]:
    """The connected nodes (minus ``exclude``) once ``want`` are there, or after ``timeout`` s if ``minimum`` are.

    Deployment nodes register over ~10 s; a node that died is dropped by the SuperLink after its
    heartbeat patience (~60 s in Flower 1.41), a node that comes back is listed again.

    Raises:
        RoundFailed: fewer than ``minimum`` (default ``want``) are connected at the deadline.
    """
    minimum = want if minimum is None else minimum
    skip = set(exclude)
    deadline = time.time() + timeout
    while True:
        nodes = sorted(n for n in grid.get_node_ids() if n not in skip)
        if len(nodes) >= want:
            return nodes
        if time.time() > deadline:
            if len(nodes) >= minimum:
                return nodes
            raise RoundFailed(f"only {len(nodes)} usable node(s) connected within {timeout:.0f} s, fewer than the "
                              f"minimum of {minimum} (run-config 'min-clients', 'node-timeout'; "
                              f"{len(skip)} node(s) left out after repeated bad replies)")
        time.sleep(1.0)


# ----------------------------------------------------------------------------- the driver
def open_round(strategy: Stages, grid: Grid, server_round: int, arrays: ArrayRecord) -> RoundState:
    """Sampling, then the keys and plan stages; returns the method's round state (also ``strategy._state``)."""
    strategy.begin_round(arrays)
    st = RoundState(server_round, strategy.sample_nodes(grid, server_round))
    strategy.exchange_keys(grid, st)
    st = strategy.plan(grid, st)
    strategy._state = st
    return st


def train_messages(strategy: Stages, st: RoundState) -> list[Message]:
    """The train stage's messages (one per participant), then the release they commit to is charged.

    A message also carries the previous round's unmasking request when it waits for this round
    (run-config ``unmask-next-round``, :mod:`strategies.pipelined`).
    """
    model = strategy.round_model
    assert model is not None
    carried = carried_requests(strategy, st)  # unmask-next-round: the previous round's unmasking

    def content(node: int) -> RecordDict:
        rd = strategy.train_content(st, node, model)
        if node in carried:
            rd[UNMASK_RECORD] = carried[node]
        return rd

    messages = strategy.make_messages(st.participants, content)
    strategy.charge_release(st)
    return messages


def receive(strategy: Stages, st: RoundState, replies: Iterable[Message]) -> None:
    """End of the train stage: split the replies, forget unresponsive key holders, screen the participants' replies.

    Fills ``st.replies``, ``st.errors``, ``st.uploaded``, ``st.dropped``.

    Raises:
        RoundFailed: no participant sent a usable reply.
    """
    good, st.errors = split_replies(replies)
    for e in st.errors:
        log(WARNING, "round %d: %s", st.round, e.splitlines()[0])
    if strategy.keys is not None:  # a participant that failed re-keys when next sampled
        strategy.keys.forget_unresponsive(st.participants, good)
    participants = set(st.participants)
    by_node = {r.metadata.src_node_id: r for r in good if r.metadata.src_node_id in participants}
    st.arrived = by_node
    st.uploaded = strategy.uploaded = {n for n, r in by_node.items() if "arrays" in r.content}
    st.replies = strategy.screen(st, by_node)
    if not st.replies:
        raise RoundFailed(f"round {st.round}: no participant sent a usable reply ({len(st.errors)} errors, "
                          f"{len(strategy.excluded)} excluded: {strategy.excluded})")
    st.dropped = sorted(participants - set(st.replies))  # no reply, error, or excluded above


def close_round(strategy: Stages, grid: Grid | None, st: RoundState,
                replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord]:
    """The train replies through the recover, aggregate and account stages.

    ``grid``: for the recover stage (None: a round that needs a recovery phase fails).

    Returns:
        The new global model (None: the method publishes none) and the mean client metrics.

    Raises:
        RoundFailed: no usable reply, recovery failed, the replies cannot be aggregated or the aggregate
            is not finite (the previous model is kept).
    """
    receive(strategy, st, replies)
    update = finish_previous(strategy, st, aggregate_stage)  # unmask-next-round: the previous round's update
    try:
        strategy.recover(grid, st)
    except RoundFailed:
        if st.failed_recovery is not None:  # survivors revealed pair material: charge it, as their ledgers do
            strategy.account_revealed(st)
        raise
    strategy.record_client_spending(st.replies)
    metrics = strategy.mean_metrics(list(st.replies.values()))
    if st.deferred:  # this round's aggregate and account stages run with the next round's replies
        return with_update(strategy.round_model, update), metrics
    return with_update(aggregate_stage(strategy, st), update), metrics


def aggregate_stage(strategy: Stages, st: RoundState) -> ArrayRecord | None:
    """The aggregate stage, then the account stage (also when aggregating failed: the uploads reached the server).

    Returns the new global model (None: the method publishes none).

    Raises:
        RoundFailed: the replies cannot be aggregated or the aggregate is not finite.
    """
    st.aggregating = True
    try:
        try:
            arrays = strategy.aggregate(st)
        except (ValueError, KeyError, TypeError, IndexError) as err:  # a reply the checks let through
            raise RoundFailed(f"round {st.round}: aggregation failed on the replies: "
                              f"{type(err).__name__}: {err}") from err
        if arrays is not None and (bad := non_finite_arrays(arrays)):
            raise RoundFailed(f"round {st.round}: the aggregate is not finite (arrays {bad[:3]}); "
                              "the previous model is kept")
    finally:
        strategy.account(st)
    return arrays


def run_round(strategy: Stages, grid: Grid, server_round: int, arrays: ArrayRecord, *,
              before_send: Callable[[], None] | None = None) -> tuple[ArrayRecord | None, MetricRecord]:
    """One round, every stage in order (:data:`STAGES`); ``before_send`` runs once the release is charged.

    Returns and raises as :func:`close_round` (also :class:`RoundFailed` from the keys and plan stages).
    """
    st = open_round(strategy, grid, server_round, arrays)
    messages = train_messages(strategy, st)
    if before_send is not None:
        before_send()
    replies = grid.send_and_receive(messages, timeout=strategy.cfg.round_timeout)
    return close_round(strategy, grid, st, replies)


__all__ = ["STAGES", "ForgetsUnresponsive", "RoundState", "Stages", "aggregate_stage", "close_round", "open_round",
           "receive", "run_round", "split_replies", "train_messages", "wait_for_nodes"]
