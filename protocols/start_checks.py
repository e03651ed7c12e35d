"""Checks of a run before round 1 against the floors its clients apply (``ConfigError`` naming the keys).

Each client refuses, on public values, a round it cannot run safely (:mod:`client.env`): a setting that fails such
a rule for every client would have every round refused after the clients started.  :func:`start_checks` is the
one start sequence every engine applies before any message (the launcher's preflight, the ServerApp, the
in-process engine): :func:`check_clip_floor` (run config) and, where the data is local, :func:`check_sizes` (the
clients' record counts: the method card's ``size_check`` and :func:`check_training_floors`); it returns the start
notes (:func:`protocols.adjustments.adjustments`).  :class:`protocols.config.RunConfig` leaves them out: a config
is also what a server sends a client it tests.
"""

from __future__ import annotations

from collections.abc import Sequence, Sized
from typing import Any

from protocols.methods import method_spec
from protocols.options import ConfigError

__all__ = ["START_NOTES_SHOWN_ENV", "check_clip_floor", "check_sizes", "check_training_floors", "start_checks"]

#: Environment variable the ``cancelfl`` launcher sets (``1``) for the Flower processes of a run whose start notes
#: it has shown already; the ServerApp then does not log them again (a plain ``flwr run`` leaves it unset).
START_NOTES_SHOWN_ENV = "CANCELFL_START_NOTES_SHOWN"


def start_checks(cfg: Any, *, records: bool = True) -> list[str]:
    """The start sequence of a run: every check before round 1 on the run config and the clients' records.

    :func:`check_clip_floor`, then, where the dataset is local (not ``hub:``) and ``records``,
    :func:`check_sizes` against :func:`protocols.task.data.partitions_for`.

    Args:
        cfg: the run config (:class:`protocols.config.RunConfig`), num-clients resolved.
        records: the clients hold the run config's dataset partitions (False: a user's own ServerApp, whose
            clients' records are not known to the server).

    Returns:
        The start notes, one sentence per adjusted or costly setting (:func:`protocols.adjustments.adjustments`),
        for the caller to show once.

    Raises:
        ConfigError: settings every client would refuse, or a partitioning that leaves a client without records.
        ValueError: the dataset's files cannot be read.
    """
    from protocols.adjustments import adjustments
    from protocols.task.data import partitions_for

    check_clip_floor(cfg)
    partitions = partitions_for(cfg) if records and not cfg.dataset.startswith("hub:") else None
    if partitions is not None:
        check_sizes(cfg, partitions)
    return adjustments(cfg, partitions)


def check_sizes(cfg: Any, partitions: Sequence[Sized]) -> None:
    """The method card's ``size_check`` and :func:`check_training_floors` against each client's records (``partitions``).

    Raises:
        ConfigError: settings no round can run with these record counts, naming the keys.
    """
    sizes = sorted({len(p) for p in partitions}, reverse=True)
    check_training_floors(cfg, sizes)
    spec = method_spec(cfg.method)
    if spec.size_check is not None:
        spec.load(spec.size_check)(cfg, sizes)


def check_training_floors(cfg: Any, sizes: Sequence[int]) -> None:
    """Record-level local training (methods whose clients train, not FedSGD) float64 holds and resolves, per size.

    :func:`protocols.privacy.record_training_resolution` at least :data:`protocols.privacy.FLOAT64_SMALLEST_RESOLVABLE`
    and :func:`protocols.privacy.record_training_range` of the zero model at most
    :data:`protocols.privacy.FLOAT64_LARGEST_RANGE`: the client's own rule, on the same public values (run-config
    ``lr``, ``clip``, ``batch-size``, ``local-epochs`` and its record count).
    """
    from protocols.privacy.sensitivity import (
        FLOAT64_LARGEST_RANGE,
        FLOAT64_SMALLEST_RESOLVABLE,
        FLOAT_RANGE_MARGIN,
        record_training_range,
        record_training_resolution,
    )

    spec = method_spec(cfg.method)
    if cfg.privacy_unit != "record" or spec.guarantee(cfg.privacy_unit).unit == "none" or spec.server_step_lr:
        return
    floor, ceiling = FLOAT64_SMALLEST_RESOLVABLE, FLOAT64_LARGEST_RANGE
    keys = f"run-config 'lr' = {cfg.lr:g}, 'clip' = {cfg.clip:g}, 'batch-size' = {cfg.batch_size}"
    for n in sizes:
        if (fine := record_training_resolution(cfg, n)) < floor:
            raise ConfigError(f"{keys}: a record's clipped step ({fine:.3g}, lr / batch or lr x clip / batch on {n} "
                              f"records) is below {floor:.3g}, the smallest float64 resolves, so every client would "
                              "refuse every round (its clipping factor or step would round on the subnormal grid); "
                              "raise 'lr' or 'clip'")
        if (span := record_training_range(cfg, n, 0.0)) > ceiling:
            raise ConfigError(f"{keys}: local training on {n} records may reach {span:.3g}, beyond float64's range "
                              f"over {FLOAT_RANGE_MARGIN:g} ({ceiling:.3g}), so every client would refuse every round; "
                              "lower 'lr' or 'clip'")


def check_clip_floor(cfg: Any) -> None:
    """A DP method's ``clip`` is at least the smallest float64 resolves (``ConfigError`` naming it).

    Every client path clips in float64 at the least (:func:`protocols.privacy.resolving_dtype`): below
    :data:`protocols.privacy.FLOAT64_SMALLEST_RESOLVABLE` a record's clipping factor, or a client-level update
    and its noise, round on the subnormal grid, and every client refuses every round.
    """
    from protocols.privacy.sensitivity import FLOAT64_SMALLEST_RESOLVABLE as floor

    if method_spec(cfg.method).guarantee(cfg.privacy_unit).unit == "none":
        return
    if cfg.clip < floor:
        raise ConfigError(f"run-config 'clip' = {cfg.clip:g} is below {floor:.3g}, the smallest clip float64 resolves "
                          "(a clipping factor or the noise, proportional to the clip, would round on its subnormal "
                          "grid), so every client would refuse every round; raise 'clip'")
