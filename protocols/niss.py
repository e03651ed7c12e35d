"""NISS: Noise Information Secretly Sharing (Yang et al., IEEE IoT-J 2022), Flower-free math.

Client k perturbs its weighted update ``p_k * w_k`` with Gaussian noise of variance ``sigma_k**2`` built from
one share per neighbour (``m`` neighbours, variance ``sigma_k**2 / m`` each; Sec. IV-A, :func:`plan_shares`).
The negated share goes to that neighbour, which adds it times its distortion ``s ~ N(1, tau**2)`` (drawn per
coordinate) to its upload (Algorithm 2).  On the server the shares cancel: with ``tau = 0`` the aggregate is
exactly ``sum_k p_k w_k``; otherwise the residual variance is ``sum_k sigma_k**2 tau_k**2`` (Theorem 2,
:func:`exact_aggregate_variance` for any share assignment).  ``tau`` protects against a fraction ``rho`` of a
client's neighbours colluding with the server (Theorem 3, :func:`tau_for_collusion`).  The server's joint view of
all uploads, and the scale on every ``sigma_k`` it needs (:func:`client_plan`'s ``scale``): :mod:`protocols.niss_joint`.

Pure functions of their inputs.  A bundle of shares from one sender to one receiver is described by a 32-byte
seed (:mod:`protocols.prg`), so it travels as ``(count, share_std, seed)`` or as the vectors themselves
(:func:`distorted_sum`); both give bit-identical uploads.  ``sigma_k`` uses the exact RDP multiplier for the run
(:func:`client_sigma`), not Theorem 1.  Choices where the paper is vague or wrong: ``docs/methods/niss.md``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from protocols import prg
from protocols.config import RunConfig

__all__ = ["MIN_TAU", "SHARES_PER_NEIGHBOUR", "SharePlan", "ShareBundle", "aggregation_weights", "sizes_digest",
           "plan_shares", "make_outgoing_bundles", "bundle_shares", "bundles_shares", "sender_noise",
           "receiver_noise", "distorted_sum", "distorted_partials", "distorted_contribution", "distortion_seed",
           "client_upload", "tau_for_collusion", "collusion_variance_ratio", "theorem2_variance",
           "exact_aggregate_variance", "client_multiplier", "client_plan", "unit_sensitivity", "upload_sensitivity",
           "client_sigma", "client_tau", "model_tau", "sizes_tau", "downlink_multiplier"]

# ----------------------------------------------------------------------------------
# Shares
# ----------------------------------------------------------------------------------


#: Shares a client sends to each neighbour per round (the paper's ``v`` = the number of neighbours contacted).
SHARES_PER_NEIGHBOUR = 1


@dataclass(frozen=True)
class SharePlan:
    """How client k splits its DP noise: ``num_shares`` shares (one per neighbour) of std ``share_std``.

    ``num_shares * share_std**2 == sigma_k**2`` (up to float rounding).
    """

    sigma_k: float
    num_shares: int
    share_std: float


@dataclass(frozen=True)
class ShareBundle:
    """``count`` shares from ``sender`` to ``receiver``, all derived from ``seed``.

    This (plus the vector size, known to both) is the whole message: the sender adds
    the shares to its upload, the receiver adds their distorted negation.  The
    protocol sends ``count = SHARES_PER_NEIGHBOUR``; recovery material may name 0.
    """

    sender: int
    receiver: int
    count: int
    share_std: float
    seed: bytes


def plan_shares(sigma_k: float, neighbours: int) -> SharePlan:
    """One share per neighbour: ``v = neighbours`` shares of std ``sigma_k / sqrt(v)`` (Sec. IV-A).

    The count does not depend on ``sigma_k``, so no per-round cost grows with the noise.
    Raises ValueError for a non-positive or non-finite ``sigma_k`` or fewer than one neighbour.
    """
    if not (math.isfinite(sigma_k) and sigma_k > 0):
        raise ValueError(f"sigma_k must be finite and > 0, got {sigma_k!r}")
    if int(neighbours) < 1:
        raise ValueError("a client needs at least one neighbour to share noise with")
    v = SHARES_PER_NEIGHBOUR * int(neighbours)
    return SharePlan(sigma_k=float(sigma_k), num_shares=v, share_std=sigma_k / math.sqrt(v))


def make_outgoing_bundles(
    sender: int,
    plan: SharePlan,
    neighbours: Sequence[int],
    seeds: Mapping[int, bytes],
) -> list[ShareBundle]:
    """The sender's outgoing bundles: one per neighbour, in sorted neighbour order, ``SHARES_PER_NEIGHBOUR`` shares each.

    ``seeds[l]`` is a 32-byte secret known to sender and neighbour ``l``: either a
    pairwise key-agreement seed (then nothing but ``count``/``share_std`` must be
    sent) or a fresh random seed that is sent sealed.  The bundle seed is
    domain-separated by direction, so a symmetric pair seed yields independent
    shares for ``a -> b`` and ``b -> a``.  Raises ValueError when the neighbour list has
    duplicates, contains ``sender`` or does not match ``plan`` (:func:`plan_shares`).
    """
    nbrs = sorted(int(n) for n in neighbours)
    if len(set(nbrs)) != len(nbrs):
        raise ValueError("neighbour list contains duplicates")
    if sender in nbrs:
        raise ValueError("a client cannot be its own neighbour")
    if plan.num_shares != SHARES_PER_NEIGHBOUR * len(nbrs):
        raise ValueError(f"plan has {plan.num_shares} shares for {len(nbrs)} neighbours "
                         f"(expected {SHARES_PER_NEIGHBOUR} per neighbour)")
    return [ShareBundle(sender, n, SHARES_PER_NEIGHBOUR, plan.share_std,
                        prg.derive_subseed(seeds[n], f"niss/bundle/{sender}->{n}")) for n in nbrs]


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


def bundles_shares(bundles: Sequence[ShareBundle], size: int) -> list[np.ndarray]:
    """:func:`bundle_shares` of each bundle, in order and bit-identical, the PRG streams expanded together.

    Bundles of one ``count`` go through one :func:`protocols.prg.gaussian_many` call, which resolves the
    ziggurat's rare rejections of all their streams in one vectorised pass instead of one per bundle.
    """
    out: list[np.ndarray] = [np.zeros((0, size), dtype=np.float64)] * len(bundles)
    by_count: dict[int, list[int]] = {}
    for i, b in enumerate(bundles):
        if b.count:
            by_count.setdefault(b.count, []).append(i)
    for count, idx in by_count.items():
        seeds = [prg.derive_subseed(bundles[i].seed, "niss/shares") for i in idx]
        streams = prg.gaussian_many(seeds, count * size, [bundles[i].share_std for i in idx])
        for i, flat in zip(idx, streams, strict=True):
            out[i] = flat.reshape(count, size)
    return out


def sender_noise(bundles_out: Sequence[ShareBundle], size: int) -> np.ndarray:
    """``sum_i n_i``: the client's own DP noise (variance sigma_k^2 per coordinate)."""
    total = np.zeros(size, dtype=np.float64)
    for shares in bundles_shares(bundles_out, size):
        for share in shares:
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
    law as :func:`distorted_sum` (whose one stream serves the Theorem 2 checks), one stream per sender; each
    sender's result is bit-identical to :func:`distorted_contribution` with its :func:`distortion_seed`, the
    streams expanded together (:func:`protocols.prg.gaussian_many`).
    """
    if not (math.isfinite(tau) and tau >= 0):
        raise ValueError(f"tau must be finite and >= 0, got {tau!r}")
    shares = {int(sender): np.asarray(r, dtype=np.float64).reshape(-1, size) for sender, r in groups}
    out = {s: r.sum(axis=0) for s, r in shares.items() if tau == 0 or len(r) == 0}
    by_len: dict[int, list[int]] = {}
    for s, r in shares.items():
        if s not in out:
            by_len.setdefault(r.size, []).append(s)
    for n, senders in by_len.items():
        for s, z in zip(senders, prg.gaussian_many([distortion_seed(rng, s) for s in senders], n), strict=True):
            r = shares[s]
            z = z.reshape(r.shape)  # in place, the same operations as ((1.0 + tau * z) * r).sum(axis=0)
            np.multiply(z, tau, out=z)
            np.add(z, 1.0, out=z)
            np.multiply(z, r, out=z)
            # a sum over one row is 0.0 + row (numpy reduces a (1, size) array column by column: slow)
            out[s] = np.add(z[0], 0.0, out=z[0]) if len(z) == 1 else z.sum(axis=0)
    return {s: out[s] for s in shares}


def client_upload(model: np.ndarray, update: np.ndarray, weight: float, own_noise: np.ndarray,
                  received_noise: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """NISS upload ``p_k w_k + sum_i (n_i + s_i r_i)``, ``w_k = model + update`` (float64, flat; ``mask``: a self-mask).

    Computed as ``p_k model + (p_k update + noise)``: the update (the only data-dependent part) meets its noise
    before the received model, of magnitudes the server chooses, is added, so float64 rounds only the noised update
    at the model's spacing (post-processing); ``p_k (model + update)`` would round the bare update there, by up to
    twice its norm.  Raises ValueError when a vector's shape differs from the flattened ``model``.
    """
    g = np.asarray(model, dtype=np.float64).ravel()
    noise = [own_noise, received_noise, *([] if mask is None else [mask])]
    noised = weight * np.asarray(update, dtype=np.float64).ravel()
    if any(v.shape != g.shape for v in (noised, *noise)):
        raise ValueError("update and noise vectors must match the flattened model")
    for v in noise:
        noised += v
    return weight * g + noised


# ----------------------------------------------------------------------------------
# Theorems 2 and 3
# ----------------------------------------------------------------------------------


#: Smallest ``tau > 0`` (:mod:`protocols.niss_joint`): ``Sigma`` nears a singular matrix as ``tau -> 0`` and the
#: float64 factors err by about ``n eps / tau^2`` (vs 50 digits: 3e-10 at 1e-3 on 64 clients; at 1e-8 on 4 clients
#: ``f`` 30% too large, a view keeping 0.89 of the charged std).  Auto tau >= 1/sqrt(clients per round) stays above.
MIN_TAU = 1e-3


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

    The sum of m uploads keeps noise variance ``tau^2 sum_k sigma_k^2`` (Theorem 2) with ``sigma_k = z Delta f_k``.
    Client level (``Delta f_k = clip / m`` for all k) that is std ``tau z clip / sqrt(m)`` over the mean's
    sensitivity ``clip / m``: noise multiplier ``tau z sqrt(m)``, i.e. ``z`` (the uploads' own) for
    ``tau = 1/sqrt(m)``.  Record level the rule still holds: a record of client k moves the sum by
    ``Delta f_k = p_k record_sensitivity(n_k)`` and the multiplier is ``tau z sqrt(sum_j Delta f_j^2) / Delta f_k``,
    which is ``tau z sqrt(m)`` whenever the ``Delta f_k`` are equal (data-size weights and one full-batch step,
    :func:`aggregation_weights`); where they are not (multi-step local training) the worst-off record would get
    less, so clients that get the round's sizes use :func:`sizes_tau` instead, and the server accounts the
    multiplier really obtained (:func:`downlink_multiplier`).  A record-level tau cannot
    be smaller: the record-level noise is already the smallest that protects the upload, and the model must not be
    published with less protection than the uploads (tau = 0 publishes the exact FedAvg model).
    """
    return 1.0 / math.sqrt(max(int(clients), 1))


def aggregation_weights(cfg: RunConfig, participants: Sequence[int], sizes: Mapping[int, int]) -> dict[int, float]:
    """``p_k`` of every participant: ``|D_k| / sum_j |D_j|`` at record level (the paper's "usually"), ``1/m`` at client level.

    Record level, data-size weights make every record's sensitivity on the published sum the same,
    ``p_k 2 C lr / n_k = 2 C lr / N`` for one full-batch step, so every ``sigma_k`` is equal and the sum keeps
    the central noise whatever the partition.  With uniform weights a client with few records had a large
    ``sigma_k`` that the distortion tau must keep in the model to protect it.  Client level keeps ``1/m`` (every
    client's whole update is bounded by ``clip``: size weights would give a large client a larger sensitivity).

    Both ends compute the weights from the round's public view: the participants (bound into every pair and
    relay key, :func:`client.pairwise_phase.check_view`) and the sizes they reported with their keys (bound into
    the relay keys by the client, who checks its own entry).  A server that showed one client other sizes than
    the rest to shrink its weight -- and with it the noise that hides the negated shares it holds -- would leave
    it with relay keys nobody else derives.  Raises ValueError when a participant has no size (record level).
    """
    parts = [int(n) for n in participants]
    if not parts:
        raise ValueError("aggregation_weights needs at least one participant")
    if cfg.privacy_unit == "client":
        return {n: 1.0 / len(parts) for n in parts}
    missing = [n for n in parts if n not in sizes]
    if missing:
        raise ValueError(f"no dataset size for participant(s) {missing}: record-level NISS weights need every size")
    if any(int(sizes[n]) < 1 for n in parts):
        raise ValueError("dataset sizes must be >= 1")
    total = math.fsum(int(sizes[n]) for n in parts)
    return {n: int(sizes[n]) / total for n in parts}


def sizes_digest(sizes: Mapping[int, int]) -> bytes:
    """SHA-256 of the round's (node, size) list in node order: the part of the view the weights come from."""
    h = hashlib.sha256(b"cancelfl/niss-sizes/v1")
    for n in sorted(sizes):
        h.update(int(n).to_bytes(8, "big") + int(sizes[n]).to_bytes(8, "big"))
    return h.digest()


def sizes_tau(cfg: RunConfig, sizes: Mapping[int, int]) -> float:
    """``max_k Delta f_k / sqrt(sum_j Delta f_j^2)`` over the round's participants (``sizes``: node -> ``|D_k|``).

    ``Delta f_k = p_k * unit_sensitivity(n_k)`` with :func:`aggregation_weights`: the distortion that gives the
    worst-off record of the published sum the uploads' multiplier ``z`` (:func:`downlink_multiplier`).  It is
    ``1/sqrt(m)`` (:func:`model_tau`) whenever the ``Delta f_k`` are equal: at client level, and at record level
    for one full-batch step (``2 C lr / N`` for every client); larger for multi-step local training.
    """
    if not sizes:
        raise ValueError("sizes_tau needs at least one dataset size")
    weights = aggregation_weights(cfg, list(sizes), sizes)
    d = [weights[n] * unit_sensitivity(cfg, int(s)) for n, s in sizes.items()]
    return max(d) / math.sqrt(math.fsum(x * x for x in d))


def client_tau(cfg: RunConfig, sizes: Mapping[int, int] | None = None) -> float:
    """A client's distortion std: ``niss-tau`` if >= 0, else the default below.

    The default is the larger of Theorem 3's minimum for ``niss-rho`` and the distortion that protects the
    published model as much as the uploads: :func:`sizes_tau` of the round's participants' dataset ``sizes``
    (public, sent by the server), never below :func:`model_tau` of the clients per round (so no list of sizes
    the server sends can lower it).  See :func:`model_tau` for why
    the rule holds at record level.
    """
    if cfg.niss_tau >= 0:
        return float(cfg.niss_tau)
    protect_model = max(model_tau(cfg.clients_per_round), sizes_tau(cfg, sizes) if sizes else 0.0)
    return max(tau_for_collusion(cfg.niss_rho), protect_model)


def unit_sensitivity(cfg: RunConfig, num_examples: int) -> float:
    """L2 sensitivity of the client's model ``w_k`` (before the weight ``p_k``) per the run's privacy unit.

    ``record``: :func:`protocols.privacy.record_sensitivity` of the per-example-clipped local training
    (``2 C lr / n_k`` for one full-batch step); ``client``: ``clip`` (the clipped update).
    """
    if cfg.privacy_unit == "client":
        return float(cfg.clip)
    from protocols.privacy import record_sensitivity  # on use: the wire and recovery modules import this one

    return record_sensitivity(cfg, int(num_examples))


def upload_sensitivity(cfg: RunConfig, weight: float, num_examples: int) -> float:
    """``Delta f_k``: L2 sensitivity of the weighted upload ``p_k w_k`` (:func:`unit_sensitivity` times ``p_k``)."""
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"aggregation weight must be finite and > 0, got {weight!r}")
    return weight * unit_sensitivity(cfg, num_examples)


def client_multiplier(cfg: RunConfig, releases: int | None = None) -> float:
    """``z``: the exact RDP multiplier for which ``releases`` Gaussian releases are (epsilon, delta)-DP.

    ``releases``: the most rounds the public schedule samples any client in
    (:func:`protocols.schedule.roster_releases`, computed alike by the server and every client); None:
    ``num-rounds``.  No sampling amplification: the sample is public.
    """
    from protocols.privacy import noise_multiplier

    return noise_multiplier(cfg.epsilon, cfg.delta, cfg.num_rounds if releases is None else int(releases))


def client_sigma(cfg: RunConfig, weight: float, num_examples: int, releases: int | None = None) -> float:
    """``sigma_k = z * Delta f_k`` with ``z`` = :func:`client_multiplier` of ``releases`` (None: ``num-rounds``).

    Computed by the client from its own run config and dataset size (never from the server's figures).
    """
    return client_multiplier(cfg, releases) * upload_sensitivity(cfg, weight, num_examples)


def client_plan(cfg: RunConfig, weight: float, num_examples: int, neighbours: int, scale: float = 1.0,
                releases: int | None = None) -> SharePlan:
    """:func:`plan_shares` of :func:`client_sigma` times ``scale``: everything a client needs to split its noise.

    ``scale``: the round's joint-view scale (:func:`protocols.floor.niss_floor`); ``releases``: :func:`client_sigma`'s.
    """
    return plan_shares(client_sigma(cfg, weight, num_examples, releases) * scale, neighbours)


def downlink_multiplier(tau: float, sigma_ks: Sequence[float], z: float) -> float:
    """Noise multiplier of the published sum for the worst-off record: ``tau z sqrt(sum_j sigma_j^2) / max_k sigma_k``.

    The sum keeps Theorem 2's std ``tau sqrt(sum_j sigma_j^2)`` (equal tau); a record of client k moves it by
    ``Delta f_k = sigma_k / z``.  Equal sigmas give ``tau z sqrt(m)`` (:func:`model_tau`).
    """
    s = np.asarray(sigma_ks, dtype=np.float64)
    if s.size == 0 or not np.all(s > 0):
        raise ValueError("downlink_multiplier needs positive sigma_k")
    return float(tau * z * math.sqrt(float(np.sum(s**2))) / float(np.max(s)))

