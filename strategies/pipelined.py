"""Unmasking in the next round's train messages (run-config ``unmask-next-round``; pairwise methods, double masking).

With double masking the server can name the round's survivors only after the uploads, and a client reveals its
shares of a peer's self-mask seed only then: a ``query.recover`` phase after every round's uploads.  With
``unmask-next-round`` a round whose uploads are all kept (no dropout, no exclusion) and that another round
follows is not unmasked at once (:meth:`strategies.recovery.PairwiseRecovery.unmask` keeps its
:class:`~strategies.recovery.UnmaskPlan`): the next round's train message carries each client its request
(record :data:`~protocols.wire.common.UNMASK_RECORD`, :func:`carried_requests`), the client answers it before it
trains (:func:`client.recovery.answer_carried`: the same rules as ``query.recover``), and the server unmasks,
aggregates and accounts the earlier round when the replies arrive (:func:`finish_previous`).

The earlier round's update, ``aggregate - the model it trained from``, is then added to the model the next round
produces (:func:`with_update`): every update reaches the model one round later (one-step-delayed updates), and a
round with dropouts, the last round, and rounds under a sampled schedule are unmasked at once.  A client
reveals nothing it would not reveal in ``query.recover``.  An update is lost (logged) when its round's
self-masks cannot be rebuilt from the next round's answers, when that round fails before its messages go out,
or at a resume (the pending round is not in the checkpoint; its charge is, on both sides).
"""

from __future__ import annotations

from collections.abc import Callable
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.common import log

from protocols.wire.common import UNMASK_RECORD
from strategies.validation import RoundFailed

#: node -> float64 array per model entry: the update an earlier round's aggregate makes.
Update = dict[str, np.ndarray]


def carried_requests(strategy: Any, st: Any) -> dict[int, ConfigRecord]:
    """Participant -> the previous round's unmasking request to carry in its train message (empty: none pending).

    A plan from an older round (a round failed in between, so its clients have trained since) is dropped with
    a warning: the clients no longer hold that round's material.
    """
    plan = getattr(strategy, "pending_unmask", None)
    if plan is None:
        return {}
    if plan.state.round != st.round - 1:
        log(WARNING, "round %d: the update of round %d is lost (a round failed before its unmasking could be "
                     "carried)", st.round, plan.state.round)
        strategy.pending_unmask = None
        return {}
    present = set(st.participants)
    return {n: plan.request(n)["config"] for n in plan.received if n in present}


def finish_previous(strategy: Any, st: Any, aggregate_stage: Callable[[Any, Any], ArrayRecord | None]) -> Update | None:
    """Unmask, aggregate and account the pending round from the answers in ``st``'s replies; its update.

    The answers are the records :data:`UNMASK_RECORD` of the replies that arrived (``st.arrived``); a client
    without one is silent (its own self-mask is rebuilt from its neighbours' shares).  ``aggregate_stage``
    (:func:`strategies.stages.aggregate_stage`) runs with the model that round trained from.  Returns None when
    nothing was pending or the update is lost (logged: a self-mask could not be rebuilt, or the aggregate
    failed or is not finite).
    """
    plan = getattr(strategy, "pending_unmask", None)
    if plan is None:
        return None
    strategy.pending_unmask = None
    answers = {n: RecordDict({"config": m.content[UNMASK_RECORD]}) for n, m in st.arrived.items()
               if UNMASK_RECORD in m.content and isinstance(m.content[UNMASK_RECORD], ConfigRecord)}
    prev = plan.state
    current, strategy.round_model = strategy.round_model, plan.model
    try:
        strategy.finish_unmask(plan, answers)
        arrays = aggregate_stage(strategy, prev)
    except RoundFailed as err:
        log(WARNING, "round %d: the update of round %d is lost: %s", st.round, prev.round, err)
        return None
    finally:
        strategy.round_model = current
    if arrays is None:
        log(WARNING, "round %d: the update of round %d is lost (no aggregate)", st.round, prev.round)
        return None
    return {k: np.asarray(a.numpy(), dtype=np.float64) - np.asarray(plan.model[k].numpy(), dtype=np.float64)
            for k, a in arrays.items()}


def with_update(arrays: ArrayRecord | None, update: Update | None) -> ArrayRecord | None:
    """``arrays`` plus an earlier round's ``update`` (each entry in its own dtype); ``arrays`` when there is none."""
    if arrays is None or update is None:
        return arrays
    out = {}
    for k, a in arrays.items():
        value = a.numpy()
        out[k] = Array((np.asarray(value, dtype=np.float64) + update[k]).astype(value.dtype))
    return ArrayRecord(out)


__all__ = ["Update", "carried_requests", "finish_previous", "with_update"]
