"""Record-level (per-example) L2 sensitivity of a client's local training: one home for every method.

Every method that protects a *record* (one training example: the unit of the papers' definitions of
neighbouring datasets) trains with per-example clipping (:func:`client.training.clipped_sgd`) and
calibrates its noise to :func:`local_sgd_sensitivity` of that training.  With the default regime (one
full-batch step per round) this is Lemma 1 of NADP-FL, ``2 C lr / |D_i|``.
"""

from __future__ import annotations

import math

__all__ = ["local_sgd_sensitivity", "local_sgd_steps", "record_sensitivity", "record_training_movement"]


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return value


def local_sgd_steps(dataset_size: int, *, epochs: int, batch_size: int) -> int:
    """SGD steps of ``epochs`` epochs over ``dataset_size`` records in batches of ``batch_size`` (last one smaller)."""
    return epochs * -(-int(dataset_size) // int(batch_size))


def local_sgd_sensitivity(clip: float, dataset_size: int, *, lr: float, epochs: int = 1,
                          batch_size: int | None = None) -> float:
    """Replace-one L2 sensitivity of local SGD with per-example clipping, valid for any loss.

    The client runs ``epochs`` epochs of mini-batch SGD (batches of
    ``batch_size``, the last one possibly smaller; ``None`` = full batch),
    each step ``w -= lr * mean_{x in batch} clip(grad_x, C)``. Replacing one
    record changes the step whose batch holds it by at most ``2C lr / b``;
    every *later* step runs from different weights, so without smoothness
    assumptions each can differ by up to ``2C lr`` (all clipped per-example
    gradients may change). Hence

        Delta = 2 C lr (1 / b_min + (steps - 1)).

    For one full-batch step this is exactly Lemma 1's ``2C/|D_i|`` (times lr).
    The paper's linear ``2C lr steps / |D_i|`` (:func:`sensitivity`) only
    counts the record's direct contribution and is not a bound once a record
    can influence later steps through the weights, so we do not use it for
    multi-step training.
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
    return 2.0 * _positive("clip", clip) * _positive("lr", lr) * (1.0 / smallest + (steps - 1))


def record_sensitivity(cfg, dataset_size: int) -> float:
    """:func:`local_sgd_sensitivity` of the training a run config describes (``clip``, ``lr``, epochs, batch size).

    ``cfg`` is a :class:`protocols.config.RunConfig` (duck-typed: this module imports nothing of the project).
    """
    return local_sgd_sensitivity(cfg.clip, dataset_size, lr=cfg.lr, epochs=cfg.local_epochs, batch_size=cfg.batch_size)


def record_training_movement(cfg, dataset_size: int) -> float:
    """The most per-example-clipped local SGD on ``dataset_size`` records moves a model: ``lr clip steps``.

    Each step moves it by at most ``lr`` times a mean of vectors of norm <= ``clip``.  The signal side of the
    noise check and the honest-norm bound of the reply checks.
    """
    return cfg.lr * cfg.clip * local_sgd_steps(dataset_size, epochs=cfg.local_epochs, batch_size=cfg.batch_size)
