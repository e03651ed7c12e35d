"""One audit release: a one-round run of the method's real code on fresh canaries, read as the adversary's view.

The registered strategy (:mod:`strategies.registry`) samples, runs its phases (key exchange, shares), sends the
train messages on the in-process grid (:class:`server.local_grid.LocalGrid`), and the method's stock client
handlers (:func:`client.api.attach`, with the client's privacy floor and ledger) train and noise the uploads,
which the strategy aggregates.  The method's audit adapter plants the fault asked for and reads the view
(:meth:`server.audit_adapter.AuditAdapter.view`): ``upload`` = what the server holds of the uploads, ``model`` =
the published aggregate.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ConfigRecord

from protocols.config import RunConfig
from protocols.task.models import get_weights
from server.audit_adapter import ReleaseView
from server.audit_canaries import _AdaptiveCanaries, _Canaries, _client_app
from server.audit_spec import AuditSpec
from server.local_grid import LocalGrid
from strategies.records import to_record
from strategies.registry import strategy_class
from strategies.stages import close_round

__all__ = ["Release", "claim_of", "release"]


@dataclass
class Release:
    """One release's features per trial (canary): ``features`` (trials, f), plus claims."""

    features: np.ndarray
    labels: np.ndarray  # +1 / -1 per trial
    audited: np.ndarray  # bool per trial: part of the audit (its owner is a victim)
    owner: np.ndarray
    claims: dict[str, float]
    claim_delta: float  # the delta the claim of the audited view holds at (0: a pure-DP claim, claim_of)


def claim_of(ledger: Any, direction: str, account: str | None = None) -> tuple[float, float]:
    """``(epsilon, delta)`` the run's ledger claims for the view ``direction`` (``upload``: uplink, else downlink).

    ``account``: the ledger account to read instead (``uplink``, ``downlink`` or the name of an extra account,
    :meth:`server.audit_adapter.AuditAdapter.claim_account`); None: the direction's.

    ``epsilon`` is the ledger's figure at its delta (``inf``: no guarantee).  The claim is pure DP (delta 0)
    where the view's accountant certifies a pure epsilon no larger than that figure
    (:meth:`protocols.privacy.Accountant.pure_epsilon`: pure releases composed basically); an accountant that
    composes them by their privacy-loss distribution (e.g. ddpsa's ``pld``) claims its smaller epsilon at delta only.
    """
    account = account or ("uplink" if direction == "upload" else "downlink")
    acc = {"uplink": ledger.uplink, "downlink": ledger.downlink}.get(account, ledger.extra.get(account))
    if acc is None:
        return math.inf, ledger.delta
    eps = acc.epsilon(ledger.delta)
    pure = acc.pure_epsilon()
    if pure is not None and pure <= eps * (1 + 1e-9):
        return eps, 0.0
    return eps, ledger.delta


def release(spec: AuditSpec, cfg: RunConfig, canaries: _Canaries | _AdaptiveCanaries,
            rng: np.random.Generator, raw: dict | None = None) -> Release:
    """Run one round of the method on fresh canaries; return the adversary's view.

    ``raw``: the run config the nodes get (default ``spec.run_config()``; with the adapter's services' keys).
    """
    adapter = spec.adapter
    fault = adapter.faults[spec.fault] if spec.fault is not None else None
    canaries.draw(rng, spec.direction)
    grid = LocalGrid(_client_app(canaries), spec.clients, spec.run_config() if raw is None else raw, identities=False)
    strategy = strategy_class(spec.method)(cfg)
    strategy.max_examples = canaries.per_client
    arrays = to_record(get_weights(canaries.model()), strategy.wire_dtype)
    victim = {"node": None}
    plant = fault.plant if fault is not None and fault.plant is not None else None
    with plant(lambda: victim["node"]) if plant is not None else contextlib.nullcontext(), adapter.plant_canaries(spec):
        msgs = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
        victim["node"] = min(m.metadata.dst_node_id for m in msgs)
        replies = list(grid.send_and_receive(msgs))
        errors = [r.error.reason for r in replies if r.has_error()]
        if errors:
            raise RuntimeError(f"audit release failed on the client: {errors[0]}")
        aggregate, _ = close_round(strategy, grid, strategy._state, replies)
    if aggregate is None:
        raise RuntimeError("audit release: the strategy published no model")
    part = {nid: i for i, nid in enumerate(grid.node_ids)}  # node -> partition (LocalGrid's order)
    claims = {**strategy.privacy.report(), **strategy.privacy.extra_report()}
    _, claim_delta = claim_of(strategy.privacy, spec.direction, adapter.claim_account(spec))
    owner = canaries.owner()
    audited = np.ones(len(owner), dtype=bool)
    if fault is not None and fault.per_client:
        audited = owner == part[victim["node"]]  # a per-client fault: the audit of that client's records
    rel = ReleaseView(spec, strategy, grid, replies, aggregate, canaries, part, victim["node"], audited)
    features = adapter.view(rel)
    return Release(features, canaries.signs(), rel.audited, owner, claims, claim_delta)
