"""NADP-FL (Noise-Annihilation DP-FL) math, Flower-free.

Public entry point of the method; the allocation lives in :mod:`protocols.nadp_allocation`, the calibration
and accounting in :mod:`protocols.nadp_privacy` (both re-exported here).  Upload (Algorithm 1, line 15) of
client ``i`` with normalized weight ``p_i``::

    upload_i = w_i + (1/p_i) * (n_i + lam * c_i),   c_i = sum_{j>i} n_ij - sum_{j<i} n_ij

with ``c_i`` = ``protocols.pairwise.pairwise_noise(i, seeds, size, scale=allocation.counteracting_stds(i))``.
The ``1/p_i`` multiplies the whole bracket (as in Algorithm 1, not Section 5's text), so in
``sum_i p_i upload_i`` the pair terms enter unweighted and a pair ``a < b`` contributes ``n_ab - n_ba``: zero
only if both ends draw the same vector (same seed, sampler and ``sigma_ab``).  Hence ``sigma_ab`` is a
deterministic function of public values (:func:`upload_noise_scales`) and the server weights with exactly the
clients' ``p_i``; the aggregate is the weighted mean of ``w_i + n_i / p_i`` up to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from protocols.nadp_allocation import (
    NoiseAllocation,
    compensation_factor,
    normalize_weights,
    upload_noise_scales,
)
from protocols.nadp_privacy import (
    NadpSigmas,
    calibrate_from_sensitivities,
    calibrate_sigmas,
    eq3_multiplier,
    local_sgd_sensitivity,
    rdp_multiplier,
    sensitivity,
)

__all__ = [
    "DropoutResidual",
    "NadpSigmas",
    "NoiseAllocation",
    "calibrate_from_sensitivities",
    "calibrate_sigmas",
    "compensation_factor",
    "dropout_residual",
    "eq3_multiplier",
    "local_sgd_sensitivity",
    "nadp_aggregate",
    "nadp_upload",
    "normalize_weights",
    "rdp_multiplier",
    "round_plan",
    "sensitivity",
    "upload_noise_scales",
]


def _check_lam(lam: float) -> float:
    lam = float(lam)
    if not math.isfinite(lam) or lam < 1.0:
        # lam < 1 would shrink the counteracting noise below what Alg. 2
        # allocated, i.e. the upload would no longer meet sigma_up.
        raise ValueError(f"compensation factor lam must be finite and >= 1, got {lam!r}")
    return lam


def nadp_upload(
    w: np.ndarray,
    p_i: float,
    residual: np.ndarray,
    counteracting_sum: np.ndarray,
    lam: float = 1.0,
) -> np.ndarray:
    """``w + (residual + lam * counteracting_sum) / p_i`` as float64 (Alg. 1, line 15).

    Args:
        w: the client's (flattened) local model.
        p_i: its normalized weight (``allocation.weights[i]``).
        residual: ``n_i ~ N(0, allocation.residual_std[i]^2)`` per coordinate.
        counteracting_sum: ``sum_{j>i} n_ij - sum_{j<i} n_ij`` (pairwise engine).
        lam: noise compensation factor (>= 1), see :func:`compensation_factor`.
    """
    p_i = float(p_i)
    if not math.isfinite(p_i) or not 0.0 < p_i <= 1.0:
        raise ValueError(f"p_i must be in (0, 1], got {p_i!r}")
    lam = _check_lam(lam)
    w = np.asarray(w, dtype=np.float64)
    residual = np.asarray(residual, dtype=np.float64)
    counteracting_sum = np.asarray(counteracting_sum, dtype=np.float64)
    if not (w.shape == residual.shape == counteracting_sum.shape):
        raise ValueError(
            f"shape mismatch: w {w.shape}, residual {residual.shape}, counteracting_sum {counteracting_sum.shape}"
        )
    return w + (residual + lam * counteracting_sum) / p_i


def nadp_aggregate(uploads: Mapping[int, np.ndarray], weights: Mapping[int, float]) -> np.ndarray:
    """Server side (Alg. 1, line 18): ``sum_i p_i upload_i`` over the given uploads.

    ``weights`` must be the clients' ``p_i`` (normalized over the *sampled*
    set). Summation runs in ascending id order for reproducibility. With
    dropouts, see :func:`dropout_residual` for what remains uncancelled.
    """
    if not uploads:
        raise ValueError("no uploads to aggregate")
    ids = sorted(uploads)
    out = np.zeros_like(np.asarray(uploads[ids[0]], dtype=np.float64))
    for cid in ids:
        out += float(weights[cid]) * np.asarray(uploads[cid], dtype=np.float64)
    return out


@dataclass(frozen=True)
class DropoutResidual:
    """Per-coordinate noise std in the aggregate when only ``survivors`` upload.

    Attributes:
        survivors: ids that uploaded (ascending).
        weight_sum: ``P_S = sum_{i in S} p_i``.
        residual_std: std of the surviving residual noise ``sum_S n_i`` (after
            the optional ``1/P_S`` renormalization).
        uncancelled_std: std of ``lam * sum_{i in S, j not in S} s(i,j) n_ij``,
            the pair noise whose partner never arrived (same scaling).
        total_std: ``sqrt(residual_std^2 + uncancelled_std^2)``.
        uncancelled_pairs: number of (survivor, dropped) pairs.
    """

    survivors: tuple[int, ...]
    weight_sum: float
    residual_std: float
    uncancelled_std: float
    total_std: float
    uncancelled_pairs: int


def dropout_residual(
    allocation: NoiseAllocation,
    survivors: Iterable[int],
    lam: float = 1.0,
    *,
    renormalize: bool = True,
) -> DropoutResidual:
    """Describe the noise left in the aggregate when some sampled clients drop out.

    The server computes ``sum_{i in S} p_i upload_i`` (divided by ``P_S`` if
    ``renormalize``, as a weighted average over the received results does).
    Pair noise between two survivors still cancels; each pair (survivor ``i``,
    dropped ``j``) leaves ``lam * n_ij`` in the aggregate. NADP has no
    recovery step (the paper accepts this, Appendix F.2). E.g. with equal
    sizes under Eq. 3 each pair has variance ``sigma_down^2 / k``, so ``d``
    dropouts add ``lam^2 d (k - d) / k * sigma_down^2`` (before ``1/P_S^2``).
    """
    lam = _check_lam(lam)
    surv = sorted(set(int(c) for c in survivors))
    if not surv:
        raise ValueError("at least one survivor is required")
    for cid in surv:
        if cid not in allocation.weights:
            raise KeyError(f"survivor {cid} was not sampled this round")
    dropped = [c for c in allocation.client_ids if c not in set(surv)]
    p = allocation.weights
    weight_sum = math.fsum(p[c] for c in surv)
    res_var = math.fsum(allocation.residual_std[c] ** 2 for c in surv)
    pair_var = math.fsum(allocation.pair_variance(i, j) for i in surv for j in dropped)
    unc_var = lam * lam * pair_var
    scale = 1.0 / weight_sum if renormalize else 1.0
    return DropoutResidual(
        survivors=tuple(surv),
        weight_sum=weight_sum,
        residual_std=math.sqrt(res_var) * scale,
        uncancelled_std=math.sqrt(unc_var) * scale,
        total_std=math.sqrt(res_var + unc_var) * scale,
        uncancelled_pairs=len(surv) * len(dropped),
    )


#: ``round_plan(calibration="rdp")``: how far (relative) the joint upload view's noise multiplier may stay below
#: the aggregate's; the published model then carries at most this much more noise than its target needs.
JOINT_SLACK = 0.02


def round_plan(
    dataset_sizes: Mapping[int, int],
    sensitivities: Mapping[int, float],
    epsilon: float,
    delta: float,
    rounds: int,
    *,
    graph: Mapping[int, Sequence[int]] | None = None,
    calibration: str = "rdp",
) -> tuple[NadpSigmas, NoiseAllocation]:
    """Calibration + noise allocation for one round's participants (what the strategy sends, what clients check).

    ``dataset_sizes`` maps each participant to ``|D_i|`` (public; the
    aggregation weights), ``sensitivities`` to the record-level L2 sensitivity
    of its local model (:func:`local_sgd_sensitivity`; Lemma 1's ``2C lr/|D_i|``
    for one full-batch step, where this equals :func:`calibrate_sigmas`).
    ``graph`` is the round's pairing graph (:func:`protocols.graphs.round_graph`):
    a complete one (or ``None``) gives Algorithm 2, a sparse one the graph rule
    of :func:`upload_noise_scales`.

    ``calibration``:

    * ``"rdp"`` (default): both views the run reports get the RDP noise multiplier of ``rounds`` releases at
      ``(epsilon, delta)`` (:func:`rdp_multiplier`), with (almost) nothing to
      spare in the published model: the aggregate (downlink: the residual left to a receiving participant that
      knows its own, :attr:`NoiseAllocation.receiver_std`, ``/ max_i p_i Delta_i``; the paper's ``sigma_down``
      counts every participant's residual) and the
      server's *joint* view of all uploads (uplink: :meth:`NoiseAllocation.joint_uplink_std` at ``lam = 1``;
      a larger ``lam`` only adds noise).  The joint view approaches the aggregate's multiplier from below as
      the pair noise grows (the uploads then reveal little more than their sum), so ``sigma_up`` starts at
      Eq. 3's ratio to ``sigma_down`` and doubles until the joint view is within :data:`JOINT_SLACK` of the
      aggregate's; then both are scaled to the target.  Pair noise cancels, so it costs no accuracy.
      Each adversary (the server, the model's recipients) sees ``T`` releases, not Lemma 2's ``2T``.
    * ``"eq3"``: the paper's Eq. 3 (``sigma = Delta sqrt(4 T ln(1/delta)) / eps``).
    """
    key = (tuple(sorted(dataset_sizes.items())), tuple(sorted(sensitivities.items())), float(epsilon), float(delta),
           int(rounds), None if graph is None else tuple(sorted((c, tuple(sorted(nb))) for c, nb in graph.items())),
           calibration)
    return _round_plan_cached(key)


@lru_cache(maxsize=16)
def _round_plan_cached(key: tuple) -> tuple[NadpSigmas, NoiseAllocation]:
    """:func:`round_plan` of one hashable key, computed once per process.

    In one process (in-process runs, simulation workers) the server and every client of a round compute
    the same plan, and the rdp calibration's joint views are the costly part.
    """
    sizes_t, sens_t, epsilon, delta, rounds, graph_t, calibration = key
    dataset_sizes, sensitivities = dict(sizes_t), dict(sens_t)
    graph = None if graph_t is None else {c: list(nb) for c, nb in graph_t}
    sig = calibrate_from_sensitivities(epsilon, delta, rounds, sensitivities, dataset_sizes)
    if calibration == "eq3":
        return sig, upload_noise_scales(dataset_sizes, sig.sigma_up, sig.sigma_down, graph=graph)
    if calibration != "rdp":
        raise ValueError(f"calibration must be 'rdp' or 'eq3', got {calibration!r}")
    target = rdp_multiplier(epsilon, delta, rounds)
    # Eq. 3's shape (each phase's sigma proportional to its sensitivity) at the target multiplier's scale: the plan
    # is linear in (sigma_up, sigma_down), and Eq. 3's own scale at a huge epsilon underflows the pair variances.
    sig = NadpSigmas(sig.sensitivity_up * target, sig.sensitivity_down * target, sig.sensitivity_up,
                     sig.sensitivity_down)
    alloc = upload_noise_scales(dataset_sizes, sig.sigma_up, sig.sigma_down, graph=graph)
    p = alloc.weights
    d_down = max(p[c] * sensitivities[c] for c in alloc.client_ids)

    def multipliers(a: NoiseAllocation) -> tuple[float, float]:
        joint = a.joint_uplink_std(1.0) if a.k > 1 else {c: a.uplink_std(c) for c in a.client_ids}
        return a.receiver_std / d_down, min(joint[c] / sensitivities[c] for c in a.client_ids)

    sigma_up = sig.sigma_up
    z_down, z_up = multipliers(alloc)
    for _ in range(12):  # a complete or connected graph gets there in a few doublings
        if z_up >= (1.0 - JOINT_SLACK) * z_down or alloc.k == 1:
            break
        sigma_up *= 2.0
        alloc = upload_noise_scales(dataset_sizes, sigma_up, sig.sigma_down, graph=graph)
        z_down, z_up = multipliers(alloc)
    scale = target / min(z_down, z_up)  # the allocation is linear in (sigma_up, sigma_down)
    sig = NadpSigmas(sigma_up * scale, sig.sigma_down * scale, sig.sensitivity_up, sig.sensitivity_down)
    return sig, upload_noise_scales(dataset_sizes, sig.sigma_up, sig.sigma_down, graph=graph)
