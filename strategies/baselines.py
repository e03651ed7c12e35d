"""Baselines: FedAvg without DP, local DP (DP-FedAvg) and central DP, at record or client level.

* ``fedavg``: example-weighted average, no noise.
* ``ldp``: each client noises its own upload; the server announces the RDP-calibrated multiplier ``z`` for
  ``num-rounds`` releases (:class:`protocols.wire.baselines.LocalDpNoise`) and each client refuses a smaller one.
  Record level: the local model plus ``N(0, (z Delta_k)^2)``, ``Delta_k = a C lr / n_k`` (a = 1 zero-out, 2
  replace-one; NADP-FL's Lemma 3 comparator), example-weighted mean; client level: the update clipped to ``clip``
  plus ``N(0, (z clip)^2)``, uniform mean.
* ``cdp`` (trusted server, no uplink guarantee): the server adds Gaussian noise once to the mean.  Record level:
  ``N(0, (z Delta)^2)`` on the example-weighted mean (:func:`record_mean_sensitivity`); client level: Flower's
  ``fixedclipping_mod`` on the clients, ``N(0, (z clip / k)^2)`` on the uniform mean of the k updates aggregated.

No amplification by sampling is claimed (the sample is drawn from the public run seed): with ``sample-rate``
< 1 every round is composed as an unsampled release.  See ``docs/methods/baselines.md``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from protocols.arrays import flatten, unflatten, weighted_average
from protocols.clipping import clip_l2
from protocols.config import RunConfig
from protocols.floor import ldp_noise_multiplier
from protocols.privacy import (
    GaussianEvent,
    PrivacyLedger,
    RdpAccountant,
    noise_multiplier,
    receiver_std,
    record_sensitivity,
    record_training_movement,
)
from protocols.privacy.sensitivity import adjacency_factor
from protocols.privacy.signal import NoiseEstimate, gaussian_norm
from protocols.wire.arrays import array_view, from_record
from protocols.wire.baselines import ClippingNorm, LocalDpNoise
from protocols.wire.common import merge_configs, num_examples
from strategies.base import CancelStrategy, RoundFailed, RoundState
from strategies.records import to_record
from strategies.validation import gaussian_norm_bound


class FedAvgStrategy(CancelStrategy):
    """Federated averaging without privacy protection (the utility upper bound; no accounts: epsilon inf)."""

    def charge_release(self, state: RoundState) -> None:
        """Nothing to compose; the round adds no noise anywhere."""
        self.report(upload_noise_std=0.0, model_noise_std=0.0)


def record_mean_sensitivity(cfg: RunConfig, sizes: Mapping[int, int]) -> float:
    """Record sensitivity of the example-weighted mean ``sum_k (n_k / N) w_k`` of per-example-clipped models.

    Fixed dataset sizes (zero-out or replace-one: every ``n_k`` and ``N = sum n_k`` stay the same): a record of
    client k moves ``w_k`` by at most ``Delta_k`` (:func:`protocols.privacy.record_sensitivity`) and the mean by
    ``n_k Delta_k / N``; the worst client bounds it.  For one full-batch step ``n_k Delta_k = a C lr`` for every k
    (a = 1 zero-out, 2 replace-one), so this is ``a C lr / N``.  (Adding or removing a record would change N and
    the weights as well; we do not claim that convention.)
    """
    total = sum(sizes.values())
    if total <= 0:
        raise RoundFailed("no records among the uploads")
    return max(n * record_sensitivity(cfg, n) for n in sizes.values()) / total


@dataclass
class RecordRound(RoundState):
    """A record-level baseline's round: the multiplier of the published mean, once the aggregate stage knows it."""

    #: Noise std / record sensitivity of the mean (:meth:`LocalDPStrategy.aggregate`); None: not released.
    mean_multiplier: float | None = None


class _RecordLevel(CancelStrategy):
    """What both record-level baselines need: each upload's ``n_k`` (read before the reply checks)."""

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.record_level = cfg.privacy_unit == "record"
        #: node -> n_k its reply claims, this round (the screen checks the claim against the partitions).
        self.sizes: dict[int, int] = {}

    def begin_round(self, arrays: ArrayRecord) -> None:
        """Also forget the last round's claimed sizes."""
        super().begin_round(arrays)
        self.sizes = {}

    def plan(self, grid: Grid, st: RoundState) -> RecordRound:
        """Plan stage: nothing to calibrate (the noise depends on each client's own size)."""
        return RecordRound(st.round, list(st.participants))

    def reply_problem(self, state: RoundState, node: int, reply: Message) -> str | None:
        """Note the reply's ``n_k`` (its noise std and update bound depend on it); a missing one is the screen's."""
        try:
            self.sizes[node] = num_examples(reply.content["metrics"])
        except (KeyError, ValueError, TypeError):
            pass
        return None


class LocalDPStrategy(_RecordLevel):
    """Local DP: every client noises its own upload (record level by default, or client level)."""

    wire_dtype = np.float64
    #: The round loop may raise the round's multiplier to ``z * noise_scale`` (>= z; the clients use the larger of
    #: it and their own z) to keep epsilon within the run's target (:mod:`strategies.run.budget`).
    scales_noise = True
    noise_scale = 1.0

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.z = ldp_noise_multiplier(cfg)  # the clients compute the same (their privacy floor)
        self.privacy = PrivacyLedger(cfg.delta, uplink=RdpAccountant(), downlink=RdpAccountant(), headline="uplink")

    def train_config(self, server_round: int) -> dict[str, Any]:
        """The round number and the noise multiplier each client must at least use (a ``LocalDpNoise``)."""
        return merge_configs(super().train_config(server_round), LocalDpNoise(self.z * self.noise_scale).to_config())

    def weight_of(self, reply: Message) -> float:
        """Record level: ``n_k`` (example-weighted FedAvg).  Client level: uniform (size weights change the bound)."""
        return super().weight_of(reply) if self.record_level else 1.0

    def upload_std(self, size: int) -> float:
        """Std of the Gaussian noise in one upload of a client with ``size`` records."""
        return self.z * self.noise_scale * (record_sensitivity(self.cfg, size) if self.record_level else self.cfg.clip)

    def describe(self) -> dict[str, float | str]:
        if self.record_level:
            return {"noise_multiplier": self.z, "privacy_unit": "record",
                    "noise_std": f"noise_multiplier * record sensitivity ({adjacency_factor(self.cfg.adjacency):g} "
                                 f"clip lr / n_k for one full-batch step, {self.cfg.adjacency})"}
        return {"noise_multiplier": self.z, "privacy_unit": "client", "noise_std": self.z * self.cfg.clip}

    def mean_noise(self, sizes: Mapping[int, int], *, receiver: bool = False) -> tuple[float, float]:
        """(per-coordinate noise std, record sensitivity) of the example-weighted mean of these uploads.

        ``receiver``: the std left to a receiving participant that knows its own noise
        (:func:`protocols.privacy.receiver_std`), the figure the model's account charges.
        """
        total = sum(sizes.values())
        parts = [(n / total * self.upload_std(n)) ** 2 for n in sizes.values()]
        std = receiver_std(parts) if receiver else math.sqrt(math.fsum(parts))
        return std, record_mean_sensitivity(self.cfg, sizes)

    def noise_estimate(self, num_params: int) -> NoiseEstimate:
        """Noise std in the mean vs the signal: ``lr clip steps`` (record level) or ``clip`` (client level)."""
        c = self.cfg
        if self.record_level and self.sizes:
            std, _ = self.mean_noise(self.sizes)
            signal = max(record_training_movement(c, n) for n in self.sizes.values())
            return NoiseEstimate(gaussian_norm(std, num_params), signal, c.num_rounds)
        m = c.clients_per_round
        return NoiseEstimate(gaussian_norm(self.z * c.clip / math.sqrt(m), num_params), c.clip, c.num_rounds)

    def norm_limit(self, state: RoundState, node: int) -> float | None:
        """Movement of the local training plus a Gaussian tail bound of the upload's noise.

        Record level: per-example-clipped SGD moves the model by <= ``lr clip steps``; client level: the clipped
        update has norm <= ``clip``.
        """
        if not self.record_level:
            return self.cfg.clip + gaussian_norm_bound(self.z * self.cfg.clip, self.model_dim())
        size = self.sizes.get(node)
        if size is None or size < 1:
            return None
        return record_training_movement(self.cfg, size) + gaussian_norm_bound(self.upload_std(size), self.model_dim())

    def charge_release(self, state: RoundState) -> None:
        """Each upload: a Gaussian with multiplier z, no amplification (every participant is told to release)."""
        self.privacy.uplink.compose(GaussianEvent(self.z * self.noise_scale))
        # The mean's downlink event depends on the uploads aggregated (and record level on their sizes):
        # composed in the account stage from what aggregate() saw.

    def aggregate(self, state: RecordRound) -> ArrayRecord | None:
        """Aggregate stage: the weighted mean; record level also notes the published mean's multiplier.

        Independent noises: the mean of K full-batch uploads keeps std ``z sqrt(K) a C lr / N`` against
        a record sensitivity ``a C lr / N`` (a = 1 zero-out, 2 replace-one), i.e. multiplier ``z sqrt(K)``; a
        receiving participant knows its own noise, so the account charges the ``K - 1`` others' (multiplier
        ``z sqrt(K - 1)`` for equal sizes, :func:`protocols.privacy.receiver_std`); no amplification by sampling
        (the sample is drawn from the public run seed).
        """
        arrays = super().aggregate(state)
        if not self.record_level:
            # The uniform mean of the k uploads aggregated (not the k planned: dropouts leave fewer) has std
            # z clip sqrt(k) / k against sensitivity clip / k; a receiving participant knows its own noise.
            z, k = self.z * self.noise_scale, max(len(state.replies), 1)
            state.mean_multiplier = z * receiver_std([1.0] * k)
            self.report(upload_noise_std=z * self.cfg.clip, model_noise_std=z * self.cfg.clip / math.sqrt(k))
        else:
            by_node = state.replies
            sizes = {n: num_examples(by_node[n].content["metrics"]) for n in by_node}
            std, sens = self.mean_noise(sizes)
            state.mean_multiplier = self.mean_noise(sizes, receiver=True)[0] / sens
            self.report(upload_noise_std=min(self.upload_std(n) for n in sizes.values()), model_noise_std=std)
        return arrays

    def account(self, state: RecordRound) -> None:
        """Account stage: the published mean, with the noise really in it (the uploads aggregated)."""
        if state.mean_multiplier is not None:
            self.privacy.downlink.compose(GaussianEvent(state.mean_multiplier))


class CentralDPStrategy(_RecordLevel):
    """Central DP: the trusted server noises the mean (record level by default, or client level)."""

    #: The round loop may raise the round's multiplier to ``z * noise_scale`` (the server adds all the noise)
    #: to keep epsilon within the run's target (:mod:`strategies.run.budget`).
    scales_noise = True
    noise_scale = 1.0

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.z = noise_multiplier(cfg.epsilon, cfg.delta, cfg.num_rounds)
        # Trusted server: no uplink guarantee; the noised mean is one unsampled release per round (public sample).
        self.privacy = PrivacyLedger(cfg.delta, downlink=RdpAccountant(), headline="downlink")
        self._last_std: float | None = None

    def train_config(self, server_round: int) -> dict[str, Any]:
        """The round number; client level: the norm ``fixedclipping_mod`` clips each update to (a ``ClippingNorm``)."""
        if self.record_level:
            return super().train_config(server_round)
        return merge_configs(super().train_config(server_round), ClippingNorm(self.cfg.clip).to_config())

    def _clipped_mean(self, uploads: list) -> np.ndarray:
        """Client level: the round model plus the uniform mean of the updates, each clipped to ``clip`` in float64.

        The clients clip too, but a float32 upload ``w + u`` carries its update only to float32 rounding of ``w``:
        the server's own clip makes the sensitivity exactly ``clip / k``.
        """
        flats = [flatten(u) for u in uploads]
        base = np.zeros_like(flats[0]) if self.round_model is None else np.concatenate(
            [np.asarray(array_view(a), dtype=np.float64).ravel() for a in self.round_model.values()])
        updates = [clip_l2(f - base, self.cfg.clip)[0] for f in flats]
        return base + np.mean(updates, axis=0)

    def aggregate(self, state: RoundState) -> ArrayRecord | None:
        """Aggregate stage, record level: example-weighted mean + N(0, (z Delta)^2), Delta = :func:`record_mean_sensitivity`.

        Client level: the uniform mean of the updates ``fixedclipping_mod`` clipped plus N(0, (z clip / k)^2), k = the
        replies aggregated.  The noise comes from the AES-CTR CSPRNG (:mod:`protocols.prg`), seeded from the OS.
        """
        from protocols.prg import gaussian

        by_node = state.replies
        z = self.z * self.noise_scale
        nodes = sorted(by_node)
        sizes = {n: num_examples(by_node[n].content["metrics"]) for n in nodes}
        uploads = [from_record(by_node[n].content["arrays"]) for n in nodes]
        mean = weighted_average(uploads, [float(sizes[n]) if self.record_level else 1.0 for n in nodes])
        flat = flatten(mean) if self.record_level else self._clipped_mean(uploads)
        # Client level: the uniform mean of the k clipped updates that arrived (not the k planned) has sensitivity
        # clip / k (Flower's central-DP wrappers size it on those sampled: multiplier z k / m after dropouts).
        std = z * (record_mean_sensitivity(self.cfg, sizes) if self.record_level else self.cfg.clip / len(nodes))
        noisy = flat + gaussian(os.urandom(32), len(flat), std)
        self._last_std = std
        self.report(upload_noise_std=0.0, model_noise_std=std)
        return to_record(unflatten(noisy, mean), self.wire_dtype)

    def describe(self) -> dict[str, float | str]:
        if self.record_level:
            return {"noise_multiplier": self.z, "privacy_unit": "record",
                    "aggregate_noise_std": f"noise_multiplier * {adjacency_factor(self.cfg.adjacency):g} clip lr / N (N: "
                                           "the round's records, one full-batch step; max_k n_k Delta_k / N in "
                                           "general)"}
        return {"noise_multiplier": self.z, "privacy_unit": "client",
                "aggregate_noise_std": self.z * self.cfg.clip / self.cfg.clients_per_round}

    def noise_estimate(self, num_params: int) -> NoiseEstimate | None:
        """Server noise per entry of the mean vs the signal: ``lr clip steps`` (record) or ``clip`` (client)."""
        c = self.cfg
        if self.record_level:
            if self._last_std is None or not self.sizes:
                return None
            signal = max(record_training_movement(c, n) for n in self.sizes.values())
            return NoiseEstimate(gaussian_norm(self._last_std, num_params), signal, c.num_rounds)
        return NoiseEstimate(gaussian_norm(self.z * c.clip / c.clients_per_round, num_params), c.clip, c.num_rounds)

    def norm_limit(self, state: RoundState, node: int) -> float | None:
        """Record level: per-example-clipped SGD moves the model by <= ``lr clip steps`` (float32 slack as below).

        Client level: ``fixedclipping_mod`` clips the update to ``clip`` (in float32: a relative slack of 1e-3
        plus 1e-5 ||w||).
        """
        arrays = self.round_model.values() if self.round_model is not None else []
        norm = math.sqrt(sum(float(np.sum(np.square(a.numpy(), dtype=np.float64))) for a in arrays))
        if not self.record_level:
            return self.cfg.clip * (1 + 1e-3) + 1e-5 * norm
        size = self.sizes.get(node)
        if size is None or size < 1:
            return None
        return record_training_movement(self.cfg, size) * (1 + 1e-3) + 1e-5 * norm

    def charge_release(self, state: RoundState) -> None:
        """The noised mean: a Gaussian with multiplier z (std / sensitivity); no amplification (public sample)."""
        z = self.z * self.noise_scale
        self.privacy.downlink.compose(GaussianEvent(z))
