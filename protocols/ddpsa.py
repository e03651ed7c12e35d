"""DDP-SA client-side local DP step (Wei et al., Algorithm 2, client loop), Flower-free math.

For one client and one round::

    g_j      <- per-sample gradient of sample j, clipped: g_j / max(1, ||g_j||_1 / Delta)
    g_tilde  <- (sum_j g_j + Lap(0, Delta_1/eps)^d) / N_i

The noise scale is ``Delta_1 / eps``, ``Delta_1`` = :func:`protocols.privacy.l1_sensitivity` (``Delta`` zero-out,
``2 Delta`` replace-one): ``N_i`` is published, so sizes are fixed, not the paper's add/remove.
``"distributed"`` noise (:func:`distributed_laplace_share`) gives each of ``n``
participants ``Gamma(1/n', b) - Gamma(1/n', b)``, ``n' = n - max(1, floor(f n)) - floor(d n)``
(:func:`honest_participants`: ``f`` the colluding, ``d`` the dropout fraction; at least one share is left out
because a receiving participant knows its own, the paper counts every participant's), so ``n'`` honest shares sum to one
central ``Lap(b)``, which any sum over at least ``n - floor(d n)`` participants (:func:`fewest_summed`) holds;
fewer give the epsilon :func:`gamma_difference_epsilon` returns.  With ``ddpsa-centering`` the linear model's
per-sample gradient ``(p - e_y) x^T`` is first replaced by
``(p - e_y - m 1) x^T``, ``m`` the median of ``p - e_y`` over the classes (:func:`centred_cross_entropy`): softmax
is invariant to a shift common to all classes, so both steps give the same model function, and the median is the
shift of least L1 norm (at the zero model ``||p - e_y||_1`` falls from ``2 (1 - 1/C)`` to 1).
``"gaussian"`` noise (opt-in) clips each sample in L2 instead (``||g_j||_2 <= Delta``, L2 sensitivity
``Delta_2`` = :func:`~protocols.privacy.l1_sensitivity`'s same factor times ``Delta``) and gives each participant
``N(0, (z Delta_2)^2 / n')`` (:func:`gaussian_share_std`), ``z`` = :func:`gaussian_multiplier`, cdp's calibration
(:func:`protocols.privacy.noise_multiplier`: ``T`` unsampled releases under RDP at ``(epsilon, delta)``): what
holds is that any ``n'`` honest shares sum to ``N(0, (z Delta_2)^2)``, the noise cdp's server adds, so the
released sum is (epsilon, delta)-DP as cdp's mean is, whatever the ``floor(f n)`` colluders add or subtract.
With ``k < n'`` honest shares present the noise is ``N(0, (k/n') (z Delta_2)^2)``: a Gaussian release of
multiplier :func:`present_multiplier` ``z sqrt(k/n')``, which Gaussian-DP composition charges exactly.  The median
centring is for L1 only (in L2 the least-norm shift of ``p - e_y`` is its mean, 0), so Gaussian rounds skip it.
Pure epsilon-DP costs noise of norm about ``d Delta_2 / epsilon`` in ``d`` dimensions (``Delta_1 <= sqrt(d)
Delta_2``), a Gaussian about ``sqrt(d log(1/delta)) Delta_2 / epsilon``: at ``d`` ~ 10^4 the Laplace modes cannot
reach cdp's accuracy, the Gaussian one adds cdp's noise.
Noise comes from :mod:`protocols.prg` with a fresh ``os.urandom`` seed unless one is given.  These
numpy functions work on materialised per-sample gradients; the client uses
:func:`protocols.per_example.clipped_grad_sum` (``norm="l1"``), which the tests check agrees.
Trust assumptions: ``docs/methods/ddpsa.md``.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from numpy.typing import ArrayLike, NDArray
from scipy.special import gammaln, kve
from torch import Tensor, nn

from protocols.methods.ddpsa import NOISE_MODES, fewest_summed
from protocols.privacy import (
    Accountant,
    DpCompositionAccountant,
    GdpAccountant,
    PldAccountant,
    l1_sensitivity,
    laplace_scale,
    noise_multiplier,
)

__all__ = [
    "NOISE_MODES",
    "RANGE_MARGIN",
    "ROUNDING_MARGIN",
    "central_scale",
    "centred_cross_entropy",
    "clip_norm",
    "colluders",
    "composition_accountant",
    "distributed_gaussian_share",
    "distributed_laplace_share",
    "gamma_difference_epsilon",
    "gamma_noise",
    "gaussian_multiplier",
    "gaussian_share_std",
    "fewest_summed",
    "honest_participants",
    "honest_present",
    "known_shares",
    "is_linear_classifier",
    "l1_clip",
    "laplace_noise",
    "ldp_noisy_mean",
    "min_codec_range",
    "min_frac_bits",
    "present_multiplier",
]


def composition_accountant(composition: str, noise: str = "distributed") -> Accountant:
    """The empty accountant a run's rounds compose in (run-config ``ddpsa-composition``, ``ddpsa-noise``), on both ends.

    The server's ledger and every client's (:mod:`client.ledger`) compose the same rounds with it, so both
    report the same epsilon.  Laplace rounds: ``"basic"`` pure-epsilon sum (Theorem 2), ``"advanced"`` the smaller
    of the basic and advanced bounds (Theorem 2, both valid), ``"pld"`` the privacy-loss distribution.  Gaussian
    rounds (``noise = "gaussian"``): their exact Gaussian-DP composition (:class:`~protocols.privacy.GdpAccountant`,
    what a client's ledger reports for unsampled Gaussians; never above the RDP figure :func:`gaussian_multiplier`
    is calibrated with).

    Raises:
        ValueError: an unknown composition.
    """
    if noise == "gaussian":
        return GdpAccountant()
    if composition == "pld":
        return PldAccountant()
    if composition in ("basic", "advanced"):
        return DpCompositionAccountant(composition="best" if composition == "advanced" else "basic")
    raise ValueError(f"unknown ddpsa composition {composition!r} (use 'basic', 'advanced' or 'pld')")


class _MedianCentred(torch.autograd.Function):
    """Identity on the logits; the backward pass subtracts each row's median over the last (class) axis."""

    generate_vmap_rule = True

    @staticmethod
    def forward(logits: Tensor) -> Tensor:
        return logits.clone()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 - torch's signature
        pass

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # noqa: ANN001 - torch's signature
        return grad - grad.median(dim=-1, keepdim=True).values


def centred_cross_entropy(outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-example cross-entropy whose gradient w.r.t. the logits is ``p - e_y - median_k(p - e_y)``.

    The value is the cross-entropy itself.  For the linear model (:func:`is_linear_classifier`) the per-sample
    gradient ``(p - e_y - m 1) [x, 1]^T`` differs from the true one by a row common to all classes, which moves every
    logit of every input by the same amount: the step gives the same softmax, and the median ``m`` makes the L1
    norm ``||p - e_y - m 1||_1 ||[x, 1]||_1`` the least over all such shifts (module docstring).  With hidden layers
    it would change their gradients, so it is for the linear model only.
    """
    return F.cross_entropy(_MedianCentred.apply(outputs), targets, reduction="none")


def is_linear_classifier(model: nn.Module) -> bool:
    """True when all the model's trainable parameters belong to one ``nn.Linear`` (the linear model).

    Only there does :func:`centred_cross_entropy` leave the step's model function unchanged.
    """
    owners = [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    return len(owners) == 1 and isinstance(owners[0], nn.Linear)


def laplace_noise(size: int, scale: float, *, seed: bytes | None = None) -> NDArray[np.float64]:
    """``size`` i.i.d. Lap(0, scale) draws from the CSPRNG (fresh os.urandom seed if None)."""
    # Lazy import keeps this module importable before/without the PRG module.
    from protocols.prg import laplace

    if not scale > 0:
        raise ValueError(f"Laplace scale must be > 0, got {scale!r}")
    return np.asarray(
        laplace(os.urandom(32) if seed is None else seed, int(size), float(scale)),
        dtype=np.float64,
    )


def l1_clip(per_sample: ArrayLike, clip: float) -> NDArray[np.float64]:
    """Clip each sample (axis 0) to L1 norm ``<= clip``: ``g / max(1, ||g||_1 / clip)``.

    Args:
        per_sample: array of shape ``(B, ...)``; the norm is over all non-batch axes.
        clip: the threshold Delta (> 0).
    """
    if not clip > 0:
        raise ValueError(f"clipping threshold Delta must be > 0, got {clip!r}")
    g = np.asarray(per_sample, dtype=np.float64)
    if g.ndim < 1 or g.shape[0] == 0:
        raise ValueError("per_sample must have a non-empty leading batch axis")
    norms = np.abs(g.reshape(g.shape[0], -1)).sum(axis=1)
    factor = np.maximum(1.0, norms / clip)
    return g / factor.reshape((-1,) + (1,) * (g.ndim - 1))


def ldp_noisy_mean(
    per_sample: ArrayLike, clip: float, epsilon: float, *, adjacency: str, seed: bytes | None = None
) -> NDArray[np.float64]:
    """Algorithm 2 client step in numpy: ``(sum_j clip(g_j) + Lap(Delta_1/eps)) / B`` (``Delta_1`` for ``adjacency``).

    Returns an array of shape ``per_sample.shape[1:]`` (float64).
    """
    clipped = l1_clip(per_sample, clip)
    total = clipped.sum(axis=0)
    scale = laplace_scale(l1_sensitivity(clip, adjacency=adjacency), epsilon)
    noise = laplace_noise(total.size, scale, seed=seed).reshape(total.shape)
    return (total + noise) / clipped.shape[0]


# ----------------------------------------------------------------------------- distributed noise
def colluders(participants: int, collude_frac: float, per_round: int = 0) -> int:
    """``floor(f max(n, per_round))``: the colluding participants a round's shares are sized for.

    ``per_round``: the run's clients per round, so a server that shows a shorter list cannot shrink them (the victim
    and one colluder of 4 at ``f = 1/4``: ``floor(f n) = 0``, each share half the Laplace; the colluder's subtracted,
    a Gamma(1/2, b) difference, no finite epsilon).
    """
    return math.floor(collude_frac * max(int(participants), int(per_round)))


def known_shares(participants: int, collude_frac: float, per_round: int = 0) -> int:
    """Shares of ``participants`` a receiver of the sum may know: :func:`colluders`, at least 1 with 2 participants or more.

    The colluders' shares, and a participant's own: every participant receives the published model and knows the
    share it added, so the model's guarantee counts on the others' alone (:mod:`protocols.privacy.receiver`).  A
    lone participant's other receivers know no share.
    """
    known = colluders(participants, collude_frac, per_round)
    return max(known, 1) if participants >= 2 else known


def honest_participants(participants: int, collude_frac: float, dropout_frac: float = 0.0, *,
                        per_round: int = 0) -> int:
    """``n' = n - max(1, floor(f N)) - floor(d n)``: the shares counted on to make one central noise.

    Any sum over at least :func:`fewest_summed` of the ``n`` participants holds at least ``n'`` shares unknown to
    the parameter server with at most ``floor(f N)`` colluders (``N = max(n, per_round)``, :func:`colluders`) and to
    any receiving participant (:func:`known_shares`; one participant: ``n' = 1``).

    Raises:
        ValueError: ``participants < 1``, a fraction outside ``[0, 1)``, or no share left to count on.
    """
    if participants < 1:
        raise ValueError(f"participants must be >= 1, got {participants!r}")
    for name, frac in (("colluding", collude_frac), ("dropout", dropout_frac)):
        if not (math.isfinite(frac) and 0 <= frac < 1):
            raise ValueError(f"{name} fraction must be in [0, 1), got {frac!r}")
    counted = int(participants) - known_shares(participants, collude_frac, per_round) - \
        math.floor(dropout_frac * participants)
    if counted < 1:
        raise ValueError(f"{participants} participants leave no share to count on with a colluding fraction of "
                         f"{collude_frac:g} and a dropout fraction of {dropout_frac:g}")
    return counted


def honest_present(participants: int, pushed: int, collude_frac: float, per_round: int = 0) -> int:
    """Shares unknown to the sum's receivers a sum over ``pushed`` of ``participants`` holds: ``pushed - known``.

    ``known`` = :func:`known_shares` (the colluders', at least a receiving participant's own).
    """
    return int(pushed) - known_shares(participants, collude_frac, per_round)


def gamma_noise(size: int, shape: float, scale: float, *, seed: bytes | None = None) -> NDArray[np.float64]:
    """``size`` i.i.d. Gamma(shape, scale) draws from the CSPRNG (fresh os.urandom seed if None).

    Marsaglia & Tsang's squeeze method on the PRG's normals and uniforms; for ``shape < 1`` the
    draw is ``Gamma(shape + 1) U^(1/shape)``.
    """
    from protocols.prg import gaussian, uniform
    from protocols.prg.stream import derive_subseed

    if not (math.isfinite(shape) and shape > 0):
        raise ValueError(f"Gamma shape must be > 0, got {shape!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"Gamma scale must be > 0, got {scale!r}")
    seed = os.urandom(32) if seed is None else seed
    a = shape + 1.0 if shape < 1 else float(shape)
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    out = np.empty(int(size), dtype=np.float64)
    todo = np.arange(int(size))
    attempt = 0
    while todo.size:
        x = gaussian(derive_subseed(seed, f"gamma/normal/{attempt}"), todo.size)
        u = uniform(derive_subseed(seed, f"gamma/uniform/{attempt}"), todo.size)
        v = (1.0 + c * x) ** 3
        with np.errstate(divide="ignore", invalid="ignore"):
            ok = (v > 0) & (np.log(u) < 0.5 * x * x + d - d * v + d * np.log(np.where(v > 0, v, 1.0)))
        out[todo[ok]] = d * v[ok]
        todo = todo[~ok]
        attempt += 1
    if shape < 1:
        u = uniform(derive_subseed(seed, "gamma/boost"), out.size)
        with np.errstate(divide="ignore"):
            out *= np.exp(np.log(u) / shape)  # U^(1/shape); U = 0 gives 0
    return out * scale


def distributed_laplace_share(size: int, scale: float, honest: int, *, seed: bytes | None = None
                              ) -> NDArray[np.float64]:
    """One participant's share of a central ``Lap(scale)``: ``Gamma(1/honest, scale) - Gamma(1/honest, scale)``.

    Any ``honest`` such shares sum to exactly ``Lap(scale)`` per coordinate (module docstring).
    """
    from protocols.prg.stream import derive_subseed

    if honest < 1:
        raise ValueError(f"honest participants must be >= 1, got {honest!r}")
    seed = os.urandom(32) if seed is None else seed
    shape = 1.0 / honest
    return (gamma_noise(size, shape, scale, seed=derive_subseed(seed, "plus"))
            - gamma_noise(size, shape, scale, seed=derive_subseed(seed, "minus")))


def _log_density(z: float, shape: float) -> float:
    """Log of the density of ``Gamma(shape, 1) - Gamma(shape, 1)`` at ``z`` (``shape > 1/2``; z = 0 allowed).

    ``p(z) = (|z|/2)^(a-1/2) K_(a-1/2)(|z|) / (sqrt(pi) Gamma(a))``; ``p(0) = Gamma(a-1/2) / (2 sqrt(pi) Gamma(a))``.
    """
    nu = shape - 0.5
    norm = 0.5 * math.log(math.pi) + float(gammaln(shape))
    if z == 0:
        return float(gammaln(nu)) - math.log(2.0) - norm
    z = abs(z)
    return nu * math.log(z / 2.0) + math.log(float(kve(nu, z))) - z - norm


def gamma_difference_epsilon(shape: float, sensitivity_over_scale: float, dim: int) -> float:
    """Pure-DP epsilon of adding ``Gamma(shape, b) - Gamma(shape, b)`` i.i.d. to ``dim`` coordinates.

    For a query of L1 sensitivity ``S b``: ``shape >= 1`` is ``Lap(b)`` plus independent noise, so
    epsilon is ``S`` (post-processing).  For ``1/2 < shape < 1`` the negative log-density ``h`` is
    concave on ``[0, inf)`` and symmetric, so the worst log-ratio of a shift ``s`` is
    ``g(s) = h(s) - h(0)`` (concave, ``g(0) = 0``) and the worst shift of L1 norm ``S`` spreads evenly
    over all coordinates: epsilon = ``dim * g(S / dim)``.  For ``shape <= 1/2`` the density is
    unbounded at 0 and no finite epsilon holds (returns ``inf``).

    Args:
        shape: Gamma shape ``a`` of each side (honest shares present / shares needed).
        sensitivity_over_scale: ``S`` = L1 sensitivity / ``b`` (= ``eps_t`` at ``b = Delta_1 / eps_t``).
        dim: number of noised coordinates.
    """
    if not (math.isfinite(sensitivity_over_scale) and sensitivity_over_scale > 0) or dim < 1:
        raise ValueError(f"need S > 0 and dim >= 1, got S={sensitivity_over_scale!r}, dim={dim!r}")
    if shape >= 1:
        return float(sensitivity_over_scale)
    if shape <= 0.5:
        return math.inf
    s = sensitivity_over_scale / dim
    return float(dim * (_log_density(0.0, shape) - _log_density(s, shape)))


# ----------------------------------------------------------------------------- distributed Gaussian noise
def clip_norm(noise: str) -> str:
    """The per-sample clipping norm of a ``ddpsa-noise`` mode: ``"l2"`` for ``"gaussian"``, else ``"l1"``."""
    return "l2" if noise == "gaussian" else "l1"


def gaussian_multiplier(epsilon: float, delta: float, rounds: int) -> float:
    """``z`` of Gaussian rounds: cdp's calibration (:func:`protocols.privacy.noise_multiplier`), the same figure.

    The smallest noise std / L2 sensitivity whose ``rounds`` unsampled releases are (epsilon, delta)-DP under RDP.
    """
    return noise_multiplier(float(epsilon), float(delta), int(rounds))


def gaussian_share_std(sensitivity: float, multiplier: float, honest: int) -> float:
    """Std of one participant's Gaussian share: ``z Delta_2 / sqrt(n')`` (``n'`` shares sum to ``N(0, (z Delta_2)^2)``).

    Raises:
        ValueError: a sensitivity or multiplier not > 0, or ``honest < 1``.
    """
    if not (math.isfinite(sensitivity) and sensitivity > 0 and math.isfinite(multiplier) and multiplier > 0):
        raise ValueError(f"need sensitivity > 0 and multiplier > 0, got {sensitivity!r}, {multiplier!r}")
    if honest < 1:
        raise ValueError(f"honest participants must be >= 1, got {honest!r}")
    return float(multiplier) * float(sensitivity) / math.sqrt(honest)


def distributed_gaussian_share(size: int, std: float, *, seed: bytes | None = None) -> NDArray[np.float64]:
    """One participant's share: ``size`` i.i.d. ``N(0, std^2)`` draws from the CSPRNG (fresh os.urandom seed if None)."""
    from protocols.prg import gaussian

    if not (math.isfinite(std) and std > 0):
        raise ValueError(f"Gaussian share std must be > 0, got {std!r}")
    return np.asarray(gaussian(os.urandom(32) if seed is None else seed, int(size), float(std)), dtype=np.float64)


def present_multiplier(multiplier: float, honest: int, present: int) -> float:
    """Multiplier of the Gaussian noise ``present`` honest shares of ``honest`` leave: ``z sqrt(min(present, n') / n')``.

    ``present <= 0`` gives 0 (no noise counted on: no guarantee).
    """
    if honest < 1:
        raise ValueError(f"honest participants must be >= 1, got {honest!r}")
    if present <= 0:
        return 0.0
    return float(multiplier) * math.sqrt(min(int(present), int(honest)) / int(honest))


# ----------------------------------------------------------------------------- fixed-point grid
#: A round whose noise is split over its participants keeps their summed fixed-point round-off this many times
#: below the central noise's scale (:func:`min_frac_bits`).
ROUNDING_MARGIN = 16.0


def central_scale(clip: float, *, adjacency: str, epsilon: float, multiplier: float = 0.0) -> float:
    """The scale of a round's central noise: Laplace ``b = Delta_1 / eps_t``, or ``z Delta_2`` with a ``multiplier``."""
    sens = l1_sensitivity(clip, adjacency=adjacency)
    return float(multiplier) * sens if multiplier > 0 else laplace_scale(sens, epsilon)


def min_frac_bits(participants: int, scale: float) -> int:
    """Fewest fractional bits of a codec whose encodings, summed over ``participants``, keep a noise of ``scale``.

    Each client's encoding rounds its noisy sum to the grid ``2^-frac_bits``: a change of up to half a step that
    depends on its data, which only the central noise hides (a share alone is a fraction of it).  The grid must keep
    ``participants 2^-frac_bits ROUNDING_MARGIN <= scale``: a coarser one lets the rounding decide the released value
    (``frac_bits = 0`` against ``b = 0.01``: a record moving a coordinate across a rounding boundary is told apart
    94 % against 6 %, while the round charges ``eps_t = 1``).

    Raises:
        ValueError: ``participants < 1`` or a scale that is not a positive finite number.
    """
    if participants < 1 or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"need participants >= 1 and a scale > 0, got {participants!r}, {scale!r}")
    return max(0, math.ceil(math.log2(participants * ROUNDING_MARGIN / scale)))


#: A codec's range holds a client's noisy sum unless a coordinate's noise passes this many central scales: a share
#: (or the local Laplace) exceeds ``t`` with probability at most ``2 exp(-t / scale)``, here ``3.2e-28``.
RANGE_MARGIN = 64.0


def min_codec_range(dataset_size: int, clip: float, scale: float) -> float:
    """The least codec range ``max_abs`` a client's noisy sum needs: ``N_i clip + RANGE_MARGIN scale`` per coordinate.

    Each of the ``N_i`` = ``dataset_size`` clipped per-sample gradients has every coordinate within ``clip`` (its L1
    or L2 norm is), so the clipped sum's are within ``N_i clip``.  The noise is the local ``Lap(b)``, a share
    ``Gamma(1/n', b) - Gamma(1/n', b)`` (each Gamma is dominated by ``Exp(b)``) or a Gaussian share of std at most
    ``scale``: past ``RANGE_MARGIN`` scales with probability at most ``2 exp(-RANGE_MARGIN)``.  A client refuses a
    codec with a smaller range before any work: whether its sum fits would otherwise be a function of a sum that
    carries only its share of the noise, decided after the round is charged.

    Raises:
        ValueError: ``dataset_size < 0``, or a clip or scale that is not a positive finite number.
    """
    if dataset_size < 0 or not (math.isfinite(clip) and clip > 0 and math.isfinite(scale) and scale > 0):
        raise ValueError(f"need dataset_size >= 0, clip > 0 and scale > 0, got {dataset_size!r}, {clip!r}, {scale!r}")
    return int(dataset_size) * float(clip) + RANGE_MARGIN * float(scale)
