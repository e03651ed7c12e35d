"""NISS's joint view: what the server learns of one client from all the round's uploads together.

Client k's upload (Algorithm 2) carries ``e_k = sum_{j in N(k)} n_{k->j} - sum_{j in N(k)} s_{kj} n_{j->k}``: its own
shares (one per neighbour, variance ``u_k = sigma_k^2 / d_k``) and each neighbour's negated share times the
distortion ``s ~ N(1, tau^2)``.  With ``E s = 1`` and ``E s^2 = 1 + tau^2`` (the moments of Lemma 1, Eq. (4)) the
uploads' noise has covariance (per coordinate, ``t = 1 + tau^2``)::

    Sigma_kk = d_k u_k + t sum_{j in N(k)} u_j,      Sigma_kj = -(u_k + u_j)  (j in N(k)),  0 otherwise.

The paper's guarantee looks at one upload (``Sigma_kk``, Eqs. (11)-(12)); the server holds them all, and its best
linear unbiased view of client k leaves ``1 / (Sigma^-1)_kk``.

Colluders.  The claim covers the server colluding with up to ``K_k = floor(niss-rho x d_k)`` of client k's ``d_k``
neighbours (:func:`colluder_count`; Theorem 3's rho).  A colluder c hands the server its whole round: the shares
it sent and received and its distortions of them (and its data, so its own upload carries no unknown noise).  Given
that, an honest h's upload loses its share to c (``u_h``) and the known part of c's distorted share to it (``u_c``
of the ``t u_c``; the rest, ``(s - 1) n``, stays: ``tau^2 u_c``, h's distortion is h's secret).  So the server's
view of the honest uploads ``H = V - C`` has the covariance::

    Sigma_C = Sigma[H, H] - D_C,      (D_C)_hh = sum_{c in C, c ~ h} (u_h + u_c),

the linear conditioning of the second-moment model on the colluders' material.  :func:`joint_factors` with ``rho``
gives ``f_k = min_C 1 / ((Sigma_C^-1)_kk sigma_k^2)`` over the colluder sets ``C`` of ``K_k`` of k's neighbours
(more colluders only add information, so sets of exactly ``K_k`` suffice), scale-free: every sigma times c leaves f
unchanged; :func:`joint_scale` the factor ``c = max(1, 1 / sqrt(min_k f_k))`` on every sigma after which no honest
client's conditioned view has less than the variance its accountant charges.  Treating ``s n`` by its second
moments is a Gaussian approximation of the product noise (``s n`` is not Gaussian; given the colluder's share the
server knows each coordinate's residual scale ``tau |n|``).  ``tau = 0`` makes ``Sigma`` singular (the sum of the
uploads is noiseless): ``f = 0`` and no scale helps (:func:`joint_scale` raises).

The worst colluder set.  A complete graph (every other client a neighbour): the view depends on the colluders only
through their share variances, and the worst set is searched among the windows of ``K_k`` consecutive clients in
the order of ``u`` (the others of k sorted by ``u``; ``n - K_k`` windows, each an O(n) closed form, vectorised):
on equal ``u`` (client level, or record level with one full-batch step: every ``sigma_k`` equal) every set is
alike and the search is exact; on unequal ``u`` the window is the exact worst on every exhaustively searched case in
``tests/test_niss_joint.py`` (it need not be the largest or the smallest ``u``).  Any other graph: every set of
``K_k`` of k's ``d_k`` neighbours when there are at most :data:`EXHAUSTIVE_SETS` (exact; 70 at a 4-out degree of 8,
up to a degree of 11), else a greedy set improved by single swaps (a local worst, not proven the worst); each set is
two small updates of ``Sigma^-1`` (:func:`_set_precisions`).

Cost, per round on both ends: a complete graph O(n^2) per distinct ``(u_k, extra_k)`` (one at equal sigmas: 0.05 s
CPU at 1,000 clients; O(n^3), about 20 s, when every u differs); any other graph one dense Cholesky inverse O(n^3)
plus the set search (0.9 s CPU at 100 clients on a 4-out graph, 10 s at 1,000).  Pure functions of public
values.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np
from scipy.linalg import lapack

from protocols.niss import MIN_TAU

__all__ = ["MIN_TAU", "colluder_count", "joint_covariance", "joint_factors", "joint_scale",
           "receiver_downlink_multiplier", "receiver_downlink_scale", "recovered_multiplier", "share_variances",
           "survivor_factors", "view_multipliers"]


def share_variances(sigmas: Mapping[int, float], graph: Mapping[int, Sequence[int]]) -> dict[int, float]:
    """``u_k = sigma_k^2 / d_k``: the variance of one of client k's shares (one per neighbour, Sec. IV-A)."""
    out = {}
    for k, s in sigmas.items():
        d = len(graph[k])
        if d < 1:
            raise ValueError(f"client {k} has no neighbour to share noise with")
        out[k] = float(s) ** 2 / d
    return out


def _nodes(graph: Mapping[int, Sequence[int]]) -> tuple[list[int], bool]:
    """``(sorted nodes, complete?)``; ValueError unless ``graph`` is a symmetric adjacency without self-loops."""
    adj = {int(k): set(nbrs) for k, nbrs in graph.items()}
    n = len(adj)
    for k, nbrs in adj.items():
        if len(nbrs) != len(graph[k]) or k in nbrs or not nbrs <= adj.keys():
            raise ValueError(f"the graph is not an adjacency over its nodes (at node {k})")
    complete = all(len(nbrs) == n - 1 for nbrs in adj.values())  # then symmetric too
    if not complete and any(k not in adj[j] for k, nbrs in adj.items() for j in nbrs):
        raise ValueError("the graph is not symmetric")
    return sorted(adj), complete


def joint_covariance(u: Mapping[int, float], graph: Mapping[int, Sequence[int]], tau: float,
                     extra: Mapping[int, float] | None = None) -> np.ndarray:
    """The dense ``Sigma`` of the module docstring, rows and columns in sorted node order (``extra``: :func:`joint_factors`)."""
    nodes, _ = _nodes(graph)
    pos = {k: i for i, k in enumerate(nodes)}
    t = 1.0 + tau * tau
    sigma = np.zeros((len(nodes), len(nodes)))
    for k in nodes:
        i = pos[k]
        sigma[i, i] = len(graph[k]) * u[k] + t * math.fsum(u[j] for j in graph[k]) + (extra or {}).get(k, 0.0)
        for j in graph[k]:
            sigma[i, pos[j]] = -(u[k] + u[j])
    return sigma


def _complete_diag_inverse(u: np.ndarray, tau: float, extra: np.ndarray) -> np.ndarray:
    """``diag(Sigma^-1)`` on a complete graph of ``n = len(u)`` nodes, in O(n).

    Here ``Sigma = diag(alpha) - (u 1^T + 1 u^T)`` with ``alpha_k = (n + 1 - t) u_k + t U + extra_k``
    (``U = sum u``, ``t = 1 + tau^2``): a diagonal minus a rank-2 term ``B C B^T``, ``B = [u, 1]``, ``C = [[0, 1], [1, 0]]``.
    Woodbury: ``Sigma^-1 = A^-1 + A^-1 B M^-1 B^T A^-1`` with ``M = C - B^T A^-1 B``, so
    ``(Sigma^-1)_kk = 1/alpha_k + b_k^T M^-1 b_k / alpha_k^2``, ``b_k = (u_k, 1)``.
    """
    n, t = len(u), 1.0 + tau * tau
    alpha = (n + 1 - t) * u + t * float(np.sum(u)) + extra
    a = 1.0 / alpha
    s_uu, s_u1, s_11 = float(np.sum(u * u * a)), float(np.sum(u * a)), float(np.sum(a))
    m = np.array([[-s_uu, 1.0 - s_u1], [1.0 - s_u1, -s_11]])
    minv = np.linalg.inv(m)
    quad = minv[0, 0] * u * u + 2.0 * minv[0, 1] * u + minv[1, 1]
    return a + quad * a * a


def _dense_inverse(sigma: np.ndarray) -> np.ndarray:
    """``Sigma^-1`` of a dense symmetric positive definite ``Sigma`` from its Cholesky factor (ValueError if not PD)."""
    chol, info = lapack.dpotrf(sigma, lower=1)
    if info != 0:
        raise ValueError("the uploads' noise covariance is not positive definite")
    inv, info = lapack.dpotri(chol, lower=1)
    if info != 0:
        raise ValueError("the uploads' noise covariance is singular")
    return np.tril(inv) + np.tril(inv, -1).T


def _dense_diag_inverse(sigma: np.ndarray) -> np.ndarray:
    """``diag(Sigma^-1)`` of a dense symmetric positive definite ``Sigma`` (ValueError if not PD)."""
    return np.diag(_dense_inverse(sigma)).copy()


def colluder_count(rho: float, degree: int) -> int:
    """``K = floor(rho x degree)``: the colluding neighbours the claim covers for a client of ``degree`` neighbours."""
    if not (0.0 <= rho <= 1.0):
        raise ValueError(f"rho must lie in [0, 1], got {rho!r}")
    return min(math.floor(rho * int(degree) + 1e-9), int(degree))


def _complete_colluded(u: np.ndarray, tau: float, extra: np.ndarray, i: int, k: int) -> float:
    """``max_C (Sigma_C^-1)_ii`` on a complete graph over the windows ``C`` of ``k`` consecutive others in ``u`` order.

    Honest ``H = V - C`` (``h = n - k`` nodes) is a complete graph again, with ``extra_j + tau^2 U_C`` on every
    diagonal: :func:`_complete_diag_inverse`'s ``alpha_j = (h + 1 - t) u_j + t U_H + extra_j + tau^2 U_C``, i.e.
    ``beta_j - U_C`` with ``beta_j = (h + 1 - t) u_j + extra_j + t U`` (``t - tau^2 = 1``), one row per window.
    """
    n, t = len(u), 1.0 + tau * tau
    others = np.array([j for j in np.lexsort((extra, u)) if j != i])
    windows = np.lib.stride_tricks.sliding_window_view(others, k)  # (n - k, k)
    u_c = u[windows].sum(axis=1)
    honest = np.ones((len(windows), n), dtype=bool)
    np.put_along_axis(honest, windows, False, axis=1)
    beta = (n - k + 1 - t) * u + extra + t * float(np.sum(u))
    a = np.where(honest, 1.0 / (beta[None, :] - u_c[:, None]), 0.0)
    s_uu, s_u1, s_11 = a @ (u * u), a @ u, a.sum(axis=1)
    det = s_uu * s_11 - (1.0 - s_u1) ** 2  # M = [[-s_uu, 1 - s_u1], [1 - s_u1, -s_11]]
    quad = (-s_11 * u[i] ** 2 - 2.0 * (1.0 - s_u1) * u[i] - s_uu) / det
    ai = a[:, i]
    return float(np.max(ai + quad * ai * ai))


#: Colluder sets searched exhaustively per client on a sparse graph; above, a greedy set improved by swaps.
EXHAUSTIVE_SETS = 512


def _dense_colluded(sigma: np.ndarray, adj: np.ndarray, u: np.ndarray, ks: np.ndarray) -> np.ndarray:
    """``max_C (Sigma_C^-1)_ii`` per node ``i`` over the sets ``C`` of ``ks[i]`` of its neighbours (adjacency ``adj``).

    Every set when there are at most :data:`EXHAUSTIVE_SETS`, else a greedy set (one colluder at a time, the
    worst) improved by single swaps until none helps.  Each set: :func:`_set_precisions`.
    """
    prec = _dense_inverse(sigma)
    out = np.diag(prec).copy()
    for i in np.flatnonzero(ks):
        cand, k = [int(j) for j in np.flatnonzero(adj[i])], int(ks[i])
        if math.comb(len(cand), k) <= EXHAUSTIVE_SETS:
            out[i] = float(np.max(_set_precisions(prec, adj, u, int(i), list(itertools.combinations(cand, k)))))
            continue
        chosen: list[int] = []
        for _ in range(k):
            rest = [c for c in cand if c not in chosen]
            chosen.append(rest[int(np.argmax(_set_precisions(prec, adj, u, int(i), [(*chosen, c) for c in rest])))])
        best = float(_set_precisions(prec, adj, u, int(i), [tuple(chosen)])[0])
        while True:
            swaps = [tuple(sorted({*chosen} - {a} | {b})) for a in chosen for b in cand if b not in chosen]
            vals = _set_precisions(prec, adj, u, int(i), swaps)
            if float(np.max(vals)) <= best * (1 + 1e-12):
                break
            best, chosen = float(np.max(vals)), list(swaps[int(np.argmax(vals))])
        out[i] = best
    return out


def _set_precisions(prec: np.ndarray, adj: np.ndarray, u: np.ndarray, i: int,
                    sets: Sequence[tuple[int, ...]]) -> np.ndarray:
    """``(Sigma_C^-1)_ii`` per colluder set ``C`` (all of one size, neighbours of ``i``) from ``G = Sigma^-1``.

    Removing C's uploads: ``Q = G - G[:, C] G[C, C]^-1 G[C, :]`` (= ``(Sigma[H, H])^-1``); then ``D_C`` on the honest
    neighbours A of C (i among them) by Woodbury: ``Q_ii + Q[i, A] (D_A^-1 - Q[A, A])^-1 Q[A, i]``.  A is padded to
    the largest of the batch with decoupled identity rows.
    """
    if len(sets) > 256:
        return np.concatenate([_set_precisions(prec, adj, u, i, sets[s:s + 256]) for s in range(0, len(sets), 256)])
    c = np.array(sets, dtype=int)  # (S, K)
    rows = adj[c]  # (S, K, n)
    cnt, su = rows.sum(axis=1), (rows * u[c][..., None]).sum(axis=1)
    touched = cnt > 0
    np.put_along_axis(touched, c, False, axis=1)
    touched[:, i] = False
    width = 1 + int(touched.sum(axis=1).max())
    order = np.argsort(~touched, axis=1, kind="stable")[:, : width - 1]
    x = np.concatenate([np.full((len(c), 1), i), order], axis=1)  # (S, width), i first
    valid = np.concatenate([np.ones((len(c), 1), dtype=bool), np.take_along_axis(touched, order, axis=1)], axis=1)
    d = np.take_along_axis(cnt * u + su, x, axis=1)
    g_xc = prec[x[:, :, None], c[:, None, :]]
    q = prec[x[:, :, None], x[:, None, :]] - g_xc @ np.linalg.solve(prec[c[:, :, None], c[:, None, :]],
                                                                    np.swapaxes(g_xc, 1, 2))
    pair = valid[:, :, None] & valid[:, None, :]
    eye = np.eye(width)[None]
    m = np.where(pair, _diag_stack(np.where(valid, 1.0 / np.where(valid, d, 1.0), 0.0)) - q, eye)
    rhs = np.where(valid, q[:, :, 0], 0.0)[..., None]
    try:
        return q[:, 0, 0] + (rhs * np.linalg.solve(m, rhs)).sum(axis=(1, 2))
    except np.linalg.LinAlgError as err:
        raise ValueError("a colluder-conditioned noise covariance is singular") from err


def _diag_stack(d: np.ndarray) -> np.ndarray:
    """``(b, n)`` -> ``(b, n, n)`` diagonal matrices."""
    out = np.zeros(d.shape + d.shape[-1:])
    idx = np.arange(d.shape[-1])
    out[:, idx, idx] = d
    return out


#: The last rounds' factors by their inputs: the server and the clients that share a process (in-process and
#: simulation runs) compute a round's factors once.
_FACTORS: OrderedDict[tuple, dict[int, float]] = OrderedDict()
_FACTORS_KEPT = 8


def joint_factors(sigmas: Mapping[int, float], graph: Mapping[int, Sequence[int]], tau: float,
                  u: Mapping[int, float] | None = None, extra: Mapping[int, float] | None = None, rho: float = 0.0,
                  degrees: Mapping[int, int] | None = None) -> dict[int, float]:
    """``f_k = min_C 1 / ((Sigma_C^-1)_kk sigma_k^2)`` per node of the round's pairing ``graph`` (module docstring).

    Args:
        sigmas: node -> ``sigma_k``, the upload noise std the accountant charges (scale-free: only ratios matter).
        graph: the round's symmetric pairing graph over the uploads the server holds (node -> neighbours).
        tau: the round's distortion std (one for every receiver, :func:`protocols.niss.client_tau`).
        u: node -> variance of each of its shares still in the uploads (default :func:`share_variances`;
            after a recovery, the shares the survivors exchanged among themselves).
        extra: node -> variance of independent noise its upload holds besides (own shares kept after a recovery).
        rho: run-config ``niss-rho``: the server sees the material of the worst :func:`colluder_count` of each
            client's neighbours (0: no colluder).
        degrees: node -> the degree ``K_k`` is counted from (default its degree in ``graph``; after a recovery,
            in the round's graph), at most its neighbours in ``graph``.

    Returns:
        node -> ``f_k`` (all 0 for ``tau = 0``: the sum of the uploads is noiseless).

    Raises:
        ValueError: a non-symmetric graph, a node without a neighbour, ``tau`` < 0, not finite or in
            ``(0, MIN_TAU)``, ``rho`` outside [0, 1].
    """
    if not (math.isfinite(tau) and tau >= 0):
        raise ValueError(f"tau must be finite and >= 0, got {tau!r}")
    if 0 < tau < MIN_TAU:
        raise ValueError(f"tau = {tau!r} is below {MIN_TAU:g}: float64 cannot compute the joint view's factors "
                         "reliably there (MIN_TAU)")
    key = (_items(sigmas), tuple((k, tuple(sorted(graph[k]))) for k in sorted(graph)), float(tau), _items(u), _items(extra),
           float(rho), _items(degrees))
    if (hit := _FACTORS.get(key)) is not None:
        _FACTORS.move_to_end(key)
        return dict(hit)
    factors = _joint_factors(sigmas, graph, tau, u, extra, rho, degrees)
    _FACTORS[key] = dict(factors)
    while len(_FACTORS) > _FACTORS_KEPT:
        _FACTORS.popitem(last=False)
    return factors


def _items(m: Mapping | None) -> tuple | None:
    """A hashable, order-free form of a mapping (None stays None)."""
    return None if m is None else tuple(sorted((k, float(v)) for k, v in m.items()))


def _joint_factors(sigmas: Mapping[int, float], graph: Mapping[int, Sequence[int]], tau: float,
                   u: Mapping[int, float] | None, extra: Mapping[int, float] | None, rho: float,
                   degrees: Mapping[int, int] | None) -> dict[int, float]:
    """:func:`joint_factors` computed."""
    u = share_variances(sigmas, graph) if u is None else u
    nodes, complete = _nodes(graph)
    ks = np.array([min(colluder_count(rho, (degrees or {}).get(k, len(graph[k]))), len(graph[k])) for k in nodes])
    if tau == 0:
        return dict.fromkeys(nodes, 0.0)
    uv = np.array([u[k] for k in nodes], dtype=float)
    ex = np.array([(extra or {}).get(k, 0.0) for k in nodes], dtype=float)
    if complete and len(nodes) > 1:
        diag = _complete_diag_inverse(uv, tau, ex)
        memo: dict[tuple[float, float, int], float] = {}
        for i in np.flatnonzero(ks):
            key = (float(uv[i]), float(ex[i]), int(ks[i]))
            if key not in memo:
                memo[key] = _complete_colluded(uv, tau, ex, int(i), int(ks[i]))
            diag[i] = memo[key]
    elif ks.any():
        pos = {k: i for i, k in enumerate(nodes)}
        adj = np.zeros((len(nodes), len(nodes)), dtype=bool)
        for k in nodes:
            adj[pos[k], [pos[j] for j in graph[k]]] = True
        diag = _dense_colluded(joint_covariance(u, graph, tau, extra), adj, uv, ks)
    else:
        diag = _dense_diag_inverse(joint_covariance(u, graph, tau, extra))
    return {k: 1.0 / (float(d) * float(sigmas[k]) ** 2) for k, d in zip(nodes, diag, strict=True)}


def joint_scale(factors: Mapping[int, float]) -> float:
    """``c = max(1, 1 / sqrt(min_k f_k))`` of :func:`joint_factors`: sigmas times ``c`` keep every joint view >= sigma_k^2.

    One factor for all: ``Sigma`` is a sum over the shares of PSD terms proportional to their sender's
    ``sigma^2``, so as long as every client adds at least ``c`` times its sigma (each refuses less, whatever
    the server tells the others) ``Sigma >= c^2 Sigma_0`` and every ``f_k`` bound holds.  Never below 1 (the
    per-upload calibration, which other views such as Theorem 3's colluding neighbours rely on).
    Raises ValueError when some ``f_k = 0`` (``tau = 0``: no scale protects the joint view then) or is not finite
    (a ``tau`` whose square float64 cannot carry).
    """
    if not all(math.isfinite(v) for v in factors.values()):
        raise ValueError("the joint view's noise factors are not finite numbers: run-config 'niss-tau' is too large "
                         "for float64 (its square enters the uploads' covariance); lower 'niss-tau'")
    f = min(factors.values())
    if not f > 0:
        raise ValueError("niss-tau = 0: the sum of the uploads is noiseless, so the uploads together carry no "
                         "guarantee and no noise scale gives one")
    return max(1.0, 1.0 / math.sqrt(f))


def view_multipliers(factors: Mapping[int, float], z: float, scale: float) -> dict[int, float]:
    """``z_k = z c sqrt(f_k)``: the noise multiplier client k's view keeps (``factors``: :func:`joint_factors`).

    Every ``sigma_k = z Delta f_k`` raised by ``c`` = ``scale`` leaves client k's view ``c^2 f_k sigma_k^2``
    (``f_k`` is scale-free), i.e. std ``z c sqrt(f_k)`` times its sensitivity.  With the factors of ``rho = 0``
    this is the view without colluding neighbours: never below the ``z c sqrt(min f)`` of the factors given
    colluders (conditioning on their material only removes noise), which :func:`joint_scale` keeps at ``z`` or
    more.  Raises ValueError for a negative ``z`` or ``scale``.
    """
    if not (z >= 0 and scale >= 0):
        raise ValueError(f"z and scale must be >= 0, got {z!r}, {scale!r}")
    return {k: z * scale * math.sqrt(max(float(f), 0.0)) for k, f in factors.items()}


def survivor_factors(sigmas: Mapping[int, float], charged: Mapping[int, float], graph: Mapping[int, Sequence[int]],
                     kept: Mapping[int, float], tau: float, rho: float = 0.0,
                     degrees: Mapping[int, int] | None = None) -> dict[int, float]:
    """The :func:`joint_factors` of the survivors after a recovery (0 where nothing protects a survivor).

    ``sigmas``: survivor -> the std its own shares were drawn with (``graph``: the round's graph, whose degree
    split it); ``charged``: survivor -> the std its accountant charges; ``kept``: survivor -> the variance of its
    own shares still in its upload after the server removed those sent to dropped neighbours.  The shares the
    survivors exchanged among themselves keep the structure of ``Sigma``; own shares kept for a dropped
    neighbour count as independent noise (``extra``), anything else left in an upload is ignored (it only adds).
    ``rho``: ``niss-rho``; up to :func:`colluder_count` of the round's degree of each survivor (or of ``degrees``,
    its roster degree, where larger) collude, among its surviving neighbours.
    """
    alive = set(kept)
    sub = {n: [j for j in graph[n] if j in alive] for n in kept}
    u = {n: float(sigmas[n]) ** 2 / len(graph[n]) for n in kept}
    extra = {n: max(kept[n] - len(sub[n]) * u[n], 0.0) for n in kept}
    try:
        counted = {n: max(len(graph[n]), (degrees or {}).get(n, 0)) for n in kept}
        return joint_factors(charged, sub, tau, u=u, extra=extra, rho=rho, degrees=counted)
    except ValueError:  # a survivor left with no noise at all: Sigma is singular
        return dict.fromkeys(kept, 0.0)


def revealed_kept(sigmas: Mapping[int, float], graph: Mapping[int, Sequence[int]]) -> dict[int, float]:
    """Per survivor, the variance of its own shares left when it reveals every share it sent to a gone neighbour.

    Survivors are the keys of ``sigmas``; each keeps ``sigma_k^2 / d_k`` per surviving neighbour of its ``d_k``:
    the least noise a recovery of that outcome leaves; :func:`recovered_multiplier`'s ``kept`` where a charge is
    priced before the answers are known (a client's ledger, a recovery that failed after some answers).
    """
    alive = set(sigmas)
    return {n: sigmas[n] ** 2 / len(graph[n]) * sum(j in alive for j in graph[n]) for n in sigmas}


def recovered_multiplier(z: float, sigmas: Mapping[int, float], charged: Mapping[int, float],
                         graph: Mapping[int, Sequence[int]], kept: Mapping[int, float], tau: float, rho: float = 0.0,
                         degrees: Mapping[int, int] | None = None) -> float:
    """The least multiplier ``z sqrt(f'_k)`` the survivors' joint view leaves one of them after a recovery.

    :func:`survivor_factors` of the same arguments; ``z``: the multiplier every charged sigma is calibrated for.
    What the server's account stage charges every participant (:mod:`strategies.niss`) and each survivor's ledger
    tops up to before it answers the recovery request (:mod:`client.recovery_ledger`).
    """
    factors = survivor_factors(sigmas, charged, graph, kept, tau, rho=rho, degrees=degrees)
    return min(z * math.sqrt(f) for f in factors.values())


def receiver_downlink_scale(tau: float, sigma_ks: Mapping[int, float], graph: Mapping[int, Sequence[int]]) -> float:
    """The factor on every ``sigma_k`` the published sum needs to keep multiplier ``z`` against a receiving participant.

    ``z / receiver_downlink_multiplier(tau, sigma_ks, z, graph)`` (the multiplier is linear in ``z``): at most 1
    where the sum already keeps ``z`` (0 for ``tau = 0``, which gives no guarantee), ``inf`` with 2 participants
    (each knows every share's residual the other's record hides behind).
    """
    if tau == 0:
        return 0.0
    m = receiver_downlink_multiplier(tau, sigma_ks, 1.0, graph)
    return math.inf if m <= 0 else 1.0 / m


def receiver_downlink_multiplier(tau: float, sigma_ks: Mapping[int, float], z: float,
                                 graph: Mapping[int, Sequence[int]], among: float | None = None) -> float:
    """The published sum's multiplier for the worst-off record against a receiving participant.

    What the model's account charges (:func:`protocols.niss.downlink_multiplier` counts every participant's noise, as the paper
    does).  The sum keeps ``tau^2`` times the variance of every share exchanged; a participant ``i`` receives the
    model and knows the residual ``(1 - s) n`` of each share it received (it holds ``n`` and its own distortion
    ``s``: a ``1 / d_k`` part of each neighbour's ``sigma_k^2``) and of its own shares (it holds ``n``; its
    receivers' ``s`` only scale each coordinate by a factor whose spread the known ``|n|`` sets, which hides
    nothing in the coordinates where ``|n|`` is small): ``tau^2 (sigma_i^2 + sum_{k in N(i)} sigma_k^2 / d_k)``.
    The largest such part is taken off (:func:`protocols.privacy.receiver_variance`); 2 participants leave none.

    ``sigma_ks``: node -> ``sigma_k`` (all at one scale); ``graph``: the round's share graph; ``among``: the
    variance (in ``sigma^2`` units, before ``tau^2``) the sum really keeps after a recovery (None: every share's).
    """
    from protocols.privacy.receiver import receiver_variance
    s2 = {int(n): float(v) ** 2 for n, v in sigma_ks.items()}
    if not s2 or min(s2.values()) <= 0:
        raise ValueError("receiver_downlink_multiplier needs positive sigma_k")
    degree = {n: max(len(graph.get(n, ())), 1) for n in s2}
    known = [s2[i] + math.fsum(s2[k] / degree[k] for k in graph.get(i, ()) if k in s2) for i in s2]
    total = math.fsum(s2.values()) if among is None else float(among)
    return float(tau * z * math.sqrt(receiver_variance(total, known)) / math.sqrt(max(s2.values())))
