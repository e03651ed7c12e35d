"""LaDP-FL: local layer-wise differential privacy (Li et al., 2025), Flower-free math.

Client side of the paper (Algorithms 2-4):

1. sensitivity ``Delta_f`` of the local model to one training record (see below: we replace
   Theorem 2's ``2 * eta * E * G_c`` by the per-example bound);
2. layer selection: a layer gets noise iff ``||w_local_j||_2 >= R``;
3. privacy estimation (Algorithm 3): ``P_j = min(KL(softmax(w_local_j) ||
   softmax(w_global_j)), B)`` on the flattened layer;
4. noise injection (Algorithm 4): ``sigma_j = c * Delta_f / (epsilon * P_j)``
   with ``c`` from Theorem 3, i.e. ``c = c0 * B`` where ``c0`` is a Gaussian-
   mechanism constant.  Because ``P_j <= B`` we get ``sigma_j >= c0 * Delta_f /
   epsilon``, which is where the (epsilon, delta) guarantee comes from.

Sensitivity: Theorem 2 replaced by the per-example bound (correct and tighter).  Theorem 2's
``Delta_f = 2 eta E G_c`` (:func:`sensitivity`, kept for reference) bounds how far the local model
moves when the *clipped mini-batch mean* gradient can change arbitrarily, i.e. when the whole
local dataset changes: it is a client-level bound, and with it the noise at epsilon 1 is
hundreds of times the update (measured: chance accuracy on digits).  The paper's adjacency is one
record, so the client trains with *per-example* clipping (:func:`client.training.clipped_sgd`)
and passes ``Delta_f = protocols.privacy.record_sensitivity`` of that training to
:func:`plan_layer_noise` (``2 G_c eta / N_i`` for one full-batch step, NADP-FL's Lemma 1; the
multi-step bound of :func:`protocols.privacy.local_sgd_sensitivity` otherwise).  Everything else
below (layer selection, KL privacy estimate, Theorem 3's ``c``) is LaDP's, applied with this
``Delta_f``.

Interpretations and corrections (each is also noted where it is implemented):

* **Theorem 3 is wrong by a factor of 2 inside its first case.**  Its proof sketch
  is the Dwork-Roth tail-bound argument: with ``u = c0 - eps/(2 c0)`` one needs
  ``ln u + u^2/2 >= ln(sqrt(2/pi)/delta) = L^2/2`` with
  ``L = sqrt(ln(2/(pi delta^2)))``.  Solving ``u >= max(1, L)`` gives
  ``c0 = (m + sqrt(m^2 + 2 eps)) / 2`` with ``m = max(1, L)`` (the case split is at
  ``delta = sqrt(2/(pi e))``).  The paper's formula
  ``(L + sqrt(L^2 + 8 eps)) / 4`` (split at ``sqrt(2/(pi e^4))``) equals this with
  ``L`` replaced by ``L/2``; it roughly halves sigma and is *not* (eps, delta)-DP,
  e.g. at ``delta = 1e-5, eps = 0.5`` the exact delta of the resulting mechanism is
  5.6e-4 (tests check this against the exact Gaussian privacy profile).  The default
  ``constant="corrected"`` uses the fixed formula; ``"paper"`` reproduces Eq. (11)
  verbatim for comparison; ``"analytic"`` uses the exact analytic Gaussian mechanism
  (Balle & Wang 2018) for ``c0``, the smallest valid constant.
* Validity: both the corrected and analytic constants are valid for every
  ``epsilon > 0`` and ``0 < delta < 1`` (the tail-bound argument does not need
  Theorem 1's ``epsilon < 1``); we refuse ``epsilon <= 0``, ``delta`` outside
  ``(0, 1)``, ``B <= 0`` and non-positive training parameters.  The classic
  "Full DP" baseline (Theorem 1) is refused for ``epsilon >= 1``.
* ``E`` ("local epochs", Theorem 2 only) is the number of *clipped gradient steps*:
  Eq. (2) and Algorithm 2 take one full-gradient step per "epoch".  With minibatch SGD
  pass ``local_steps = epochs * batches_per_epoch``.  (Algorithm 2's ``while e <= E``
  starting at 0 is an off-by-one; we count ``E`` steps.)  The record-level bound counts
  steps the same way (:func:`protocols.privacy.local_sgd_sensitivity`).
* Algorithm 2 line 13 compares with ``w_g^t`` which the client does not have yet;
  we use the global model the client received at the start of the round.
* ``P_j -> 0`` (local layer equal to global) makes ``sigma_j`` explode; the paper's
  claim that the cap ``B`` prevents this is wrong (``B`` is an upper cap).  We floor
  ``P_j`` at ``min_kl``: this only *lowers* sigma where it would be astronomically
  large and keeps ``sigma_j >= c0 Delta_f / eps`` (so privacy is unaffected as long
  as ``min_kl <= B``).  The client uses ``min_kl = B / ladp-max-boost`` (default 3): a
  layer's noise is at most 3x the floor.  With a floor of 1e-12 a layer that barely moved
  (a 2-entry bias, KL ~1e-11) got up to 1e5x the floor noise: on breast-cancer at epsilon 1
  three of four default runs were stopped by the divergence guard; with 3 none were
  (0.88-0.90).  Digits is unchanged within its run-to-run spread (0.32-0.67 over five runs,
  0.35-0.47 before).  The boost is extra noise that buys no privacy: the guarantee comes
  from the floor.  Note KL between softmaxes of whole layers is tiny (typically
  1e-7..1e-3), so ``B`` must be chosen on that scale or the noise is huge.
* KL direction follows Eq. (8), ``KL(local || global)``, not torch's
  ``kl_div(input, target)`` argument order mentioned in Algorithm 3.
* A "layer" is one entry of the ``dict`` (e.g. one state_dict tensor; weight and
  bias of a module are separate layers unless the caller concatenates them).
* Data-dependent noise scale (fixed): Algorithm 2 selects layers and sets ``P_j`` from the trained
  local model, so ``sigma_j`` is a function of the private data; one record that moves the KL across
  ``[min_kl, B]`` changes the noise std up to ``B / min_kl`` times, and the upload's own noise reveals
  it (``cancelfl audit --method ladp``, canary ``adaptive``: epsilon_lb 5.3 against a claimed 1).  The
  client therefore uses :func:`plan_public_noise`: selection on the received global model and ``P_j``
  from :func:`public_estimates` (the KL between the last two published global models, sent by the
  server), i.e. the layer's change one round late.  :func:`plan_layer_noise` keeps the paper's form.
* Unselected layers are released without noise, so the model-level guarantee only covers the
  selected layers (the run then reports epsilon infinite).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy.special import log_softmax

from protocols import prg
from protocols.privacy import analytic_gaussian_sigma, classic_gaussian_sigma
from protocols.privacy.mechanisms import check_eps_delta

__all__ = [
    "LayerNoise",
    "sensitivity",
    "softmax_kl",
    "privacy_estimate",
    "theorem3_c0_paper",
    "theorem3_c0_corrected",
    "theorem3_c",
    "layer_sigma",
    "plan_layer_noise",
    "plan_public_noise",
    "public_estimates",
    "apply_layer_noise",
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
    :func:`protocols.privacy.record_sensitivity` instead (module docstring).
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
    in general (see module docstring); kept for comparison only.
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
    l2 = math.log(2.0 / (math.pi * delta**2))
    m = max(1.0, math.sqrt(l2)) if l2 > 0 else 1.0
    return (m + math.sqrt(m * m + 2.0 * epsilon)) / 2.0


def round_epsilon(epsilon: float, delta: float, rounds: int) -> float:
    """Per-round Theorem 3 epsilon whose ``rounds`` releases are ``(epsilon, delta)``-DP over the whole run.

    Each round is a Gaussian release with multiplier ``z(e) = c0(e, delta) / e`` (corrected constant,
    :func:`theorem3_c0_corrected`); ``rounds`` of them compose exactly (Gaussian DP,
    :func:`protocols.privacy.gdp_epsilon`).  ``z`` falls as ``e`` grows, so the largest ``e`` whose
    composition stays within ``epsilon`` is found by bisection (to 1e-9 relative).  Client and server
    both call this: run-config ``epsilon`` is the whole-run target, as for every method.
    """
    from protocols.privacy import gdp_epsilon

    check_eps_delta(epsilon, delta)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")

    def spent(e: float) -> float:
        return gdp_epsilon(theorem3_c0_corrected(e, delta) / e, rounds, delta)

    lo, hi = 0.0, float(epsilon)
    while spent(hi) <= epsilon:  # a single round's bound is loose: the per-round value may exceed the target
        lo, hi = hi, 2.0 * hi
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
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Algorithm 4: add ``N(0, sigma_j^2)`` entry-wise to every selected layer.

    ``rng`` is a numpy Generator or a 32-byte seed (then layer ``j``'s noise comes
    from ``protocols.prg.gaussian`` under label ``"ladp/<name>"``, reproducible
    across machines).  Returns ``(noisy_layers, noise_l2_norm_per_layer)``;
    unselected layers are returned unchanged (copied) with norm 0.0.  Floating
    layers keep their dtype; noise is generated in float64.
    """
    if set(layers) != set(plan):
        raise ValueError("plan and layers have different layer names")
    noisy: dict[str, np.ndarray] = {}
    report: dict[str, float] = {}
    for name, layer in layers.items():
        arr = np.asarray(layer)
        out_dtype = arr.dtype if np.issubdtype(arr.dtype, np.floating) else np.float64
        entry = plan[name]
        if not entry.selected or entry.sigma == 0.0:
            noisy[name] = arr.astype(out_dtype, copy=True)
            report[name] = 0.0
            continue
        if not math.isfinite(entry.sigma):
            raise ValueError(f"layer {name!r}: non-finite sigma")
        if isinstance(rng, bytes):
            noise = prg.gaussian(prg.derive_subseed(rng, f"ladp/{name}"), arr.size, entry.sigma)
        else:
            noise = rng.normal(0.0, entry.sigma, arr.size)
        noise = noise.reshape(arr.shape)
        noisy[name] = (arr.astype(np.float64) + noise).astype(out_dtype)
        report[name] = float(np.linalg.norm(noise.ravel()))
    return noisy, report
