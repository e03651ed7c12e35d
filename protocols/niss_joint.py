"""NISS's joint view: what the server learns of one client from all the round's uploads together.

Client k's upload (Algorithm 2) carries ``e_k = sum_{j in N(k)} n_{k->j} - sum_{j in N(k)} s_{kj} n_{j->k}``: its own
shares (one per neighbour, variance ``u_k = sigma_k^2 / d_k``) and each neighbour's negated share times the
distortion ``s ~ N(1, tau^2)``.  With ``E s = 1`` and ``E s^2 = 1 + tau^2`` (the moments of Lemma 1, Eq. (4)) the
uploads' noise has covariance (per coordinate, ``t = 1 + tau^2``)::

    Sigma_kk = d_k u_k + t sum_{j in N(k)} u_j,      Sigma_kj = -(u_k + u_j)  (j in N(k)),  0 otherwise.

The paper's guarantee looks at one upload (``Sigma_kk``, Eqs. (11)-(12)); the server holds them all, and its best
linear unbiased view of client k leaves ``1 / (Sigma^-1)_kk``.  :func:`joint_factors` gives
``f_k = 1 / ((Sigma^-1)_kk sigma_k^2)`` (scale-free: every sigma times c leaves f unchanged) and
:func:`joint_scale` the factor ``c = max(1, 1 / sqrt(min_k f_k))`` on every sigma after which no client's joint
view has less than the variance its accountant charges.  Treating ``s n`` by its second moments is a Gaussian
approximation of the product noise (``s n`` is not Gaussian).  ``tau = 0`` makes ``Sigma`` singular (the sum of the
uploads is noiseless): ``f = 0`` and no scale helps (:func:`joint_scale` raises).

Cost: a complete graph has a closed form (O(n), :func:`_complete_diag_inverse`), any other graph one dense
Cholesky factorisation and inverse (O(n^3), under a second at 1,000 clients).  Pure functions of public values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from scipy.linalg import lapack

__all__ = ["joint_covariance", "joint_factors", "joint_scale", "share_variances", "survivor_factors"]


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


def _dense_diag_inverse(sigma: np.ndarray) -> np.ndarray:
    """``diag(Sigma^-1)`` of a dense symmetric positive definite ``Sigma`` from its Cholesky factor (ValueError if not PD)."""
    chol, info = lapack.dpotrf(sigma, lower=1)
    if info != 0:
        raise ValueError("the uploads' noise covariance is not positive definite")
    inv, info = lapack.dpotri(chol, lower=1)
    if info != 0:
        raise ValueError("the uploads' noise covariance is singular")
    return np.diag(inv).copy()


def joint_factors(sigmas: Mapping[int, float], graph: Mapping[int, Sequence[int]], tau: float,
                  u: Mapping[int, float] | None = None, extra: Mapping[int, float] | None = None) -> dict[int, float]:
    """``f_k = 1 / ((Sigma^-1)_kk sigma_k^2)`` per node of the round's pairing ``graph`` (module docstring).

    Args:
        sigmas: node -> ``sigma_k``, the upload noise std the accountant charges (scale-free: only ratios matter).
        graph: the round's symmetric pairing graph over the uploads the server holds (node -> neighbours).
        tau: the round's distortion std (one for every receiver, :func:`protocols.niss.client_tau`).
        u: node -> variance of each of its shares still in the uploads (default :func:`share_variances`;
            after a recovery, the shares the survivors exchanged among themselves).
        extra: node -> variance of independent noise its upload holds besides (own shares kept after a recovery).

    Returns:
        node -> ``f_k`` (all 0 for ``tau = 0``: the sum of the uploads is noiseless).

    Raises:
        ValueError: a non-symmetric graph, a node without a neighbour, ``tau`` < 0 or not finite.
    """
    if not (math.isfinite(tau) and tau >= 0):
        raise ValueError(f"tau must be finite and >= 0, got {tau!r}")
    u = share_variances(sigmas, graph) if u is None else u
    nodes, complete = _nodes(graph)
    if tau == 0:
        return dict.fromkeys(nodes, 0.0)
    if complete and len(nodes) > 1:
        diag = _complete_diag_inverse(np.array([u[k] for k in nodes]), tau,
                                      np.array([(extra or {}).get(k, 0.0) for k in nodes]))
    else:
        diag = _dense_diag_inverse(joint_covariance(u, graph, tau, extra))
    return {k: 1.0 / (float(d) * float(sigmas[k]) ** 2) for k, d in zip(nodes, diag, strict=True)}


def joint_scale(factors: Mapping[int, float]) -> float:
    """``c = max(1, 1 / sqrt(min_k f_k))`` of :func:`joint_factors`: sigmas times ``c`` keep every joint view >= sigma_k^2.

    One factor for all: ``Sigma`` is a sum over the shares of PSD terms proportional to their sender's
    ``sigma^2``, so as long as every client adds at least ``c`` times its sigma (each refuses less, whatever
    the server tells the others) ``Sigma >= c^2 Sigma_0`` and every ``f_k`` bound holds.  Never below 1 (the
    per-upload calibration, which other views such as Theorem 3's colluding neighbours rely on).
    Raises ValueError when some ``f_k = 0`` (``tau = 0``: no scale protects the joint view then).
    """
    f = min(factors.values())
    if not f > 0:
        raise ValueError("niss-tau = 0: the sum of the uploads is noiseless, so the uploads together carry no "
                         "guarantee and no noise scale gives one")
    return max(1.0, 1.0 / math.sqrt(f))


def survivor_factors(sigmas: Mapping[int, float], charged: Mapping[int, float], graph: Mapping[int, Sequence[int]],
                     kept: Mapping[int, float], tau: float) -> dict[int, float]:
    """The :func:`joint_factors` of the survivors after a recovery (0 where nothing protects a survivor).

    ``sigmas``: survivor -> the std its own shares were drawn with (``graph``: the round's graph, whose degree
    split it); ``charged``: survivor -> the std its accountant charges; ``kept``: survivor -> the variance of its
    own shares still in its upload after the server removed those sent to dropped neighbours.  The shares the
    survivors exchanged among themselves keep the structure of ``Sigma``; own shares kept for a dropped
    neighbour count as independent noise (``extra``), anything else left in an upload is ignored (it only adds).
    """
    alive = set(kept)
    sub = {n: [j for j in graph[n] if j in alive] for n in kept}
    u = {n: float(sigmas[n]) ** 2 / len(graph[n]) for n in kept}
    extra = {n: max(kept[n] - len(sub[n]) * u[n], 0.0) for n in kept}
    try:
        return joint_factors(charged, sub, tau, u=u, extra=extra)
    except ValueError:  # a survivor left with no noise at all: Sigma is singular
        return dict.fromkeys(kept, 0.0)
