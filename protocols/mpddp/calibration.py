"""Noise calibration: sigma_eta, sigma_Delta from (epsilon, delta, K, n) by Theorems 10, 11 (Eq. 23).

Eq. 23: ``epsilon >= theta/2 + sqrt(theta)`` and ``(epsilon - theta/2)^2 >= 2 log(2 / (delta sqrt(2 pi))) theta``;
the feasible set is ``[0, theta_max]`` (:func:`max_theta`).  The privacy-loss variance theta (GOPA):

* complete graph (Theorem 10): ``1/(sigma_eta^2 K) + 1/(sigma_Delta^2 K)`` (squared: the printed form is not
  an inverse variance);
* random n-out graph (Theorem 11): ``1/(sigma_eta^2 K) + (1/(floor((n-1)/3) - 1) + (12 + 6 log K)/K) /
  sigma_Delta^2``, valid only for ``K >= 81`` and the theorem's bounds on ``n``; it gives (epsilon, 3 delta),
  so it is applied at ``delta / 3``; ``n >= K - 1`` uses Theorem 10.

``eta_share`` is the fraction of ``theta_max`` spent on the eta term.  The sensitivity scales both sigmas and is an
assumption, as in the paper.

Given the server's secret R (:func:`mask_reference`, :func:`secret_factor`, :func:`given_r_topup`): Eq. (22) releases
``R o (mean_b w_b (g^_b - r^T Psi_b + v Phi_b) + noise)``; divided by R, a record's effect is its weighted
``g^_b - r^T Psi_b + v Phi_b`` (Theorem 1), which the clip of ``g^_b`` alone does not bound.  Clients clip
``||g^_b|| + rho sigma_max(Psi_b) + rho^2 ||Phi_b||`` with ``rho`` from W-hat (:func:`mask_reference`), so a record
moves the R-divided release by at most ``kappa`` times the record sensitivity, ``kappa = max(1, (||r|| / rho)^2)``
(:func:`secret_factor`, known to the server only), and the server adds the Gaussian the clients' noise lacks.
Ablations (Section 6.3) from a noise multiplier z (:func:`theta_for_noise_multiplier`): :func:`calibrate_ldp`
(MP-DP-Naive, ``sigma = z S``) and :func:`calibrate_cdp` (MP-CDP, ``sigma = z S / K``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protocols.privacy.calibration import noise_multiplier
from protocols.privacy.events import DpEvent, GaussianEvent
from protocols.privacy.mechanisms import check_eps_delta
from protocols.privacy.sensitivity import local_sgd_sensitivity

__all__ = [
    "Calibration",
    "calibrate",
    "calibrate_cdp",
    "calibrate_ldp",
    "check_n_out_conditions",
    "MASK_SHARE",
    "given_r_topup",
    "mask_reference",
    "secret_factor",
    "eq23_epsilon",
    "max_theta",
    "mp_record_sensitivity",
    "n_out_delta_coefficient",
    "n_out_shortfall",
    "round_event",
    "round_multiplier",
    "theta_for_noise_multiplier",
    "satisfies_eq23",
    "sigmas_for_theta",
    "theta_after",
    "theta_complete",
    "theta_n_out",
]


def _log_term(delta: float) -> float:
    """log(2 / (delta sqrt(2 pi))) from Eq. (23)."""
    return math.log(2.0 / (delta * math.sqrt(2.0 * math.pi)))


def max_theta(epsilon: float, delta: float) -> float:
    """Largest theta satisfying Eq. (23) (closed form; the feasible set is [0, max_theta])."""
    check_eps_delta(epsilon, delta)
    theta_1 = (math.sqrt(1.0 + 2.0 * epsilon) - 1.0) ** 2  # theta/2 + sqrt(theta) <= epsilon
    lg = max(_log_term(delta), 0.0)  # for delta > 2/sqrt(2 pi) the second condition is epsilon >= theta/2
    theta_2 = (math.sqrt(2.0 * lg + 2.0 * epsilon) - math.sqrt(2.0 * lg)) ** 2
    return min(theta_1, theta_2)


def eq23_epsilon(theta: float, delta: float) -> float:
    """Smallest epsilon meeting Eq. (23) for a given theta and delta (closed-form inverse of `max_theta`).

    Both conditions read epsilon >= theta/2 + c sqrt(theta), with c = 1 and c = sqrt(2 log(2/(delta sqrt(2 pi)))).
    """
    if not (math.isfinite(theta) and theta >= 0):
        raise ValueError(f"theta must be finite and >= 0, got {theta}")
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    c = max(1.0, math.sqrt(2.0 * max(_log_term(delta), 0.0)))
    return theta / 2.0 + c * math.sqrt(theta)


def sigmas_for_theta(
    theta: float, num_clients: int, *, eta_share: float = 0.9, sensitivity: float = 1.0
) -> tuple[float, float]:
    """(sigma_eta, sigma_Delta) whose complete-graph theta (Theorem 10, squared form) equals `theta`.

    For callers that fix the per-round privacy-loss variance theta themselves (e.g. from a multi-round
    accountant) instead of from a per-round (epsilon, delta) via Eq. (23). eta_share as in `calibrate`.
    """
    if not (math.isfinite(theta) and theta > 0):
        raise ValueError(f"theta must be finite and > 0, got {theta}")
    if isinstance(num_clients, bool) or int(num_clients) != num_clients or num_clients < 2:
        raise ValueError(f"num_clients must be an integer >= 2, got {num_clients}")
    if not (0.0 < eta_share < 1.0):
        raise ValueError("eta_share must be in (0, 1): both noise terms are needed by Theorem 10")
    if not (math.isfinite(sensitivity) and sensitivity > 0):
        raise ValueError("sensitivity must be positive")
    sigma_eta = 1.0 / math.sqrt(num_clients * eta_share * theta)
    sigma_delta = 1.0 / math.sqrt(num_clients * (1.0 - eta_share) * theta)
    return sensitivity * sigma_eta, sensitivity * sigma_delta


def satisfies_eq23(epsilon: float, delta: float, theta: float, *, rtol: float = 1e-12) -> bool:
    """Direct check of Eq. (23) (with a tiny relative tolerance for round-off)."""
    check_eps_delta(epsilon, delta)
    slack = rtol * max(1.0, epsilon)
    if epsilon + slack < theta / 2.0 + math.sqrt(theta):
        return False
    gap = epsilon - theta / 2.0
    return gap >= -slack and gap * abs(gap) + slack >= 2.0 * _log_term(delta) * theta


def theta_complete(sigma_eta: float, sigma_delta: float, num_clients: int) -> float:
    """Theorem 10 theta (complete graph), squared-sigma form (see module docstring)."""
    return 1.0 / (sigma_eta**2 * num_clients) + 1.0 / (sigma_delta**2 * num_clients)


def n_out_delta_coefficient(num_clients: int, n_out: int) -> float:
    """Coefficient of sigma_Delta^-2 in Theorem 11: 1/(floor((n-1)/3) - 1) + (12 + 6 log K)/K."""
    base = (n_out - 1) // 3 - 1
    if base < 1:
        raise ValueError(f"Theorem 11 needs floor((n-1)/3) - 1 >= 1, i.e. n >= 7 (got n={n_out})")
    return 1.0 / base + (12.0 + 6.0 * math.log(num_clients)) / num_clients


def theta_n_out(sigma_eta: float, sigma_delta: float, num_clients: int, n_out: int) -> float:
    """Theorem 11 theta (random n-out graph)."""
    return 1.0 / (sigma_eta**2 * num_clients) + n_out_delta_coefficient(num_clients, n_out) / sigma_delta**2


def check_n_out_conditions(num_clients: int, n_out: int, delta_theorem: float) -> None:
    """Raise ValueError naming every Theorem 11 precondition that (K, n, delta) violates."""
    k, n, d = num_clients, n_out, delta_theorem
    problems = []
    if k < 81:
        problems.append(f"K >= 81 (K={k})")
    if not n < k:
        problems.append(f"n < K (n={n}, K={k})")
    for label, bound in (
        ("4 log(2K/(3 delta))", 4.0 * math.log(2.0 * k / (3.0 * d))),
        ("6 log(K/3)", 6.0 * math.log(k / 3.0)),
        ("3/2 + 9/4 log(2e/delta)", 1.5 + 2.25 * math.log(2.0 * math.e / d)),
    ):
        if n < bound:
            problems.append(f"n >= {label} = {bound:.2f} (n={n})")
    if (n - 1) // 3 - 1 < 1:
        problems.append(f"floor((n-1)/3) - 1 >= 1 (n={n})")
    if problems:
        raise ValueError(
            "Theorem 11 (random n-out graph) does not cover this setting (delta_theorem="
            f"{d:.3g} = delta/3); violated: " + "; ".join(problems)
        )


@dataclass(frozen=True)
class Calibration:
    """Result of `calibrate`. sigma_* are the DN(sigma, 1) parameters for eta and Delta (Eqs. 16, 19)."""

    sigma_eta: float
    sigma_delta: float
    theta: float  # theta of the chosen theorem at these sigmas (== theta_max up to round-off)
    theta_max: float  # largest theta allowed by Eq. (23) for (epsilon, delta_theorem)
    graph: str  # "complete" (Theorem 10) or "n_out" (Theorem 11)
    epsilon: float
    delta: float  # the target delta requested
    delta_theorem: float  # delta used inside the theorem (delta, or delta/3 for n-out)
    num_clients: int
    n_out: int | None
    sensitivity: float

    @property
    def aggregate_noise_std(self) -> float:
        """Std of the noise left in the recovered mean gradient (R o mean_k eta_k): sigma_eta / sqrt(K)."""
        return self.sigma_eta / math.sqrt(self.num_clients)


def calibrate(
    epsilon: float,
    delta: float,
    num_clients: int,
    n_out: int | None = None,
    *,
    eta_share: float = 0.9,
    sensitivity: float = 1.0,
) -> Calibration:
    """sigma_eta, sigma_Delta for (epsilon, delta)-DP of one round of DDP_Client (Theorems 10/11).

    n_out=None or n_out >= K-1: complete graph (Theorem 10). Otherwise random n-out graph (Theorem 11,
    preconditions enforced, delta split as delta/3). eta_share in (0, 1): fraction of theta_max given to
    the eta term. Raises ValueError on anything the theorems do not cover.
    """
    check_eps_delta(epsilon, delta)
    if isinstance(num_clients, bool) or int(num_clients) != num_clients or num_clients < 2:
        raise ValueError(f"num_clients must be an integer >= 2, got {num_clients}")
    num_clients = int(num_clients)
    if not (0.0 < eta_share < 1.0):
        raise ValueError("eta_share must be in (0, 1): both noise terms are needed by Theorems 10/11")
    if not (math.isfinite(sensitivity) and sensitivity > 0):
        raise ValueError("sensitivity must be positive")
    complete = n_out is None or n_out >= num_clients - 1
    if not complete:
        if int(n_out) != n_out or n_out < 1:
            raise ValueError(f"n_out must be a positive integer, got {n_out}")
        n_out = int(n_out)
    delta_theorem = delta if complete else delta / 3.0
    if not complete:
        check_n_out_conditions(num_clients, n_out, delta_theorem)
    th_max = max_theta(epsilon, delta_theorem)
    th_eta, th_delta = eta_share * th_max, (1.0 - eta_share) * th_max
    sigma_eta = 1.0 / math.sqrt(num_clients * th_eta)
    if complete:
        sigma_delta = 1.0 / math.sqrt(num_clients * th_delta)
        theta = theta_complete(sigma_eta, sigma_delta, num_clients)
    else:
        sigma_delta = math.sqrt(n_out_delta_coefficient(num_clients, n_out) / th_delta)
        theta = theta_n_out(sigma_eta, sigma_delta, num_clients, n_out)
    return Calibration(
        sigma_eta=sensitivity * sigma_eta,
        sigma_delta=sensitivity * sigma_delta,
        theta=theta,
        theta_max=th_max,
        graph="complete" if complete else "n_out",
        epsilon=epsilon,
        delta=delta,
        delta_theorem=delta_theorem,
        num_clients=num_clients,
        n_out=None if complete else n_out,
        sensitivity=sensitivity,
    )


def mp_record_sensitivity(clip: float, dataset_size: int, *, adjacency: str) -> float:
    """Record sensitivity ``a clip / n`` of a client's upload, the mean of its n per-example-clipped gradients.

    ``a`` = 1 under zero-out, 2 under replace-one adjacency (:func:`protocols.privacy.sensitivity.adjacency_factor`).

    The paper sets "S_f = B = 1 for simplicity" (footnote 2): B bounds one CLIENT's whole gradient, a
    loose client-level figure, while its DP definition protects one RECORD.  The record figure is the
    L2 change of the mean of n clipped per-example gradients when one record is replaced (one
    full-batch step of :func:`protocols.privacy.local_sgd_sensitivity` with lr 1: FedSGD uploads the
    gradient, the server applies xi).
    """
    if isinstance(dataset_size, bool) or int(dataset_size) != dataset_size or dataset_size < 1:
        raise ValueError(f"dataset_size must be an integer >= 1, got {dataset_size!r}")
    return local_sgd_sensitivity(clip, int(dataset_size), lr=1.0, adjacency=adjacency)


def round_multiplier(epsilon: float, delta: float, releases: int, *, complete: bool) -> float:
    """The noise multiplier z of one of ``releases`` rounds of a run at (epsilon, delta), per unit sensitivity.

    Complete graph (Theorem 10): :func:`protocols.privacy.noise_multiplier` of T = ``releases`` Gaussian rounds
    (composed by the accountant).  n-out graph (Theorem 11): ``max_theta(epsilon/T, delta/T) ** -0.5``, the Eq. (23)
    multiplier of one round at its basic-composition share.
    """
    if complete:
        return noise_multiplier(epsilon, delta, releases)
    return max_theta(epsilon / releases, delta / releases) ** -0.5


def round_event(epsilon: float, delta: float, releases: int, *, complete: bool,
                scale: float = 1.0) -> GaussianEvent | DpEvent:
    """One participant's charge for one of ``releases`` rounds of a run at (epsilon, delta) (Theorems 10, 11).

    Complete graph: ``GaussianEvent(z scale)``, z = :func:`round_multiplier` (``scale``: the round's noise over the
    calibration's).  n-out graph: ``DpEvent(epsilon/T, delta/T)`` (basic composition of Theorem 11 rounds; ``scale``
    does not change it).
    """
    if complete:
        return GaussianEvent(round_multiplier(epsilon, delta, releases, complete=True) * scale)
    return DpEvent(epsilon / releases, delta / releases)


def theta_for_noise_multiplier(noise_multiplier: float) -> float:
    """Privacy-loss variance theta = 1/z^2 of a Gaussian release with std z S at sensitivity S.

    Eq. (23) is the Gaussian tail bound of a N(theta/2, theta) privacy loss, so theta and the noise multiplier
    z describe the same mechanism: z from a multi-round accountant gives the theta to split by
    `sigmas_for_theta`, and ``max_theta(epsilon, delta) ** -0.5`` is the one-round (Eq. 23) multiplier.
    """
    if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise ValueError(f"noise_multiplier must be finite and > 0, got {noise_multiplier}")
    return 1.0 / noise_multiplier**2


def _check_multiplier(noise_multiplier: float, sensitivity: float) -> None:
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier}")
    if not (math.isfinite(sensitivity) and sensitivity > 0):
        raise ValueError("sensitivity must be positive")


def calibrate_ldp(noise_multiplier: float, *, sensitivity: float = 1.0) -> float:
    """MP-DP-Naive: Gaussian sigma = z S on one client's (perturbed) gradient, i.e. theta = S^2/sigma^2 per client."""
    _check_multiplier(noise_multiplier, sensitivity)
    return noise_multiplier * sensitivity


def calibrate_cdp(noise_multiplier: float, num_clients: int, *, sensitivity: float = 1.0) -> float:
    """MP-CDP: Gaussian sigma = z S / K on the mean of K clipped gradients (sensitivity S/K), theta = (S/K)^2/sigma^2."""
    _check_multiplier(noise_multiplier, sensitivity)
    if num_clients < 1:
        raise ValueError("num_clients must be >= 1")
    return noise_multiplier * sensitivity / num_clients


#: The mask's expected share of the squared last perturbed matrix: ``E[gamma^2] / (E[gamma^2] + E[s^2])`` with
#: gamma ~ Uniform(0.5, 1.5) and s ~ |DN*(1)| (E = 13/12 and 3/2) where the mask and the weights have one RMS.
MASK_SHARE = 13.0 / 31.0


def mask_reference(w_hat_last: object) -> float:
    """rho: an estimate of ||r|| from the last perturbed matrix, ``sqrt(MASK_SHARE) ||W-hat^(2L-1)||_F / sqrt(cols)``.

    The additive mask R^a repeats r = gamma o r^a in every column (Eq. 5) at the output layer's RMS
    (:func:`protocols.mpddp.perturbation.output_scale`), so rho is about ||r||; any rho > 0 keeps the bound (a wrong
    one moves clipping against kappa).  Both ends compute it from W-hat, which every client holds: it reveals
    nothing new.  Returns a positive float (at least 1e-12).
    """
    import numpy as np

    from protocols.clipping import norm_factors

    m = np.asarray(w_hat_last, dtype=np.float64)
    if m.ndim != 2 or m.size == 0:
        raise ValueError(f"expected the last perturbed matrix (2-D), got shape {m.shape}")
    top, relative = norm_factors(m)
    norm = top * relative if 0 < top < math.inf else top
    return max(math.sqrt(MASK_SHARE) * norm / math.sqrt(m.shape[1]), 1e-12)


def secret_factor(r_norm: float, rho: float) -> float:
    """The factor kappa = max(1, (||r|| / rho)^2): the R-divided record sensitivity over the clip's (module docstring).

    ``||g^ - r^T Psi + v Phi|| <= ||g^|| + ||r|| sigma_max(Psi) + ||r||^2 ||Phi|| <= kappa (||g^|| + rho
    sigma_max(Psi) + rho^2 ||Phi||)`` (v = ||r||^2, Theorem 1), so the clients' clip bounds a record's effect
    given R by kappa times the record sensitivity.  Server-side only: ||r|| is part of the secret.
    """
    if not (math.isfinite(r_norm) and r_norm >= 0 and math.isfinite(rho) and rho > 0):
        raise ValueError(f"need finite ||r|| >= 0 and rho > 0, got {r_norm!r}, {rho!r}")
    return max(1.0, (r_norm / rho) ** 2)


def given_r_topup(noise_multiplier: float, kappa: float, sensitivity: float, num_clients: int,
                  present_variance: float) -> float:
    """Std of the Gaussian the server adds to the mean perturbed gradient so that, given R, it is a Gaussian release.

    Target std ``z kappa S / K`` (S the largest record sensitivity among the K uploads, kappa from
    :func:`secret_factor`); ``present_variance``: the variance of the Gaussian noise the clients already put in the
    mean (only Gaussian noise given R counts).  Returns ``sqrt(max(0, target^2 - present_variance))``.
    """
    if num_clients < 1 or not (kappa >= 1 and sensitivity > 0 and noise_multiplier >= 0 and present_variance >= 0):
        raise ValueError("need K >= 1, kappa >= 1, S > 0, z >= 0 and a variance >= 0")
    target = noise_multiplier * kappa * sensitivity / num_clients
    return math.sqrt(max(0.0, target * target - present_variance))


def theta_after(sigma_eta: float, sigma_delta: float, survivors: int, *, complete: bool, n_out: int | None) -> float:
    """Theorem 10 (``complete``) or 11 (``n_out``-out graph) theta of the ``survivors`` left after a recovery.

    The sigmas per unit sensitivity.  What the server's account stage charges (:mod:`strategies.mpddp`) and each
    survivor's ledger tops up to before it answers the recovery request (:mod:`client.recovery_ledger`).
    Raises ValueError where Theorem 11 does not apply.
    """
    return (theta_complete(sigma_eta, sigma_delta, survivors) if complete
            else theta_n_out(sigma_eta, sigma_delta, survivors, n_out or 1))


def n_out_shortfall(theta: float, epsilon: float, delta: float, releases: int) -> float:
    """Epsilon a Theorem 11 round (charged ``epsilon/T`` by basic composition) costs beyond it at ``theta``."""
    return eq23_epsilon(theta, delta / (3 * releases)) - epsilon / releases
