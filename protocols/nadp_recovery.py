"""NADP-FL's noise after a dropout recovery: what each view keeps once the survivors revealed their pairs.

One home for the figures the server's account stage charges (:mod:`strategies.nadp`) and each survivor's ledger
tops up before it answers the recovery request (:mod:`client.recovery_ledger`).  Every std is per coordinate and
before the record sensitivity: a multiplier is the std over the client's sensitivity.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from protocols.nadp import dropout_residual
from protocols.nadp_allocation import NoiseAllocation

__all__ = ["excluded_uplink_std", "noise_after", "receiver_noise_after", "survivor_uplink_stds"]


def survivor_uplink_stds(alloc: NoiseAllocation, lam: float, survivors: Sequence[int],
                         recovered: bool) -> tuple[dict[int, float], dict[int, float]]:
    """Per survivor: std of the server's joint view of the uploads, and of its upload alone.

    Without a recovery (``recovered`` False) the full joint view is a conservative (more informative) stand-in
    for the subset of uploads that arrived.  After a recovery the server also holds the pairs with the
    participants not aggregated: the view is that of the survivors' uploads with those pairs removed.
    """
    if not recovered:
        joint = alloc.joint_uplink_std(lam)
        return {n: joint[n] for n in survivors}, {n: alloc.uplink_std(n, lam) for n in survivors}
    joint = alloc.joint_uplink_std(lam, among=survivors)
    keep = set(survivors)
    marg = {}
    for n in survivors:
        pair_var = math.fsum(std * std for j, std in alloc.counteracting_stds(n).items() if j in keep)
        var = (alloc.residual_std[n] ** 2 + lam * lam * pair_var) / alloc.weights[n] ** 2
        marg[n] = math.sqrt(var)
    return {n: joint[n] for n in survivors}, marg


def excluded_uplink_std(alloc: NoiseAllocation, lam: float, node: int, self_masked: bool) -> float:
    """Std of an excluded upload the server holds, its pair seeds revealed by its aggregated neighbours.

    Its residual noise stays and, when ``self_masked`` (its self-mask, std ``uplink_std``, never rebuilt for a
    node named not aggregated), the self-mask too.
    """
    var = (alloc.residual_std[node] / alloc.weights[node]) ** 2
    if self_masked:
        var += alloc.uplink_variance(node, lam)
    return math.sqrt(var)


def noise_after(alloc: NoiseAllocation, lam: float, survivors: Sequence[int],
                kept: Iterable[tuple[int, int]] | None = None) -> tuple[float, float]:
    """(std of all noise in the renormalised aggregate of ``survivors``, std of its uncancelled pair part).

    ``kept``: after a recovery, the (survivor, gone neighbour) pairs whose noise a survivor kept (the rest was
    removed exactly); None: no recovery, every such pair stays.
    """
    if len(survivors) == len(alloc.client_ids):
        return alloc.aggregate_std, 0.0
    dr = dropout_residual(alloc, survivors, lam, renormalize=True)
    if kept is not None:
        var = lam**2 * math.fsum(alloc.pair_variance(i, j) for i, j in kept) / dr.weight_sum**2
        return math.sqrt(dr.residual_std**2 + var), math.sqrt(var)
    return dr.total_std, dr.uncancelled_std


def receiver_noise_after(alloc: NoiseAllocation, lam: float, survivors: Sequence[int],
                         kept: Iterable[tuple[int, int]] | None = None) -> float:
    """Std of the noise in the renormalised aggregate of ``survivors`` left to a receiving participant.

    The model's account charges this (:func:`noise_after` is all the noise in it): every participant may receive
    the model, and each knows its own residual (a survivor's) and the pair noise it shares with a peer whose pair
    stayed uncancelled (``kept`` as in :func:`noise_after`); the largest such part is taken off
    (:func:`protocols.privacy.receiver_variance`).
    """
    from protocols.privacy.receiver import receiver_variance
    if len(survivors) == len(alloc.client_ids):
        return alloc.receiver_std
    keep = set(survivors)
    gone = [j for j in alloc.client_ids if j not in keep]
    pairs = [(i, j) for i in survivors for j in gone] if kept is None else list(kept)
    known = {c: (alloc.residual_std[c] ** 2 if c in keep else 0.0) for c in alloc.client_ids}
    unc = 0.0
    for i, j in pairs:
        v = lam * lam * alloc.pair_variance(i, j)
        unc += v
        known[i] += v
        known[j] += v
    total = math.fsum(alloc.residual_std[c] ** 2 for c in survivors) + unc
    w_s = math.fsum(alloc.weights[c] for c in survivors)
    return math.sqrt(receiver_variance(total, known.values())) / w_s
