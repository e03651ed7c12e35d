"""NISS: Noise Information Secretly Sharing (Yang et al., IEEE IoT-J 2022), Flower-free math.

Each client k perturbs its weighted update ``p_k * w_k`` with Gaussian DP noise of
variance ``sigma_k**2``, but builds that noise out of ``v_k`` small *unit shares*
``n_i`` (variance ``sigma**2`` each, ``v_k = sigma_k**2 / sigma**2``).  The negated
copy ``-n_i`` of every share goes to a neighbour, which adds it (multiplied by its own
distortion ``s ~ N(1, tau**2)``) to its upload.  On the server the shares cancel:
with ``tau = 0`` the aggregate is exactly ``sum_k p_k w_k`` (Theorem 2 gives the
residual variance ``sum_k sigma_k**2 tau_k**2``), while every single upload still
carries noise of variance ``2 sigma_k**2``.  ``tau`` protects a client against a
fraction ``rho`` of neighbours colluding with the server (Theorem 3).

Everything here is a pure function of its inputs.  A bundle of ``count`` shares
from one sender to one receiver is fully described by a 32-byte seed
(``protocols.prg``), so the message can be ``(count, share_std, seed)`` sealed with
``protocols.relay_crypto`` (the ``seed`` wire encoding) -- or the share vectors
themselves (the ``vector`` encoding, see :func:`distorted_sum`); both give
bit-identical uploads for the same seeds.

Interpretations of the paper (see also the module report):

* Algorithm 2 writes ``n_i <- N(0, sigma_k^2 I_h)``; the text (Sec. IV-B, Lemma 1,
  Theorem 2) makes clear each share is a *unit* noise ``N(0, sigma^2)``.  We follow
  the text; otherwise the total variance would be ``v sigma_k^2``, not ``sigma_k^2``.
* ``v = sigma_k^2 / sigma^2`` is generally not an integer.  We round *up* and rescale
  each share to variance ``sigma_k^2 / v`` (<= sigma^2), so the client's own noise has
  variance exactly ``sigma_k^2`` (the DP requirement) and Theorem 2 still holds
  exactly (it only depends on the total variance a client sends out).
* The paper's ClientShare sends share i to the i-th of ``v`` random clients (one
  share per neighbour).  With a fixed neighbour list of size ``m < v`` we send
  ``floor(v/m)`` or ``ceil(v/m)`` shares to every neighbour (balanced round robin;
  which neighbours get the extra share is chosen pseudo-randomly from a seed).  With
  ``m >= v`` this reduces to the paper's "random set of v clients".  Each received
  share is distorted by its *own* independent ``s``, exactly as in Algorithm 2.
* Algorithm 2 pairs sending and receiving ("send -n_i to u_i, receive r_i from
  u_i").  We decouple the directions: a client processes whatever bundles it
  receives.  Theorem 2 (``V = sum_k sigma_k^2 tau_k^2``) assumes every client receives
  as much share variance as it sends; :func:`exact_aggregate_variance` gives the exact
  residual ``sum_shares share_var * tau_receiver^2`` for any assignment, and equals
  Theorem 2 when all ``tau`` are equal or the exchange is balanced.
* ``s_i`` is drawn independently per coordinate (a vector ``N(1, tau^2 I_h)``): the
  paper's analysis is per dimension ("the noise offset is conducted for each
  dimension independently").
* The paper's Theorem 1 (classic Gaussian mechanism) only holds for ``epsilon < 1``,
  yet its experiments use ``epsilon = 5..15``.  :func:`client_sigma` calibrates with
  the RDP accountant over the whole run instead (:func:`protocols.privacy.noise_multiplier`),
  valid for every ``epsilon > 0``; the mechanisms themselves live in :mod:`protocols.privacy`.
* Caveat (not fixed, reported): Theorem 3 only matches the *variance* of the noise a
  colluding server cannot remove to ``sigma_k^2``; that residual is a sum of
  Gaussian-times-Gaussian terms, not a Gaussian, so the (epsilon, delta) claim is
  heuristic.  Likewise, shares sent to a client that drops out are not cancelled.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from protocols import prg
from protocols.config import RunConfig
from protocols.privacy import noise_multiplier

__all__ = [
    "SharePlan",
    "ShareBundle",
    "plan_shares",
    "assign_shares",
    "make_outgoing_bundles",
    "bundle_shares",
    "sender_noise",
    "receiver_noise",
    "distorted_sum",
    "distorted_partials",
    "distorted_contribution",
    "distortion_seed",
    "client_upload",
    "tau_for_collusion",
    "collusion_variance_ratio",
    "theorem2_variance",
    "exact_aggregate_variance",
]

# ----------------------------------------------------------------------------------
# Shares
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SharePlan:
    """How client k splits its DP noise: ``num_shares`` shares of std ``share_std``.

    ``num_shares * share_std**2 == sigma_k**2`` (up to float rounding).
    """

    sigma_k: float
    num_shares: int
    share_std: float


@dataclass(frozen=True)
class ShareBundle:
    """``count`` unit shares from ``sender`` to ``receiver``, all derived from ``seed``.

    This (plus the vector size, known to both) is the whole message: the sender adds
    the shares to its upload, the receiver adds their distorted negation.
    """

    sender: int
    receiver: int
    count: int
    share_std: float
    seed: bytes


def plan_shares(sigma_k: float, unit_std: float, *, max_shares: int = 100_000) -> SharePlan:
    """Number of unit shares ``v = ceil(sigma_k^2 / sigma^2)`` and their rescaled std.

    Rounding up (and shrinking each share to ``sigma_k / sqrt(v)``) keeps the total
    own-noise variance exactly ``sigma_k^2``.  ``max_shares`` guards against a unit
    variance chosen far too small (cost is O(v * model size) per client).
    """
    if not (math.isfinite(sigma_k) and sigma_k > 0):
        raise ValueError(f"sigma_k must be finite and > 0, got {sigma_k!r}")
    if not (math.isfinite(unit_std) and unit_std > 0):
        raise ValueError(f"unit_std must be finite and > 0, got {unit_std!r}")
    ratio = (sigma_k / unit_std) ** 2
    # Tolerate float noise so that e.g. 4.000000000001 does not become 5 shares.
    v = max(1, math.ceil(ratio * (1.0 - 1e-12)))
    if v > max_shares:
        raise ValueError(
            f"sigma_k^2/sigma^2 = {ratio:.3g} shares exceeds max_shares={max_shares}; choose a larger unit noise std"
        )
    return SharePlan(sigma_k=float(sigma_k), num_shares=v, share_std=sigma_k / math.sqrt(v))


def assign_shares(num_shares: int, neighbours: Sequence[int], *, seed: bytes) -> dict[int, int]:
    """How many of a client's ``num_shares`` shares go to each neighbour.

    Balanced: every neighbour gets ``floor(v/m)`` shares and ``v mod m`` of them,
    picked by a seeded pseudo-random permutation, get one more.  For ``v <= m``
    this is the paper's "random set of v clients, one share each".  Neighbours
    with zero shares are omitted.  Deterministic in (num_shares, set of
    neighbours, seed).
    """
    if num_shares < 0:
        raise ValueError("num_shares must be >= 0")
    nbrs = sorted(set(int(n) for n in neighbours))
    if len(nbrs) != len(neighbours):
        raise ValueError("neighbour list contains duplicates")
    if num_shares == 0:
        return {}
    if not nbrs:
        raise ValueError("a client needs at least one neighbour to share noise with")
    m = len(nbrs)
    base, extra = divmod(num_shares, m)
    order = np.argsort(prg.uniform(prg.derive_subseed(seed, "niss/assign"), m), kind="stable")
    counts = {n: base for n in nbrs}
    for idx in order[:extra]:
        counts[nbrs[int(idx)]] += 1
    return {n: c for n, c in counts.items() if c > 0}


def make_outgoing_bundles(
    sender: int,
    plan: SharePlan,
    neighbours: Sequence[int],
    seeds: Mapping[int, bytes],
    *,
    assign_seed: bytes,
) -> list[ShareBundle]:
    """The sender's outgoing bundles, one per neighbour that receives >= 1 share.

    ``seeds[l]`` is a 32-byte secret known to sender and neighbour ``l``: either a
    pairwise key-agreement seed (then nothing but ``count``/``share_std`` must be
    sent) or a fresh random seed that is sent sealed.  The bundle seed is
    domain-separated by direction, so a symmetric pair seed yields independent
    shares for ``a -> b`` and ``b -> a``.
    """
    counts = assign_shares(plan.num_shares, neighbours, seed=assign_seed)
    bundles = []
    for receiver, count in counts.items():
        if receiver == sender:
            raise ValueError("a client cannot be its own neighbour")
        seed = prg.derive_subseed(seeds[receiver], f"niss/bundle/{sender}->{receiver}")
        bundles.append(ShareBundle(sender, receiver, count, plan.share_std, seed))
    return bundles


def bundle_shares(bundle: ShareBundle, size: int) -> np.ndarray:
    """The bundle's ``count`` shares ``n_j`` as a ``(count, size)`` float64 array.

    One PRG stream per bundle (sub-seed ``niss/shares``), row ``j`` = share ``j``,
    each N(0, share_std^2 I).  One stream instead of one per share: the PRG's
    per-call cost dominates for model-sized vectors, and prefixes are stable
    (``prg.gaussian(s, n) == prg.gaussian(s, m)[:n]``).
    """
    if bundle.count == 0:
        return np.zeros((0, size), dtype=np.float64)
    flat = prg.gaussian(prg.derive_subseed(bundle.seed, "niss/shares"), bundle.count * size, bundle.share_std)
    return flat.reshape(bundle.count, size)


def sender_noise(bundles_out: Sequence[ShareBundle], size: int) -> np.ndarray:
    """``sum_i n_i``: the client's own DP noise (variance sigma_k^2 per coordinate)."""
    total = np.zeros(size, dtype=np.float64)
    for b in bundles_out:
        for share in bundle_shares(b, size):
            total += share
    return total


def receiver_noise(
    bundles_in: Sequence[ShareBundle],
    size: int,
    tau: float,
    rng: np.random.Generator | bytes,
) -> np.ndarray:
    """``sum_i s_i * r_i`` with ``r_i = -n_i`` and ``s_i ~ N(1, tau^2 I)`` per coordinate.

    ``rng`` must be the receiver's *private* randomness (a numpy Generator or a
    32-byte seed for ``protocols.prg``): the whole point of ``s`` is that nobody
    else, in particular the sender, knows it.  ``tau == 0`` gives ``s = 1`` exactly.
    """
    negated = (-share for b in bundles_in for share in bundle_shares(b, size))
    return distorted_sum(negated, size, tau, rng)


def distorted_sum(
    negated_shares: Iterable[np.ndarray],
    size: int,
    tau: float,
    rng: np.random.Generator | bytes,
) -> np.ndarray:
    """``sum_i s_i * r_i`` for explicitly received negated shares ``r_i`` (in the given order).

    Same distortion as :func:`receiver_noise` (row ``i`` of one N(0, I) stream from
    sub-seed ``niss/s`` gives ``s_i = 1 + tau * z_i``), so a receiver that got the
    share *vectors* (the ``vector`` wire encoding) and one that expanded them from
    a seed (the ``seed`` encoding) compute bit-identical results from the same
    private ``rng`` seed.  Holds all received shares in memory at once.
    """
    if not (math.isfinite(tau) and tau >= 0):
        raise ValueError(f"tau must be finite and >= 0, got {tau!r}")
    shares = [np.asarray(r, dtype=np.float64) for r in negated_shares]
    for r in shares:
        if r.shape != (size,):
            raise ValueError(f"received share has shape {r.shape}, expected ({size},)")
    total = np.zeros(size, dtype=np.float64)
    if tau > 0 and shares:
        n = len(shares)
        if isinstance(rng, bytes):
            z = prg.gaussian(prg.derive_subseed(rng, "niss/s"), n * size).reshape(n, size)
        else:
            z = rng.standard_normal((n, size))
        for r, zk in zip(shares, z, strict=True):
            total += (1.0 + tau * zk) * r
    else:
        for r in shares:
            total += r
    return total


def distortion_seed(private: bytes, sender: int) -> bytes:
    """The receiver's distortion seed for the shares of ``sender`` (one sub-seed of its private seed per sender).

    Per-sender streams let a receiver reveal the distortion of one dropped sender's shares (dropout recovery,
    :mod:`client.recovery`) without revealing anything about the other senders' shares.
    """
    return prg.derive_subseed(private, f"niss/s/{int(sender)}")


def distorted_contribution(negated: np.ndarray, tau: float, dseed: bytes) -> np.ndarray:
    """``sum_i s_i * r_i`` over one sender's negated shares ``(count, size)``, ``s_i = 1 + tau * z_i``.

    ``z`` is row ``i`` of the N(0, I) stream of ``dseed`` (:func:`distortion_seed`); ``tau = 0`` gives the plain sum.
    """
    if not (math.isfinite(tau) and tau >= 0):
        raise ValueError(f"tau must be finite and >= 0, got {tau!r}")
    r = np.asarray(negated, dtype=np.float64)
    if r.ndim != 2:
        raise ValueError(f"negated shares must be (count, size), got shape {r.shape}")
    if tau == 0 or len(r) == 0:
        return r.sum(axis=0)
    z = prg.gaussian(dseed, r.size).reshape(r.shape)
    return ((1.0 + tau * z) * r).sum(axis=0)


def distorted_partials(
    groups: Sequence[tuple[int, np.ndarray]],
    size: int,
    tau: float,
    rng: bytes,
) -> dict[int, np.ndarray]:
    """Per sender, ``sum_{i from sender} s_i * r_i`` with the sender's own distortion stream (the client's upload).

    ``groups`` lists ``(sender, negated shares (count, size))``; ``rng`` is the receiver's private seed.  Same
    law as :func:`distorted_sum` (whose one stream serves the Theorem 2 checks), one stream per sender.
    """
    return {int(sender): distorted_contribution(np.asarray(shares, dtype=np.float64).reshape(-1, size), tau,
                                                distortion_seed(rng, sender))
            for sender, shares in groups}

def client_upload(
    params: np.ndarray,
    weight: float,
    own_noise: np.ndarray,
    received_noise: np.ndarray,
) -> np.ndarray:
    """NISS upload ``p_k * w + sum_i (n_i + s_i r_i)`` (float64, flat)."""
    w = np.asarray(params, dtype=np.float64).ravel()
    if own_noise.shape != w.shape or received_noise.shape != w.shape:
        raise ValueError("noise vectors must match the flattened parameter vector")
    return weight * w + own_noise + received_noise


# ----------------------------------------------------------------------------------
# Theorems 2 and 3
# ----------------------------------------------------------------------------------


def tau_for_collusion(rho: float) -> float:
    """Smallest distortion std ``tau`` from Theorem 3: ``tau^2 = max(2 rho - 1, 0)``.

    ``rho`` is the fraction of a client's neighbours assumed to collude with the
    server.  ``rho <= 1/2`` needs no distortion; ``rho = 1`` gives ``tau = 1``, i.e.
    no noise reduction at all (the paper's Remark).
    """
    if not (0.0 <= rho <= 1.0):
        raise ValueError(f"rho must lie in [0, 1], got {rho!r}")
    return math.sqrt(max(2.0 * rho - 1.0, 0.0))


def collusion_variance_ratio(rho: float, tau: float) -> float:
    """Left side of the paper's Eq. (12) divided by sigma_k^2.

    ``(1 - rho)(tau^2 + 2) + tau^2 rho``: variance of the noise the colluding server
    cannot remove, in units of sigma_k^2 (Theorem 3 requires >= 1).
    """
    return (1.0 - rho) * (tau**2 + 2.0) + tau**2 * rho


def theorem2_variance(sigma_ks: Sequence[float], taus: Sequence[float]) -> float:
    """Theorem 2: per-coordinate variance of the aggregated noise ``sum_k sigma_k^2 tau_k^2``."""
    s = np.asarray(sigma_ks, dtype=np.float64)
    t = np.asarray(taus, dtype=np.float64)
    if s.shape != t.shape:
        raise ValueError("sigma_ks and taus must have the same length")
    return float(np.sum(s**2 * t**2))


def exact_aggregate_variance(bundles: Sequence[ShareBundle], taus: Mapping[int, float]) -> float:
    """Exact per-coordinate aggregate-noise variance for a concrete share assignment.

    Each share contributes ``(1 - s) n`` with ``Var = tau_receiver^2 * share_std^2``
    (Lemma 1), so ``V = sum_bundles count * share_std^2 * tau_receiver^2``.
    """
    return float(sum(b.count * b.share_std**2 * taus[b.receiver] ** 2 for b in bundles))


# --------------------------------------------------------- per-client calibration (both sides)
def model_tau(clients: int) -> float:
    """The distortion std that gives the published model the uploads' guarantee: ``1 / sqrt(m)``.

    The sum of m uploads keeps noise std ``tau z clip / sqrt(m)`` over the mean's sensitivity ``clip / m``,
    i.e. noise multiplier ``tau z sqrt(m)``: with ``tau = 1/sqrt(m)`` it is ``z``, the uploads' own multiplier,
    so the model is (epsilon, delta)-DP over the run at the client level (the CDP noise level).
    """
    return 1.0 / math.sqrt(max(int(clients), 1))


def client_tau(cfg: RunConfig) -> float:
    """A client's distortion std: ``niss-tau`` if >= 0, else the default below.

    The default is the larger of Theorem 3's minimum for ``niss-rho`` and :func:`model_tau` of the clients
    per round, so the published model is protected too.
    """
    if cfg.niss_tau >= 0:
        return float(cfg.niss_tau)
    return max(tau_for_collusion(cfg.niss_rho), model_tau(cfg.clients_per_round))


def client_sigma(cfg: RunConfig, weight: float) -> float:
    """``sigma_k = z * p_k * clip`` (L2 sensitivity of the weighted clipped update is ``p_k * clip``)."""
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"aggregation weight must be finite and > 0, got {weight!r}")
    return noise_multiplier(cfg.epsilon, cfg.delta, cfg.num_rounds) * weight * cfg.clip
