"""Record-level (per-example) L2 sensitivity of a client's local training: one home for every method.

Every method that protects a *record* (one training example: the unit of the papers' definitions of
neighbouring datasets) trains with per-example clipping (:func:`protocols.task.training.clipped_sgd`) and
calibrates its noise to :func:`local_sgd_sensitivity` of that training.  With the default regime (one
full-batch step per round) this is ``C lr / |D_i|`` under zero-out adjacency (run-config ``adjacency``, the
default: one record's gradient replaced by zero, dataset sizes fixed, Opacus' and dp-accounting's DP-SGD
convention) and Lemma 1 of NADP-FL, ``2 C lr / |D_i|``, under replace-one adjacency.  DDP-SA's clipped per-sample
gradient sum: :func:`l1_sensitivity`.
"""

from __future__ import annotations

import math
import sys

from protocols.adjacency import ADJACENCIES, adjacency_factor
from protocols.privacy.events import Event, at_sensitivity

__all__ = ["ADJACENCIES", "CLIENT_RECORD_FACTOR", "FLOAT32_ROUNDING_MARGIN", "FLOAT32_ROUNDOFF", "FLOAT64_LARGEST_RANGE",
           "FLOAT64_ROUNDOFF", "FLOAT64_SMALLEST_RESOLVABLE", "FLOAT_RANGE_MARGIN", "adjacency_factor", "l1_sensitivity",
           "largest_trainable_norm", "local_sgd_sensitivity", "local_sgd_steps", "per_record", "record_sensitivity",
           "record_training_movement", "record_training_range", "record_training_resolution", "resolving_dtype",
           "smallest_resolvable"]

#: A record moves a client-level release by up to this many times its sensitivity: the client-level unit's
#: sensitivity is the clip ``C`` of the whole update (the update against none), while one record, changed under
#: either adjacency, can move the clipped update anywhere in its ball of radius ``C``: ``2 C`` apart.
CLIENT_RECORD_FACTOR = 2.0


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return value


def l1_sensitivity(clip: float, *, adjacency: str) -> float:
    """L1 sensitivity of the clipped per-sample gradient *sum* to one sample: ``Delta`` (zero-out) or ``2 Delta``.

    DDP-SA (Wei et al., Algorithm 2): each sample contributes a vector of L1 norm at most ``Delta``; zeroing it
    moves the sum by at most ``Delta``, replacing it by ``2 Delta`` (``N_i`` is published either way: sizes are
    fixed).  Gaussian rounds clip in L2 with the same factor: it is then the L2 sensitivity ``Delta_2``.
    """
    if not clip > 0:
        raise ValueError(f"clipping threshold Delta must be > 0, got {clip!r}")
    return adjacency_factor(adjacency) * float(clip)


def local_sgd_steps(dataset_size: int, *, epochs: int, batch_size: int) -> int:
    """SGD steps of ``epochs`` epochs over ``dataset_size`` records in batches of ``batch_size`` (last one smaller)."""
    return epochs * -(-int(dataset_size) // int(batch_size))


def local_sgd_sensitivity(clip: float, dataset_size: int, *, lr: float, epochs: int = 1,
                          batch_size: int | None = None, adjacency: str) -> float:
    """L2 sensitivity of local SGD with per-example clipping, valid for any loss.

    The client runs ``epochs`` epochs of mini-batch SGD (batches of
    ``batch_size``, the last one possibly smaller; ``None`` = full batch),
    each step ``w -= lr * mean_{x in batch} clip(grad_x, C)``.  Changing one
    record moves the step whose batch holds it by at most ``a C lr / b``
    (``a`` = :func:`adjacency_factor`: 1 zero-out, 2 replace-one); every *later*
    step runs from different weights, so without smoothness assumptions each
    can differ by up to ``2C lr`` (all clipped per-example gradients may change):

        Delta = a C lr / b_min + 2 C lr (steps - 1).

    For one full-batch step under replace-one this is Lemma 1's ``2C/|D_i|`` (times lr).
    The paper's linear ``2C lr steps / |D_i|`` only counts the record's direct
    contribution and is not a bound once a record can influence later steps.

    Raises:
        ValueError: a size, epoch count or batch size below 1, a non-positive clip or lr, an unknown adjacency.
    """
    n = int(dataset_size)
    if n < 1:
        raise ValueError(f"dataset_size must be >= 1, got {dataset_size!r}")
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    b = n if batch_size is None else min(int(batch_size), n)
    if b < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    steps = local_sgd_steps(n, epochs=epochs, batch_size=b)
    smallest = n - (steps // epochs - 1) * b
    c_lr = _positive("clip", clip) * _positive("lr", lr)
    return adjacency_factor(adjacency) * c_lr / smallest + 2.0 * c_lr * (steps - 1)


def record_sensitivity(cfg, dataset_size: int) -> float:
    """:func:`local_sgd_sensitivity` of the training a run config describes (clip, lr, epochs, batch size, adjacency).

    ``cfg`` is a :class:`protocols.config.RunConfig` (duck-typed: this module imports nothing of the project).
    """
    return local_sgd_sensitivity(cfg.clip, dataset_size, lr=cfg.lr, epochs=cfg.local_epochs, batch_size=cfg.batch_size,
                                 adjacency=cfg.adjacency)


def record_training_movement(cfg, dataset_size: int) -> float:
    """The most per-example-clipped local SGD on ``dataset_size`` records moves a model: ``lr clip steps``.

    Each step moves it by at most ``lr`` times a mean of vectors of norm <= ``clip``.  The signal side of the
    noise check and the honest-norm bound of the reply checks.
    """
    return cfg.lr * cfg.clip * local_sgd_steps(dataset_size, epochs=cfg.local_epochs, batch_size=cfg.batch_size)


#: Training may add at most ``1 / FLOAT32_ROUNDING_MARGIN`` of the record sensitivity by rounding the weights.
FLOAT32_ROUNDING_MARGIN = 16.0
#: Unit roundoff (round to nearest, ``|fl(a) - a| <= u |a|``) of float32 and float64.
FLOAT32_ROUNDOFF, FLOAT64_ROUNDOFF = 2.0 ** -24, 2.0 ** -53


def largest_trainable_norm(cfg, dataset_size: int, roundoff: float = FLOAT32_ROUNDOFF) -> float:
    """The largest L2 norm of a received model whose training keeps :func:`record_sensitivity` (to a margin).

    ``roundoff``: of the weights the steps are added to (:data:`FLOAT32_ROUNDOFF`, or :data:`FLOAT64_ROUNDOFF` for
    float64 weights, 2^29 times the norm).  Training the update from the received weights
    (:func:`protocols.task.training.clipped_sgd`, ``recentre``) adds the steps to weights of norm 0: its steps keep
    the sensitivity whenever this is positive, at any model norm.

    :func:`record_sensitivity` is a bound in exact arithmetic.  The model trains in floating point: each SGD step
    ``w <- w - s g`` rounds every coordinate of the product and of the sum to the grid of its magnitude, and two
    trajectories from the same model (datasets one record apart) can round apart, by up to
    ``4 u (||w_0|| + M)`` in L2 per step (``u`` = ``roundoff``, ``M`` = :func:`record_training_movement`, so that
    ``||w_t|| <= ||w_0|| + M``), a term the model's magnitude sets, whatever the clip.  A server that sends a model
    with large weights would grow it past the sensitivity the noise is sized for (a model offset by ``2^20``
    moved an ldp upload 5.3 times the sensitivity for one record).  This returns the norm at which the steps' rounding
    reaches ``record_sensitivity / FLOAT32_ROUNDING_MARGIN`` (0 when none does).
    The rounding inside one step's clipped sum is relative to the clip, not to the model, and is not counted; nor
    is the precision the gradients are evaluated at (:func:`local_sgd_sensitivity` bounds every later step whatever
    the weights).
    """
    steps = local_sgd_steps(dataset_size, epochs=cfg.local_epochs, batch_size=cfg.batch_size)
    allowed = record_sensitivity(cfg, dataset_size) / FLOAT32_ROUNDING_MARGIN
    return max(allowed / (4.0 * roundoff * steps) - record_training_movement(cfg, dataset_size), 0.0)


#: A training dtype holds per-example-clipped local SGD when :func:`record_training_range` is below its largest finite
#: value over this margin (room for the steps' rounding).
FLOAT_RANGE_MARGIN = 4.0


def record_training_range(cfg, dataset_size: int, model_norm: float) -> float:
    """The largest magnitude of clipped local SGD from a model of norm ``model_norm``: ``max(model_norm + M, b clip, lr)``.

    Per-example-clipped SGD on ``dataset_size`` records: the weights stay within ``model_norm + M`` (``M`` =
    :func:`record_training_movement`), a step's sum of ``b`` (the batch) clipped gradients within ``b clip`` and its
    factor ``lr / b`` within ``lr``; every other value is one record's own (an overflow there drops that record,
    :func:`protocols.per_example.clip_factors`).  Training in a dtype whose largest finite value is below this may
    overflow a weight to ``inf`` where the records' steps add up past it, a function of the data no noise covers (an
    upload coordinate ``inf`` or not).  Public: the run config, ``|D_i|`` and the received model.
    """
    batch = min(int(cfg.batch_size), max(int(dataset_size), 1))
    return max(float(model_norm) + record_training_movement(cfg, dataset_size), batch * float(cfg.clip), float(cfg.lr))


def record_training_resolution(cfg, dataset_size: int) -> float:
    """The smallest magnitude per-example-clipped local SGD must resolve: ``min(clip, lr / b, lr clip / b)``.

    The clip (each record's clipped gradient, whose norm is compared with it), a step's factor ``lr / b`` and one
    record's step ``lr clip / b`` (``b`` the batch).  A training dtype resolves them when this is at least
    :func:`smallest_resolvable` of it.  Public: the run config and ``|D_i|``.
    """
    batch = min(int(cfg.batch_size), max(int(dataset_size), 1))
    lr, clip = float(cfg.lr), float(cfg.clip)
    return min(clip, lr / batch, lr * clip / batch)


def smallest_resolvable(largest: float, smallest_normal: float) -> float:
    """The smallest :func:`record_training_resolution` a dtype (its largest finite and smallest normal numbers) holds.

    ``FLOAT_RANGE_MARGIN sqrt(largest) smallest_normal``: a kept record's gradient norm is at most ``sqrt(largest)``
    (its square is finite; a larger one drops the record, :func:`protocols.per_example.clip_factors`), so its
    clipping factor ``clip / norm`` and every step are normal numbers, rounded relative to their size.  Below it
    they are subnormal, rounded to a fixed grid: a clip of ``1e-30`` in float32 (a record's squared gradient norm
    rounds to 0, its factor to 1) would let one record's gradient of norm ``2e-24`` into the sum unclipped, 2 million
    times the clip.  float32: about ``8.7e-19``; float64: about ``1.2e-153``.

    A client-level clip (``privacy-unit = "client"``) at least float64's keeps the clipped update's factors, the
    noise std (proportional to the clip) and their squares (the variances the floors add up) normal numbers.
    """
    return FLOAT_RANGE_MARGIN * math.sqrt(float(largest)) * float(smallest_normal)


#: :func:`smallest_resolvable` of float64 (about ``1.19e-153``): the smallest clip, and record-level training
#: resolution, any client path resolves (every one clips in float64 at the least).
FLOAT64_SMALLEST_RESOLVABLE = smallest_resolvable(sys.float_info.max, sys.float_info.min)
#: The largest :func:`record_training_range` float64 holds: its largest finite value over :data:`FLOAT_RANGE_MARGIN`.
FLOAT64_LARGEST_RANGE = sys.float_info.max / FLOAT_RANGE_MARGIN


def resolving_dtype(resolution: float, dtype: str = "float32") -> str | None:
    """``dtype``, or float64 where ``dtype`` does not resolve ``resolution`` (:func:`smallest_resolvable`); None if neither.

    The dtype a full-batch per-example-clipped sum with no step (DDP-SA's, the MP family's gradient at W-hat) is
    computed in, ``resolution`` its clip: below :func:`smallest_resolvable` a record's squared gradient norm may round
    to 0 and the record enter the sum unclipped.  Also the dtype a client-level update is clipped and noised in
    (float64; :func:`client.env.client_level_update`), ``resolution`` its clip.  Public: the run config.
    """
    import numpy as np

    for name in (dtype, "float64"):
        info = np.finfo(name)
        if float(resolution) >= smallest_resolvable(float(info.max), float(info.tiny)):
            return name
    return None


def per_record(event: Event) -> Event:
    """What a client-level release (``privacy-unit = "client"``) spends per record: :data:`CLIENT_RECORD_FACTOR`."""
    return at_sensitivity(event, CLIENT_RECORD_FACTOR)
