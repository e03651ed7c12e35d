"""One audit release: a one-round run of the method's real code on fresh canaries, read as the adversary's view.

The registered strategy (:mod:`strategies.registry`) samples, runs its phases (key exchange, shares), sends the
train messages on the in-process grid (:class:`server.local_grid.LocalGrid`), and the method's stock client
handlers (:func:`client.api.attach`, with the client's privacy floor and ledger) train and noise the uploads,
which the strategy aggregates.  Views (``direction``):

* ``upload``: what the server holds of the uploads, self-masks removed (all of them: pair noise is correlated
  across uploads); with ``colluders``, peers hand the server their round's pair material
  (:class:`client.recovery.RecoveryStore`; nadp).  MP family: each upload recovered alone with the round's
  secret R.  Adaptive canaries: one trial per client, its own upload.
* ``model``: the published aggregate; for ddpsa also its upload view (the server reconstructs only the sum).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from flwr.app import ConfigRecord, Message

from client.api import client_env
from protocols.config import RunConfig
from protocols.pairwise import pairwise_noise
from protocols.task.models import get_weights
from protocols.wire.arrays import from_record
from server.audit_canaries import CanaryModel, _AdaptiveCanaries, _Canaries, _client_app
from server.audit_faults import planted
from server.audit_spec import MP_FAMILY, AuditSpec
from server.local_grid import LocalGrid
from strategies.records import to_record
from strategies.registry import strategy_class
from strategies.stages import close_round

__all__ = ["Release", "release"]


@dataclass
class Release:
    """One release's features per trial (canary): ``features`` (trials, f), plus claims."""

    features: np.ndarray
    labels: np.ndarray  # +1 / -1 per trial
    audited: np.ndarray  # bool per trial: part of the audit (its owner is a victim)
    owner: np.ndarray
    claims: dict[str, float]


def release(spec: AuditSpec, cfg: RunConfig, canaries: _Canaries | _AdaptiveCanaries,
            rng: np.random.Generator, raw: dict | None = None) -> Release:
    """Run one round of the method on fresh canaries; return the adversary's view.

    ``raw``: the run config the nodes get (default ``spec.run_config()``; ddpsa: with its intermediate servers).
    """
    canaries.draw(rng, spec.direction)
    grid = LocalGrid(_client_app(canaries), spec.clients, spec.run_config() if raw is None else raw, identities=False)
    strategy = strategy_class(spec.method)(cfg)
    strategy.max_examples = canaries.per_client
    arrays = to_record(get_weights(canaries.model()), strategy.wire_dtype)
    victim = {"node": None}
    with planted(spec.fault, lambda: victim["node"], spec.method):
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
    claims = strategy.privacy.report()
    owner = canaries.owner()
    audited = np.ones(len(owner), dtype=bool)
    if spec.fault in ("skip-pair-noise", "strip-pair-noise"):
        audited = owner == part[victim["node"]]  # a per-client fault: the audit of that client's records
    if spec.direction == "model" or spec.method == "ddpsa":  # ddpsa: the server reconstructs only the sum
        features = canaries.features([from_record(aggregate)])
    elif spec.method in MP_FAMILY:
        features = canaries.features(_mp_recovered(strategy, replies, part))
    elif isinstance(canaries, _AdaptiveCanaries):  # one trial per client: its own upload
        by_part = {part[r.metadata.src_node_id]: from_record(r.content["arrays"]) for r in replies}
        features = np.concatenate([canaries.features([by_part[c]]) for c in range(spec.clients)])
    else:
        uploads = {r.metadata.src_node_id: np.array(from_record(r.content["arrays"])["linear.weight"], dtype=np.float64)
                   for r in replies}
        _unmask(strategy, uploads)  # the server removes every self-mask it rebuilt (double masking)
        if spec.fault == "strip-pair-noise":
            target = victim["node"]
            _strip(strategy, grid, target, [n for n in uploads if n != target], uploads, replies)
        elif spec.colluders:
            colluders = sorted(uploads)[-spec.colluders:]
            for target in sorted(set(uploads) - set(colluders)):
                _strip_with(strategy, target, {c: _material(grid, canaries, c, target) for c in colluders}, uploads)
            audited = ~np.isin(owner, [part[c] for c in colluders])
        features = canaries.features([{"linear.weight": uploads[n]} for n in sorted(uploads, key=part.get)])
    return Release(features, canaries.signs(), audited, owner, claims)


def _mp_recovered(strategy, replies: list[Message], part: dict[int, int]) -> list[dict[str, np.ndarray]]:
    """The MP family's upload view: every upload recovered alone with the round's secret R (the server holds both).

    Eq. (22) on one client's gradient, Psi and Phi gives that client's true-space gradient plus ``R o`` its
    noise (mpddp: eta and its uncancelled Delta's); returned as state-dict arrays, in partition order.
    """
    from protocols.mpddp import recover
    from protocols.wire.mpddp import mean_upload

    st = strategy._state
    out = []
    for r in sorted(replies, key=lambda r: part[r.metadata.src_node_id]):
        up = mean_upload([(r.metadata.src_node_id, r.content["arrays"])], len(st.layers))
        out.append({f"layers.{i}.weight": w.numpy() for i, (w, _) in enumerate(recover(up, st.secret))})
    return out


def _unmask(strategy, uploads: dict[int, np.ndarray]) -> None:
    """Subtract the self-masks the strategy rebuilt this round from ``uploads`` (in place): the server's view."""
    if getattr(strategy, "remove_masks", None) is None or strategy._state is None:
        return
    flat = {n: u.ravel() for n, u in uploads.items()}
    strategy.remove_masks(strategy._state, flat)
    for n, u in flat.items():
        uploads[n] = u.reshape(uploads[n].shape)


def _material(grid: LocalGrid, canaries: _Canaries, colluder: int, target: int) -> bytes:
    """The round's pair seed a colluding client holds with ``target`` (its :class:`RecoveryStore`)."""
    from client.recovery import RecoveryStore

    ctx = grid.contexts[colluder]
    x, y = canaries.data(int(ctx.node_config["partition-id"]))
    store = RecoveryStore.load(client_env(ctx, CanaryModel(canaries.dim), x, y))
    if store is None or target not in store.material:
        raise RuntimeError(f"colluder {colluder} holds no pair material with {target}")
    return store.material[target]


def _strip_with(strategy, target: int, seeds: dict[int, bytes], uploads: dict[int, np.ndarray]) -> None:
    """Remove from ``target``'s upload its pair noise with the peers whose seeds the server holds (in place).

    Peer j's own term for the pair is ``lam * pairwise_noise(j, {target: seed}, scale=std_j,target)`` in the
    aggregate (exactly what the strategy's dropout recovery subtracts); the target's term is its negative,
    scaled by ``1 / p_target`` in the upload.
    """
    st = strategy._state
    alloc, lam, p = st.allocation, st.plan.lam, st.weights[target]
    shape = uploads[target].shape
    flat = uploads[target].ravel()
    for j, seed in seeds.items():
        std = alloc.counteracting_stds(j)[target]
        flat += lam * pairwise_noise(j, {target: seed}, flat.size, scale={target: std}) / p
    uploads[target] = flat.reshape(shape)


def _strip(strategy, grid: LocalGrid, target: int, survivors: list[int], uploads: dict[int, np.ndarray],
           replies: list[Message]) -> None:
    """The planted server fault: the real recovery phase run for ``target`` although its upload is held."""
    st = dataclasses.replace(strategy._state, recovery=None)  # the round again, as the lying server tells it
    st.replies = {r.metadata.src_node_id: r for r in replies if r.metadata.src_node_id in survivors}
    st.uploaded, st.dropped = set(survivors), [target]  # the lie: target's upload "never arrived"
    strategy.recover(grid, st)
    rec = strategy.recovered(st)
    seeds = {j: m[target] for j, m in rec.material.items() if target in m and not rec.is_kept(j, target)}
    _strip_with(strategy, target, seeds, uploads)
