"""Settings a run adjusts, or that make it far more costly than intended: warned about at start, never silent."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence, Sized

from protocols.config import RunConfig
from protocols.methods import METHODS, ignored_settings, method_spec, options_classes
from protocols.task.data import IDX_DATASETS


def adjustments(cfg: RunConfig, partitions: Sequence[Sized] | None = None) -> list[str]:
    """One sentence per adjusted or costly setting, naming the key (shown once at start: :mod:`protocols.start_checks`).

    ``partitions``: every client's training records (:func:`protocols.task.data.partitions_for`), for
    :func:`delta_note`; None leaves that note out.
    """
    notes = [] if partitions is None else delta_note(cfg, partitions)
    k = cfg.clients_per_round
    if cfg.graph == "n-out" and cfg.n_out >= k - 1:
        notes.append(f"run-config 'n-out' = {cfg.n_out} >= clients per round - 1 = {k - 1}: the n-out graph "
                     "would connect every pair anyway, so every round uses the complete graph")
    ignored = ignored_settings(cfg)
    if ignored:
        trains = ", ".join(f"'{k}' = {v}" for k, v in method_spec(cfg.method).fixed.items())
        notes.append(f"method {cfg.method!r} does not read run-config "
                     + ", ".join(f"'{k}' = {v}" for k, v in ignored.items())
                     + f": each round its clients compute one gradient over all their records ({trains}); "
                     "the values given are ignored")
    notes.extend(other_methods_keys(cfg))
    notes.extend(privacy_keys_unread(cfg))
    spec = method_spec(cfg.method)
    if spec.start_notes is not None:
        notes.extend(spec.load(spec.start_notes)(cfg))
    if cfg.data_dir and cfg.dataset not in IDX_DATASETS:
        notes.append(f"run-config 'data-dir' = {cfg.data_dir!r} is read for the IDX datasets ({', '.join(IDX_DATASETS)}) "
                     f"only; dataset {cfg.dataset!r} does not read it: the value is ignored")
    return notes


def other_methods_keys(cfg: RunConfig) -> list[str]:
    """One sentence per method option set away from its default whose class the run's method does not read."""
    active = set(method_spec(cfg.method).options)
    notes = []
    for cls in options_classes():
        if cls in active:
            continue
        readers = ", ".join(m for m, spec in METHODS.items() if cls in spec.options)
        defaults, values = cls().as_mapping(), cfg.options_of(cls).as_mapping()
        for key, value in values.items():
            if value != defaults[key]:
                notes.append(f"method {cfg.method!r} does not read run-config '{key}' = {value!r} (a key of "
                             f"{readers or 'no registered method'}): the value is ignored")
    return notes


def privacy_keys_unread(cfg: RunConfig) -> list[str]:
    """A sentence when a method without a guarantee (FedAvg) is given ``epsilon`` or ``delta`` away from the defaults."""
    if method_spec(cfg.method).guarantee(cfg.privacy_unit).unit != "none":
        return []
    defaults = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    given = [f"'{key.replace('_', '-')}' = {getattr(cfg, key):g}" for key in ("epsilon", "delta")
             if getattr(cfg, key) != defaults[key]]
    if not given:
        return []
    return [f"method {cfg.method!r} adds no noise and claims no privacy guarantee: run-config {' and '.join(given)} "
            "is not read"]


def delta_note(cfg: RunConfig, partitions: Sequence[Sized]) -> list[str]:
    """A sentence when run-config ``delta`` is at least ``1/n``: the usual rule is ``delta << 1/n``.

    ``n``: the records of the largest client (``partitions``: each client's records) for the record unit, the
    clients for the client unit.  At ``delta >= 1/n`` an (epsilon, delta) guarantee allows a mechanism that
    releases a unit's data outright with probability ``delta``, whatever epsilon it reports (at ``delta`` near 1,
    0).  Nothing for a method without a guarantee.
    """
    unit = method_spec(cfg.method).guarantee(cfg.privacy_unit).unit
    if unit == "record":
        n, what = max(len(p) for p in partitions), "the records of the largest client"
    elif unit == "client":
        n, what = cfg.num_clients, "the clients"
    else:
        return []
    if cfg.delta < 1.0 / n:
        return []
    usual = 10.0 ** (math.floor(math.log10(1.0 / n)) - 1)
    whole = "a record" if unit == "record" else "a client's data"
    return [f"run-config 'delta' = {cfg.delta:g} is at least 1/n = {1.0 / n:.3g} (n = {n}, {what}): a guarantee at "
            f"this delta allows releasing {whole} outright with probability delta, whatever epsilon it reports; "
            f"the usual rule is delta << 1/n: set 'delta' to {usual:g} or less"]
