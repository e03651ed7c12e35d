"""LaDP-FL: local layer-wise differential privacy (Li et al., 2025, Algorithms 2-4), Flower-free math.

* selection: a layer gets noise iff ``||w_j||_2 >= R`` (Algorithm 2, lines 10-14);
* privacy estimate: ``P_j = min(KL(softmax(w_j) || softmax(w_ref_j)), B)`` (Algorithm 3, Eq. 8),
  floored at ``min_kl`` so a layer that barely moved cannot get unbounded noise;
* noise: ``sigma_j = c * Delta_f / (epsilon * P_j)`` with ``c = c0 * B`` (Algorithm 4, Eq. 10, Theorem 3);
  ``P_j <= B`` gives ``sigma_j >= c0 * Delta_f / epsilon``, the (epsilon, delta) guarantee.

``Delta_f`` is the record-level sensitivity of per-example-clipped training
(:func:`protocols.privacy.record_sensitivity`); Theorem 2's client-level bound is :func:`sensitivity`.
The client uses :func:`plan_public_noise` (selection and ``P_j`` from published global models, so the noise
scale does not depend on private data); :func:`plan_layer_noise` is the paper's data-dependent form.
``theorem3_c0_corrected`` fixes a factor-2 error in Eq. 11 (``theorem3_c0_paper`` keeps it for comparison).
Unselected layers are released without noise.  Where the paper is vague or wrong: ``docs/methods/ladp.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np
from scipy.special import log_softmax

from protocols import prg
from protocols.privacy import analytic_gaussian_sigma, classic_gaussian_sigma
from protocols.privacy.mechanisms import check_eps_delta
from protocols.wire.common import ViewError

__all__ = [
    "LayerNoise",
    "sensitivity",
    "softmax_kl",
    "privacy_estimate",
    "theorem3_c0_paper",
    "theorem3_c0_corrected",
    "theorem3_c",
    "floor_epsilon",
    "round_epsilon",
    "round_multiplier",
    "layer_sigma",
    "plan_layer_noise",
    "plan_public_noise",
    "public_estimates",
    "apply_layer_noise",
    "check_upload_grid",
    "full_ldp_plan",
    "expected_noise_sq_norm",
]

Constant = Literal["corrected", "paper", "analytic"]


@dataclass(frozen=True)
class LayerNoise:
    """Noise decision for one layer.

    ``selected``: layer norm >= R (gets noise); ``norm``: L2 norm of the local layer;
    ``kl``: raw KL(local || global) (None if not selected, as in Algorithm 2);
    ``privacy``: P = max(min(kl, B), min_kl) actually used; ``sigma``: per-entry
    noise std (0.0 if not selected).
    """

    selected: bool
    norm: float
    kl: float | None
    privacy: float | None
    sigma: float


# ----------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------


def sensitivity(lr: float, local_steps: int, grad_clip: float) -> float:
    """Theorem 2: ``Delta_f = 2 * eta * E * G_c`` (L2, per layer and whole model).

    Each of the ``E`` clipped steps moves the weights by at most ``eta * G_c`` on
    either of two adjacent datasets, hence ``2 eta G_c`` apart per step.  Kept for
    reference and comparison only: it holds for *any* two local datasets (a client-level
    bound); the client calibrates to the record-level
    :func:`protocols.privacy.record_sensitivity` instead.
    """
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if int(local_steps) != local_steps or local_steps < 1:
        raise ValueError(f"local_steps must be an integer >= 1, got {local_steps!r}")
    if not (math.isfinite(grad_clip) and grad_clip > 0):
        raise ValueError(f"grad_clip must be > 0, got {grad_clip!r}")
    return 2.0 * lr * int(local_steps) * grad_clip


def _check_sensitivity(value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"sensitivity Delta_f must be finite and > 0, got {value!r}")
    return value


def softmax_kl(local: np.ndarray, global_: np.ndarray) -> float:
    """``KL(softmax(local) || softmax(global))`` of the flattened layers, in nats.

    Uses log-softmax (max-shifted) so large weights cannot overflow; the result is
    clamped at 0 against rounding.
    """
    a = np.asarray(local, dtype=np.float64).ravel()
    b = np.asarray(global_, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"layer shapes differ: {np.shape(local)} vs {np.shape(global_)}")
    if a.size == 0:
        raise ValueError("empty layer")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("layer contains non-finite values")
    lp = log_softmax(a)
    lq = log_softmax(b)
    return max(float(np.sum(np.exp(lp) * (lp - lq))), 0.0)


def privacy_estimate(local: np.ndarray, global_: np.ndarray, kl_cap: float) -> float:
    """Algorithm 3 / Eq. (8): ``P = min(KL(local || global), B)``."""
    if not (math.isfinite(kl_cap) and kl_cap > 0):
        raise ValueError(f"kl_cap (B) must be > 0, got {kl_cap!r}")
    return min(softmax_kl(local, global_), kl_cap)


def theorem3_c0_paper(epsilon: float, delta: float) -> float:
    """Eq. (11) of the paper *verbatim*, without the factor B.

    ``(sqrt(ln(2/(pi d^2))) + sqrt(ln(2/(pi d^2)) + 8 e)) / 4`` if
    ``d <= sqrt(2/(pi e^4))``, else ``(1 + sqrt(1 + 2 e)) / 2``.  NOT (eps, delta)-DP
    in general (it roughly halves sigma; ``docs/methods/ladp.md``); kept for comparison only.
    """
    check_eps_delta(epsilon, delta)
    if delta <= math.sqrt(2.0 / (math.pi * math.e**4)):
        l2 = math.log(2.0 / (math.pi * delta**2))
        return (math.sqrt(l2) + math.sqrt(l2 + 8.0 * epsilon)) / 4.0
    return (1.0 + math.sqrt(1.0 + 2.0 * epsilon)) / 2.0


def theorem3_c0_corrected(epsilon: float, delta: float) -> float:
    """Corrected Theorem 3 constant (without B): ``(m + sqrt(m^2 + 2 eps)) / 2``.

    ``m = max(1, sqrt(ln(2/(pi delta^2))))``.  Derivation (Dwork & Roth, App. A):
    with ``sigma = c0 Delta / eps`` and ``u = c0 - eps/(2 c0)`` the mechanism is
    (eps, delta)-DP if ``ln u + u^2/2 >= ln(sqrt(2/pi)/delta)``; ``u >= max(1, L)``
    is sufficient (``ln u >= 0`` and ``u^2/2 >= L^2/2``) and is a quadratic in c0.
    Valid for every eps > 0 and 0 < delta < 1.
    """
    check_eps_delta(epsilon, delta)
    m = _theorem3_m(delta)
    return (m + math.sqrt(m * m + 2.0 * epsilon)) / 2.0


def _theorem3_m(delta: float) -> float:
    """``m = max(1, sqrt(ln(2/(pi delta^2))))`` of :func:`theorem3_c0_corrected`."""
    l2 = math.log(2.0 / (math.pi * delta**2))
    return max(1.0, math.sqrt(l2)) if l2 > 0 else 1.0


def floor_epsilon(delta: float) -> float:
    """The per-round epsilon whose multiplier ``c0(e) / e`` is :data:`protocols.privacy.MIN_NOISE_MULTIPLIER`.

    ``c0(e) / e = z`` solves to ``e = (1 + 2 z m) / (2 z^2)`` (``m`` of :func:`theorem3_c0_corrected`); the
    multiplier falls as ``e`` grows, so a round at most this epsilon gets at least the floor multiplier.
    """
    from protocols.privacy import MIN_NOISE_MULTIPLIER as z

    return (1.0 + 2.0 * z * _theorem3_m(delta)) / (2.0 * z * z)


@lru_cache(maxsize=64)  # a pure function every client calls every round (a bisection)
def round_epsilon(epsilon: float, delta: float, rounds: int) -> float:
    """Per-round Theorem 3 epsilon whose ``rounds`` releases are ``(epsilon, delta)``-DP over the whole run.

    Each round is a Gaussian release with multiplier ``z(e) = c0(e, delta) / e`` (corrected constant,
    :func:`theorem3_c0_corrected`); ``rounds`` of them compose exactly (Gaussian DP,
    :func:`protocols.privacy.gdp_epsilon`).  ``z`` falls as ``e`` grows, so the largest ``e`` whose
    composition stays within ``epsilon`` is found by bisection (to 1e-9 relative), at most :func:`floor_epsilon`:
    as every method's calibration, the multiplier is at least :data:`protocols.privacy.MIN_NOISE_MULTIPLIER`, and a
    target its ``rounds`` releases at that multiplier do not reach is spent only in part (a noise std far below the
    weights' float32 grid would round away).  Client and server both call this: run-config ``epsilon`` is the
    whole-run target, as for every method.
    """
    from protocols.privacy import gdp_epsilon

    check_eps_delta(epsilon, delta)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")

    def spent(e: float) -> float:
        return gdp_epsilon(theorem3_c0_corrected(e, delta) / e, rounds, delta)

    cap = floor_epsilon(delta)
    if spent(cap) <= epsilon:
        return cap
    lo, hi = 0.0, min(float(epsilon), cap)
    while spent(hi) <= epsilon:  # a single round's bound is loose: the per-round value may exceed the target
        lo, hi = hi, min(2.0 * hi, cap)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid > 0 and spent(mid) <= epsilon:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-9 * hi:
            break
    if lo <= 0:
        raise ValueError(f"no per-round epsilon meets epsilon={epsilon} over {rounds} rounds at delta={delta}")
    return lo


def round_multiplier(epsilon: float, delta: float, rounds: int, *, scale: float = 1.0) -> float:
    """Smallest multiplier ``sigma_j / Delta_f`` of one round's release: ``scale c0(e_r) / e_r`` (Theorem 3, Eq. 10).

    ``e_r`` = :func:`round_epsilon`, ``c0`` = :func:`theorem3_c0_corrected`; ``scale``: the round's noise over the
    calibration's.
    """
    e = round_epsilon(epsilon, delta, rounds)
    return scale * theorem3_c0_corrected(e, delta) / e


def theorem3_c(epsilon: float, delta: float, kl_cap: float, constant: Constant = "corrected") -> float:
    """Theorem 3's ``c_i = c0 * B`` (the smallest value the theorem allows).

    ``constant``: ``"corrected"`` (default, see :func:`theorem3_c0_corrected`),
    ``"paper"`` (Eq. (11) verbatim) or ``"analytic"`` (``c0 = eps * sigma_aGM /
    Delta``, exact and tightest).
    """
    check_eps_delta(epsilon, delta)
    if not (math.isfinite(kl_cap) and kl_cap > 0):
        raise ValueError(f"kl_cap (B) must be > 0, got {kl_cap!r}")
    if constant == "corrected":
        c0 = theorem3_c0_corrected(epsilon, delta)
    elif constant == "paper":
        c0 = theorem3_c0_paper(epsilon, delta)
    elif constant == "analytic":
        c0 = epsilon * analytic_gaussian_sigma(epsilon, delta, 1.0)
    else:
        raise ValueError(f"unknown constant {constant!r}")
    return c0 * kl_cap


def layer_sigma(c: float, sens: float, epsilon: float, privacy: float) -> float:
    """Eq. (10): ``sigma = c * Delta_f / (epsilon * P)``."""
    if not (privacy > 0):
        raise ValueError(f"privacy estimate P must be > 0, got {privacy!r}")
    return c * sens / (epsilon * privacy)


# ----------------------------------------------------------------------------------
# Plans
# ----------------------------------------------------------------------------------


def plan_layer_noise(
    local_layers: Mapping[str, np.ndarray],
    global_layers: Mapping[str, np.ndarray],
    *,
    epsilon: float,
    delta: float,
    sensitivity: float,
    norm_threshold: float,
    kl_cap: float,
    constant: Constant = "corrected",
    min_kl: float = 1e-12,
) -> dict[str, LayerNoise]:
    """Per-layer LaDP noise plan (Algorithm 2 lines 10-14, Algorithms 3-4).

    ``local_layers`` are the trained local weights, ``global_layers`` the global
    model received this round (same keys and shapes); ``sensitivity`` is ``Delta_f``, the L2
    sensitivity of the local model to one record (the client passes
    :func:`protocols.privacy.record_sensitivity`; :func:`sensitivity` is Theorem 2's).  Layers with L2 norm
    ``>= norm_threshold`` (R) are selected and get
    ``sigma = c * Delta_f / (epsilon * P)`` with ``P = max(min(KL, B), min_kl)``;
    the others get sigma 0.
    """
    if set(local_layers) != set(global_layers):
        raise ValueError("local and global models have different layer names")
    if not (math.isfinite(norm_threshold) and norm_threshold >= 0):
        raise ValueError(f"norm_threshold (R) must be >= 0, got {norm_threshold!r}")
    if not (0 < min_kl <= kl_cap):
        raise ValueError(f"need 0 < min_kl <= kl_cap, got min_kl={min_kl!r}, kl_cap={kl_cap!r}")
    sens = _check_sensitivity(sensitivity)
    c = theorem3_c(epsilon, delta, kl_cap, constant)
    plan: dict[str, LayerNoise] = {}
    for name, local in local_layers.items():
        w = np.asarray(local, dtype=np.float64)
        g = np.asarray(global_layers[name], dtype=np.float64)
        if w.shape != g.shape:
            raise ValueError(f"layer {name!r}: shape {w.shape} vs global {g.shape}")
        norm = float(np.linalg.norm(w.ravel()))
        if norm < norm_threshold:
            plan[name] = LayerNoise(selected=False, norm=norm, kl=None, privacy=None, sigma=0.0)
            continue
        kl = softmax_kl(w, g)
        p = max(min(kl, kl_cap), min_kl)
        plan[name] = LayerNoise(selected=True, norm=norm, kl=kl, privacy=p, sigma=layer_sigma(c, sens, epsilon, p))
    return plan


def public_estimates(current: Mapping[str, np.ndarray], previous: Mapping[str, np.ndarray] | None) -> dict[str, float]:
    """The server's per-layer privacy estimate: ``KL(softmax(w_g^t_j) || softmax(w_g^(t-1)_j))`` of two published models.

    Algorithm 3 on the layer's change over the last round, measured on public models (post-processing of
    earlier releases), so the noise scale it sets does not depend on this round's private data.  ``previous``
    None (round 1): no estimate (empty dict; the client then uses ``B``, the floor noise).
    """
    if previous is None:
        return {}
    return {name: softmax_kl(current[name], previous[name]) for name in current if name in previous}


def plan_public_noise(
    global_layers: Mapping[str, np.ndarray],
    estimates: Mapping[str, float],
    *,
    epsilon: float,
    delta: float,
    sensitivity: float,
    norm_threshold: float,
    kl_cap: float,
    constant: Constant = "corrected",
    min_kl: float = 1e-12,
) -> dict[str, LayerNoise]:
    """Per-layer LaDP noise plan from public inputs only: the data-independent form of :func:`plan_layer_noise`.

    Selection ``||w_g_j|| >= R`` on the received global model and ``P_j = max(min(estimates[j], B), min_kl)``
    (a layer without an estimate gets ``P_j = B``, the floor noise) with ``estimates`` from
    :func:`public_estimates`; ``sigma_j = c Delta_f / (epsilon P_j)`` (Eq. 10).  Neither depends on the local
    data, so each noised layer is a Gaussian mechanism with a fixed ``sigma_j >= c0 Delta_f / epsilon``.
    :func:`plan_layer_noise` computes both from the trained local model: its noise scale is a function of the
    private data (a record that moves the KL across ``[min_kl, B]`` changes sigma up to ``B / min_kl`` times,
    which the noise itself reveals), which Theorem 3 does not cover.
    """
    if not (math.isfinite(norm_threshold) and norm_threshold >= 0):
        raise ValueError(f"norm_threshold (R) must be >= 0, got {norm_threshold!r}")
    if not (0 < min_kl <= kl_cap):
        raise ValueError(f"need 0 < min_kl <= kl_cap, got min_kl={min_kl!r}, kl_cap={kl_cap!r}")
    unknown = set(estimates) - set(global_layers)
    if unknown:
        raise ValueError(f"estimates for unknown layers: {sorted(unknown)}")
    sens = _check_sensitivity(sensitivity)
    c = theorem3_c(epsilon, delta, kl_cap, constant)
    plan: dict[str, LayerNoise] = {}
    for name, layer in global_layers.items():
        norm = float(np.linalg.norm(np.asarray(layer, dtype=np.float64).ravel()))
        if norm < norm_threshold:
            plan[name] = LayerNoise(selected=False, norm=norm, kl=None, privacy=None, sigma=0.0)
            continue
        est = float(estimates.get(name, kl_cap))
        if not (math.isfinite(est) and est >= 0):
            raise ValueError(f"layer {name!r}: privacy estimate must be finite and >= 0, got {est!r}")
        p = max(min(est, kl_cap), min_kl)
        plan[name] = LayerNoise(selected=True, norm=norm, kl=est, privacy=p, sigma=layer_sigma(c, sens, epsilon, p))
    return plan


def full_ldp_plan(
    layers: Mapping[str, np.ndarray],
    *,
    epsilon: float,
    delta: float,
    sensitivity: float,
    baseline: Literal["classic", "corrected", "analytic"] = "classic",
) -> dict[str, LayerNoise]:
    """Noise a *full* LDP client would add: every layer, same sigma.

    ``"classic"``: the paper's "Full DP" baseline, Gaussian mechanism of Theorem 1,
    ``sigma = sqrt(2 ln(1.25/delta)) Delta_f / eps`` (refused for eps >= 1).
    ``"corrected"`` / ``"analytic"``: LaDP's own constant with every layer selected
    and ``P = B`` (the smallest sigma LaDP would ever use), i.e. ``c0 Delta_f/eps``.
    ``sensitivity`` is ``Delta_f`` (as in :func:`plan_layer_noise`).
    """
    sens = _check_sensitivity(sensitivity)
    if baseline == "classic":
        sigma = classic_gaussian_sigma(epsilon, delta, sens)
    elif baseline in ("corrected", "analytic"):
        sigma = theorem3_c(epsilon, delta, 1.0, baseline) * sens / epsilon
    else:
        raise ValueError(f"unknown baseline {baseline!r}")
    return {
        name: LayerNoise(
            selected=True,
            norm=float(np.linalg.norm(np.asarray(w, dtype=np.float64).ravel())),
            kl=None,
            privacy=None,
            sigma=sigma,
        )
        for name, w in layers.items()
    }


def expected_noise_sq_norm(plan: Mapping[str, LayerNoise], layers: Mapping[str, np.ndarray]) -> float:
    """``E ||noise||^2 = sum_j sigma_j^2 * size_j`` over the whole model."""
    return float(sum(plan[n].sigma ** 2 * np.size(layers[n]) for n in plan))


def apply_layer_noise(
    layers: Mapping[str, np.ndarray],
    plan: Mapping[str, LayerNoise],
    rng: np.random.Generator | bytes,
    *,
    upload_dtype: np.dtype | type | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Algorithm 4: add ``N(0, sigma_j^2)`` entry-wise to every selected layer.

    ``rng`` is a numpy Generator or a 32-byte seed (then layer ``j``'s noise comes
    from ``protocols.prg.gaussian`` under label ``"ladp/<name>"``, reproducible
    across machines).  Returns ``(noisy_layers, noise_l2_norm_per_layer)``;
    unselected layers are returned unchanged (copied) with norm 0.0.  Floating
    layers keep their dtype, or take ``upload_dtype`` (what the upload is sent in); noise is generated in float64.
    Raises ValueError for a noised layer whose values are too large for its output dtype to keep the noise
    (a grid coarser than ``sigma / ROUNDING_MARGIN``: a server-sent model could otherwise round it away).
    """
    if set(layers) != set(plan):
        raise ValueError("plan and layers have different layer names")
    arrays = {name: np.asarray(layer) for name, layer in layers.items()}
    noised = [name for name in arrays if plan[name].selected and plan[name].sigma != 0.0]
    for name in noised:
        if not math.isfinite(plan[name].sigma):
            raise ValueError(f"layer {name!r}: non-finite sigma")
    if isinstance(rng, bytes):  # one PRG pass for all layers, bit-identical to one stream per layer
        draws = prg.gaussian_many([prg.derive_subseed(rng, f"ladp/{name}") for name in noised],
                                  [arrays[name].size for name in noised], [plan[name].sigma for name in noised])
    else:
        draws = (rng.normal(0.0, plan[name].sigma, arrays[name].size) for name in noised)
    noises = dict(zip(noised, draws, strict=True))
    noisy: dict[str, np.ndarray] = {}
    report: dict[str, float] = {}
    for name, arr in arrays.items():
        out_dtype = np.dtype(upload_dtype) if upload_dtype is not None else (
            arr.dtype if np.issubdtype(arr.dtype, np.floating) else np.dtype(np.float64))
        if name not in noises:
            noisy[name] = arr.astype(out_dtype, copy=True)
            report[name] = 0.0
            continue
        noise = noises[name].reshape(arr.shape)
        summed = arr.astype(np.float64) + noise
        if out_dtype != np.float64 and arr.size:
            # Cast back to a narrower float, values as large as the (server-sent) model's round noise away: refuse
            # when the grid there is coarser than sigma / ROUNDING_MARGIN.  Past check_upload_grid only when the
            # noise passes NOISE_TAIL sigmas; the message names no value (the layer is not charged yet).
            if not _grid_keeps(float(np.max(np.abs(summed))), out_dtype, plan[name].sigma):
                raise ValueError(f"layer {name!r}: its noisy values are too large for {np.dtype(out_dtype).name} to "
                                 f"keep noise of std {plan[name].sigma:.3g} (it would round away); refusing the round")
        noisy[name] = summed.astype(out_dtype)
        report[name] = float(np.linalg.norm(noise.ravel()))
    return noisy, report


#: A layer cast back to a narrower float after its noise is added keeps a grid at most ``sigma / ROUNDING_MARGIN``.
ROUNDING_MARGIN = 16.0
#: A noised entry passes its public bound (:func:`check_upload_grid`) only when its noise passes this many sigmas
#: (probability ``erfc(10 / sqrt(2))``, 1.5e-23).
NOISE_TAIL = 10.0


def _grid_keeps(value: float, dtype: np.dtype | type, sigma: float) -> bool:
    """Whether ``dtype``'s grid at ``|value|`` is at most ``sigma / ROUNDING_MARGIN`` (False where it is NaN)."""
    return float(np.spacing(np.asarray(abs(value), dtype=dtype))) * ROUNDING_MARGIN <= sigma


def check_upload_grid(global_layers: Mapping[str, np.ndarray], plan: Mapping[str, LayerNoise], movement: float,
                      upload_dtype: np.dtype | type) -> None:
    """Refuse, from public values, a noised layer whose upload grid may be coarser than ``sigma / ROUNDING_MARGIN``.

    A noised entry of layer ``j`` is at most ``max |w_g_j| + movement + NOISE_TAIL sigma_j`` (``w_g`` the received
    model, ``movement`` the most local training moves it: :func:`protocols.privacy.record_training_movement`) but
    with probability 1.5e-23.  Whether :func:`apply_layer_noise` refuses a layer after its noise is drawn is a
    function of the noisy model that no ledger charges, and a refused round can be sent again: a server that puts an
    entry just below a power of two learns, one refusal at a time, whether the client's entry crossed it.  Deciding
    on this bound instead leaves that test to the noise's far tail.

    Raises:
        ViewError: (a ValueError) such a layer (nothing is noised nor charged yet).
    """
    if not (math.isfinite(movement) and movement >= 0):
        raise ValueError(f"movement must be finite and >= 0, got {movement!r}")
    for name, entry in plan.items():
        layer = np.asarray(global_layers[name], dtype=np.float64)
        if not (entry.selected and entry.sigma != 0.0 and layer.size):
            continue
        bound = float(np.max(np.abs(layer))) + movement + NOISE_TAIL * entry.sigma
        if not _grid_keeps(bound, upload_dtype, entry.sigma):
            raise ViewError(f"layer {name!r}: the received model's values (up to {float(np.max(np.abs(layer))):.3g}) "
                             f"plus what local training may move them ({movement:.3g}) are too large for "
                             f"{np.dtype(upload_dtype).name} to keep noise of std {entry.sigma:.3g} (it would round "
                             "away; a smaller run-config 'epsilon' gives more noise); refusing the round")
