"""NADP-FL noise-intensity allocation and noise compensation factor.

Paper: "Achieving better utility beyond LDP-FL by independent two-phase protection" (NADP-FL), Section 6,
Appendix E (Theorem 2 / Algorithm 2) and Appendix A (Eq. 7, Eq. 8, Table 3).

One round, ``k`` sampled clients, ``p_i = |D_i| / sum_k |D_k|``: client ``i`` uploads
``w_i + (1/p_i) (n_i + lam * sum_j s(i,j) n_ij)`` with ``s(i,j) = +1`` if ``i < j`` else ``-1`` and
``n_ij = n_ji``; the residual noise ``n_i ~ N(0, v_i)`` survives aggregation, the pair noise
``n_ij ~ N(0, v_ij)`` cancels in ``sum_i p_i upload_i``.  Requirements (Section 6): every upload's noise
variance ``>= sigma_up^2`` and ``Var(sum_i n_i) = sigma_down^2``.  With the paper's ``v_i = p_i sigma_down^2``
each client's pair variances must sum to

    beta_i = p_i^2 sigma_up^2 - p_i sigma_down^2          (absolute variances, so sigma_down = 0 is handled).

:func:`upload_noise_scales` solves this (Algorithm 2, or a sparse graph); :func:`compensation_factor` gives
``lambda`` (Eq. 7-8).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "NoiseAllocation",
    "compensation_factor",
    "graph_pair_variances",
    "neighbourhood_compensation",
    "normalize_weights",
    "upload_noise_scales",
]

# Relative slack accepted for "zero" demands / rounding-level negatives.
_REL_TOL = 1e-12


def _check_sigma(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{name} must be a finite non-negative number, got {value!r}")
    return value


def normalize_weights(weights: Mapping[int, float]) -> dict[int, float]:
    """Return ``{id: p_id}`` with ``p_id = weights[id] / sum(weights)``, ids ascending.

    ``weights`` may be dataset sizes or already-normalized ``p_i``. The sum is
    taken with ``math.fsum`` in ascending-id order so that every party that
    holds the same public mapping gets bit-identical ``p_i`` (needed because
    both ends of a pair derive the pair's noise scale from them).
    """
    if len(weights) == 0:
        raise ValueError("NADP allocation needs at least one sampled client")
    ids = sorted(weights)
    for cid in ids:
        if isinstance(cid, bool) or not isinstance(cid, (int, np.integer)):
            raise ValueError(f"client ids must be integers, got {cid!r}")
    vals = [float(weights[cid]) for cid in ids]
    for cid, val in zip(ids, vals, strict=True):
        if not math.isfinite(val) or val <= 0.0:
            raise ValueError(f"weight of client {cid} must be finite and > 0, got {val!r}")
    total = math.fsum(vals)
    return {int(cid): val / total for cid, val in zip(ids, vals, strict=True)}


def _one_blas_thread():
    """Context manager limiting BLAS to one thread (threadpoolctl ships with scikit-learn); a no-op without it."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - scikit-learn (a dependency) brings it
        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")


@dataclass(frozen=True)
class NoiseAllocation:
    """Per-round NADP noise allocation (all values derivable from public info).

    Attributes:
        client_ids: sampled client ids, ascending.
        weights: normalized aggregation weights ``p_i`` (use exactly these in
            the upload's ``1/p_i`` and in the server's weighted sum).
        sigma_up: per-upload noise std requirement (Theorem 1, Eq. 3).
        sigma_down: aggregate noise std requirement (Theorem 1, Eq. 3).
        residual_std: std of the residual noise ``n_i`` (before ``1/p_i``):
            ``sqrt(p_i) * sigma_down``.
        demand: variance ``beta_i`` the pair noise must supply to client ``i``
            (clamped at 0 when the residual alone already meets sigma_up).
        order: ids in Algorithm-2 processing order (``beta`` ascending, ties
            by id).
        theta: ``theta_1..theta_{k-1}`` pair variances (absolute units).
        aggregate_std: achieved std of the aggregated residual ``sum_i n_i``.
    """

    client_ids: tuple[int, ...]
    weights: Mapping[int, float]
    sigma_up: float
    sigma_down: float
    residual_std: Mapping[int, float]
    demand: Mapping[int, float]
    order: tuple[int, ...]
    theta: tuple[float, ...]
    aggregate_std: float
    _rank: Mapping[int, int] = field(repr=False, compare=False)
    #: Pair variances ``{i: {j: Var(n_ij)}}`` when the pairs form a sparse graph (see
    #: :func:`graph_pair_variances`); ``None`` for the complete graph of Algorithm 2 (``theta``).
    pair_table: Mapping[int, Mapping[int, float]] | None = field(default=None, repr=False, compare=False)
    #: :meth:`joint_uplink_std` results by (lam, among): the server and, in one process, every client ask for
    #: the same view of a round (a k x k Cholesky each).
    _joint_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def k(self) -> int:
        """Number of sampled clients."""
        return len(self.client_ids)

    @property
    def receiver_std(self) -> float:
        """Std of the aggregated residual left to a receiving participant that knows its own ``n_i``.

        :func:`protocols.privacy.receiver_std` of the residual variances (the pair noise cancels): the model's
        account counts this, the paper (``aggregate_std``) every participant's residual.
        """
        from protocols.privacy.receiver import receiver_std
        return receiver_std(self.residual_std[c] ** 2 for c in self.client_ids)

    def _check_id(self, cid: int) -> int:
        if cid not in self._rank:
            raise KeyError(f"client {cid} is not in this round's allocation")
        return self._rank[cid]

    def pair_variance(self, i: int, j: int) -> float:
        """Variance of the shared pair noise ``n_ij`` (= ``n_ji``), before ``lam``."""
        ri, rj = self._check_id(i), self._check_id(j)
        if ri == rj:
            raise ValueError("a client has no pair noise with itself")
        if self.pair_table is not None:
            return self.pair_table[i].get(j, 0.0)  # not neighbours: no pair noise
        return self.theta[min(ri, rj)]

    def counteracting_std(self, i: int, j: int) -> float:
        """Std of ``n_ij``; both ends of the pair get the identical float."""
        return math.sqrt(self.pair_variance(i, j))

    def counteracting_stds(self, i: int) -> dict[int, float]:
        """``{j: std(n_ij)}`` for all peers ``j`` of ``i`` (feeds ``pairwise_noise(scale=...)``)."""
        ri = self._check_id(i)
        if self.pair_table is not None:
            return {j: math.sqrt(v) for j, v in self.pair_table[i].items()}
        sq = [math.sqrt(t) for t in self.theta]
        return {j: sq[min(ri, rj)] for j, rj in self._rank.items() if j != i}

    def pair_variance_total(self, i: int) -> float:
        """``sum_{j != i} Var(n_ij)`` (what Algorithm 2 assigns against ``beta_i``)."""
        r = self._check_id(i)
        if self.pair_table is not None:
            return math.fsum(self.pair_table[i].values())
        k = self.k
        if k == 1:
            return 0.0
        head = math.fsum(self.theta[:r])
        if r <= k - 2:
            return head + (k - 1 - r) * self.theta[r]
        return head

    def uplink_variance(self, i: int, lam: float = 1.0) -> float:
        """Variance of client ``i``'s upload noise ``(n_i + lam*sum s n_ij)/p_i`` (marginal)."""
        p = self.weights[i]
        return (self.residual_std[i] ** 2 + lam * lam * self.pair_variance_total(i)) / (p * p)

    def uplink_std(self, i: int, lam: float = 1.0) -> float:
        """Std of client ``i``'s upload noise as seen in isolation (>= sigma_up for lam >= 1)."""
        return math.sqrt(self.uplink_variance(i, lam))

    def pair_matrix(self) -> np.ndarray:
        """Dense symmetric ``k x k`` matrix of pair variances in ``client_ids`` order (zero diagonal)."""
        if self.pair_table is not None:
            pos = {c: a for a, c in enumerate(self.client_ids)}
            mat = np.zeros((self.k, self.k))
            for i, row in self.pair_table.items():
                for j, v in row.items():
                    mat[pos[i], pos[j]] = v
            return mat
        ranks = np.array([self._rank[c] for c in self.client_ids], dtype=np.int64)
        theta = np.asarray(self.theta + (0.0,), dtype=np.float64)
        mat = theta[np.minimum.outer(ranks, ranks)]
        np.fill_diagonal(mat, 0.0)
        return mat

    def joint_uplink_std(self, lam: float = 1.0, among: Sequence[int] | None = None) -> dict[int, float]:
        """Effective upload-noise std of each client against an observer of *all* uploads.

        Pair noise is correlated across uploads (``n_ij`` appears in ``i``'s
        and ``j``'s), so an eavesdropper who sees all k uploads can partly
        remove it. Per coordinate, the covariance of ``(p_i Z_i)_i`` is
        ``M = diag(p) sigma_down^2 + lam^2 L`` with ``L`` the Laplacian of the
        pair-variance graph; a shift of client i's model is then hidden by an
        effective std ``1 / (p_i sqrt((M^-1)_ii))`` (Mahalanobis norm). This
        view already contains the aggregate (a function of the uploads). The
        paper's analysis (per-upload marginal + aggregate, composed) does not
        use it; we expose it so the lead can report the stricter view too.
        Returns 0 for every client when ``sigma_down == 0`` (aggregate exact).

        ``among``: only these clients uploaded and their pairs with the others were revealed (dropout
        recovery): the view of their uploads with those pairs removed.
        """
        if lam < 0:
            raise ValueError("lam must be >= 0")
        key = (float(lam), None if among is None else tuple(sorted(among)))
        if key not in self._joint_cache:
            self._joint_cache[key] = self._joint_uplink_std(float(lam), among)
        return dict(self._joint_cache[key])

    def _joint_uplink_std(self, lam: float, among: Sequence[int] | None) -> dict[int, float]:
        ids = self.client_ids if among is None else tuple(sorted(among))
        p = np.array([self.weights[c] for c in ids], dtype=np.float64)
        if self.sigma_down == 0.0:
            return {c: 0.0 for c in ids}
        v = self.pair_matrix()
        if among is not None:
            for c in ids:
                self._check_id(c)
            pos = {c: i for i, c in enumerate(self.client_ids)}
            idx = [pos[c] for c in ids]
            v = v[np.ix_(idx, idx)]
        m = lam * lam * (np.diag(v.sum(axis=1)) - v)
        m[np.diag_indices_from(m)] += p * self.sigma_down**2
        # SPD (diag(p) > 0 plus a PSD Laplacian): Cholesky, then diag of inverse.
        with _one_blas_thread():  # k x k is small: extra BLAS threads only add spin overhead
            chol = np.linalg.cholesky(m)
            inv_chol = np.linalg.solve(chol, np.eye(len(ids)))
        diag_inv = np.einsum("ij,ij->j", inv_chol, inv_chol)
        eff = 1.0 / (p * np.sqrt(diag_inv))
        return {c: float(e) for c, e in zip(ids, eff, strict=True)}

    def min_compensation_factor(self, n_colluders: int) -> float:
        """Smallest ``lam >= 1`` keeping every honest upload at ``sigma_up`` under collusion.

        Exact per-round counterpart of Eq. 7: the adversary (server plus
        ``n_colluders`` sampled clients, worst-case choice) knows and removes
        the pair noise an honest client shares with colluders, so client ``i``
        keeps ``v_i + lam^2 * (sum of its k-1-n_colluders smallest pair
        variances)`` and needs ``lam^2 * rest >= beta_i``. Returns ``inf`` when
        some client with positive demand would have no honest partner left.
        """
        if n_colluders < 0:
            raise ValueError("n_colluders must be >= 0")
        k = self.k
        honest_partners = k - 1 - n_colluders
        theta = np.asarray(self.theta, dtype=np.float64)
        dense = self.pair_matrix() if self.pair_table is not None else None
        pos = {c: a for a, c in enumerate(self.client_ids)}
        worst = 1.0
        for cid in self.client_ids:
            beta = self.demand[cid]
            if beta <= 0.0:
                continue
            if honest_partners <= 0:
                return math.inf
            if dense is not None:  # sparse graph: the colluders are the client's largest pairs, non-pairs count 0
                row = np.delete(dense[pos[cid]], pos[cid])
            else:
                r = self._rank[cid]
                row = np.concatenate([theta[:r], np.full(max(k - 1 - r, 0), theta[r] if r < k - 1 else 0.0)])
            rest = float(np.sort(row)[:honest_partners].sum())
            if rest <= 0.0:
                return math.inf
            worst = max(worst, math.sqrt(beta / rest))
        return worst


def upload_noise_scales(weights: Mapping[int, float], sigma_up: float, sigma_down: float, *,
                        graph: Mapping[int, Sequence[int]] | None = None) -> NoiseAllocation:
    """Allocate NADP residual / counteracting noise for one round (Alg. 2, or a sparse graph).

    Algorithm 2 (complete graph): sort the clients by ``beta`` ascending; the n-th spreads what is left of its
    demand over its pairs with all later clients, ``theta_n = (beta_n - sum_{m<n} theta_m) / (k - n)`` for
    ``n = 1..k-2``, and ``theta_{k-1} = beta_k - sum_{m<k-1} theta_m`` (the paper's "adjust beta_{k-1} <- beta_k");
    pair ``(a, b)`` gets ``theta_{min(rank a, rank b)}``.  Only the second-largest demand is over-served, which
    costs no utility (pair noise cancels).

    Args:
        weights: ``{client_id: |D_i|}`` (or ``p_i``) for the sampled clients;
            normalized internally (see :func:`normalize_weights`).
        sigma_up: required std of each client's upload noise (Eq. 3).
        sigma_down: required std of the aggregated noise (Eq. 3).
        graph: symmetric adjacency ``{id: [neighbour ids]}`` over exactly the
            sampled clients when pairs form a sparse graph (e.g. a random
            n-out graph); ``None`` = every two clients pair (Algorithm 2).
            See :func:`graph_pair_variances` for the sparse rule.

    Returns:
        A :class:`NoiseAllocation` with non-negative variances; every client's
        marginal upload std is ``>= sigma_up`` and the aggregated residual has
        std exactly ``sigma_down``. Deterministic in (weights, sigmas): all
        parties holding the same public inputs compute identical floats.

    Raises:
        ValueError: invalid inputs, or infeasible (a single sampled client
            with ``sigma_up > sigma_down``: there is nobody to cancel with, so
            the upload -- which *is* the aggregate -- cannot carry more noise
            than ``sigma_down``).
    """
    sigma_up = _check_sigma("sigma_up", sigma_up)
    sigma_down = _check_sigma("sigma_down", sigma_down)
    p = normalize_weights(weights)
    ids = tuple(p)
    k = len(ids)

    # beta_i: pair variance still needed after the residual v_i = p_i sigma_down^2.
    # Negative beta (residual alone already exceeds sigma_up, possible only when
    # sigma_up / sigma_down < 1/sqrt(p_i), i.e. not with the paper's Eq. 3
    # calibration) is clamped to 0: that client simply gets more uplink noise.
    demand: dict[int, float] = {}
    for cid in ids:
        need = p[cid] * p[cid] * sigma_up * sigma_up
        beta = need - p[cid] * sigma_down * sigma_down
        demand[cid] = beta if beta > _REL_TOL * need else 0.0

    if k == 1 and demand[ids[0]] > 0.0:
        raise ValueError(
            "NADP allocation infeasible: only one client sampled, so no counteracting "
            f"noise is possible, but sigma_up={sigma_up} > sigma_down={sigma_down}; "
            "sample at least two clients or use sigma_up <= sigma_down"
        )

    order = tuple(sorted(ids, key=lambda c: (demand[c], c)))
    residual_std = {cid: math.sqrt(p[cid]) * sigma_down for cid in ids}
    aggregate_std = math.sqrt(math.fsum(p[cid] * sigma_down * sigma_down for cid in ids))
    if graph is not None and any(len(graph.get(c, ())) != k - 1 for c in ids):
        table = graph_pair_variances(demand, graph)
        return NoiseAllocation(client_ids=ids, weights=p, sigma_up=sigma_up, sigma_down=sigma_down,
                               residual_std=residual_std, demand=demand, order=order, theta=(),
                               aggregate_std=aggregate_std, _rank={cid: r for r, cid in enumerate(order)},
                               pair_table=table)
    betas = [demand[c] for c in order]
    theta: list[float] = []
    acc = 0.0  # sum of theta so far
    for n in range(k - 2):  # paper's n = 1..k-2 (0-based here)
        t = (betas[n] - acc) / (k - 1 - n)
        theta.append(t)
        acc += t
    if k >= 2:
        theta.append(betas[k - 1] - acc)  # beta_{k-1} <- beta_k adjustment
    scale = max(betas) if betas else 0.0
    for idx, t in enumerate(theta):
        # Provably >= 0 (remaining demands stay sorted and non-negative); only
        # rounding can push a value below zero.
        if t < -1e-9 * scale:
            raise ValueError(f"NADP allocation produced a negative pair variance theta[{idx}]={t}")
        theta[idx] = max(t, 0.0)

    return NoiseAllocation(
        client_ids=ids,
        weights=p,
        sigma_up=sigma_up,
        sigma_down=sigma_down,
        residual_std=residual_std,
        demand=demand,
        order=order,
        theta=tuple(theta),
        aggregate_std=aggregate_std,
        _rank={cid: r for r, cid in enumerate(order)},
    )


def graph_pair_variances(demand: Mapping[int, float], graph: Mapping[int, Sequence[int]]
                         ) -> dict[int, dict[int, float]]:
    """Pair variances over a sparse graph: ``Var(n_ij) = max(beta_i / deg_i, beta_j / deg_j)``.

    Generalises Algorithm 2 (which needs every two clients to pair) to any
    symmetric graph, e.g. the random n-out graph that makes the per-client cost
    O(n) instead of O(k): each client spreads its demand evenly over its edges
    and an edge takes the larger of its two ends' shares, so every client gets
    ``sum_j Var(n_ij) >= beta_i`` (over-serving is harmless: pair noise cancels in
    the aggregate, it only adds uplink privacy).  The rule uses public values only
    (sizes -> demands, the graph), so both ends of a pair compute the same float.
    """
    ids = sorted(demand)
    if sorted(graph) != ids:
        raise ValueError("graph must list exactly the sampled clients")
    rows = {i: set(graph[i]) for i in ids}
    for i in ids:
        nbrs = rows[i]
        if i in nbrs or len(nbrs) != len(graph[i]) or not nbrs <= rows.keys():
            raise ValueError(f"graph row of client {i} has a self-loop, a duplicate or an unknown id")
        if any(i not in rows[j] for j in nbrs):
            raise ValueError(f"graph is not symmetric at client {i}")
        if demand[i] > 0.0 and not nbrs:
            raise ValueError(f"client {i} needs pair noise (beta > 0) but has no neighbour")
    share = {i: demand[i] / len(graph[i]) if graph[i] else 0.0 for i in ids}
    return {i: {j: max(share[i], share[j]) for j in sorted(graph[i])} for i in ids}


def compensation_factor(tau: float, *, k: int | None = None, size_ratio: float = 1.0) -> float:
    """Noise compensation factor ``lam`` for a tolerated collusion rate (Eq. 8).

    ``lam = sqrt((k * a^2 - 1) / ((1 - tau) * k - 1))`` with ``a = |D_max| /
    |D_min|`` over the sampled clients; ``k=None`` gives the ``k -> inf``
    limit ``a / sqrt(1 - tau)``. Table 3 of the paper lists ``a^2`` in its
    first column (1.0, 1.5, 2.0). The bound assumes the paper's Eq. 3
    calibration (``sigma_up / sigma_down = |D| / |D_min|``); for an exact,
    per-round value use :meth:`NoiseAllocation.min_compensation_factor`.

    Raises:
        ValueError: ``tau`` outside ``[0, 1)``, ``size_ratio < 1``, or
            ``(1 - tau) k <= 1`` (no honest partner left to hide behind).
    """
    tau = float(tau)
    a = float(size_ratio)
    if not 0.0 <= tau < 1.0:
        raise ValueError(f"tau must be in [0, 1), got {tau}")
    if not math.isfinite(a) or a < 1.0:
        raise ValueError(f"size_ratio |D_max|/|D_min| must be >= 1, got {a}")
    if k is None:
        return a / math.sqrt(1.0 - tau)
    if k < 2:
        raise ValueError(f"k must be >= 2, got {k}")
    honest_others = (1.0 - tau) * k - 1.0
    if honest_others <= 0.0:
        raise ValueError(
            f"tau={tau} with k={k} leaves (1-tau)k-1={honest_others} <= 0 honest partners; "
            "no compensation factor can protect an honest client"
        )
    return math.sqrt((k * a * a - 1.0) / honest_others)


def neighbourhood_compensation(tau: float, sizes: Mapping[int, int], graph: Mapping[int, Sequence[int]] | None = None,
                               roster: Mapping[int, int] | None = None) -> float:
    """Eq. 8's ``lam`` over every client's neighbourhood, its colluders counted in the roster's (the largest).

    ``sizes``: client -> ``|D_i|`` (``a`` is their largest ratio); ``graph``: the round's pairing graph (None:
    complete); ``roster``: client -> its neighbours in the roster's graph of the round, present or not (default:
    its degree in ``graph``).  A client is assumed to see a ``tau`` share of its roster neighbourhood
    (``roster + 1`` clients, Eq. 8's ``k``) collude, all of them among the present ones: its ``d + 1`` present
    clients then hold a share ``tau (roster + 1) / (d + 1)`` of colluders, so a server that leaves honest
    neighbours out cannot shrink the coalition ``lam`` protects against.  On a complete roster graph with every
    client present this is Eq. 8 over the participants, on a sparse one Eq. 8 over the smallest neighbourhood.

    Raises:
        ValueError: as :func:`compensation_factor`, for a client whose colluders could be all its present
            neighbours (no compensation factor can protect it).
    """
    ratio = max(sizes.values()) / min(sizes.values())
    worst = 1.0
    for c in sizes:
        d = len(sizes) - 1 if graph is None else len(graph[c])
        big = max(d, int((roster or {}).get(c, d)))
        share = float(tau) * (big + 1) / (d + 1)
        if share >= 1.0:
            raise ValueError(f"tau={tau} of client {c}'s {big} roster neighbours could be all its {d} present ones: "
                             "no compensation factor can protect it")
        worst = max(worst, compensation_factor(share, k=d + 1, size_ratio=ratio))
    return worst
