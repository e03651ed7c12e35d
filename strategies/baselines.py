"""Baselines: FedAvg without DP, local DP (client-level DP-FedAvg) and central DP.

* ``fedavg``: example-weighted average, no noise.
* ``ldp``: each client clips its update to ``clip`` and adds N(0, (z*clip)^2)
  itself, so the server only ever sees noised uploads.  z is calibrated with
  the RDP accountant for (epsilon, delta) over ``num-rounds`` releases without
  sampling amplification (the server knows who it sampled).  Flower's
  ``LocalDpMod`` does not fit: it calibrates each release separately with the
  classic Gaussian mechanism (valid only for epsilon < 1) and composes nothing.
* ``cdp``: clients clip (Flower's ``fixedclipping_mod``), the server adds
  Gaussian noise once to the uniform mean (Flower's
  ``DifferentialPrivacyClientSideFixedClipping``), std z*clip/m, z calibrated
  for (epsilon, delta) with sampling rate q = m/N over the run.
"""

from __future__ import annotations

import math

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping, FedAvg

from client.messages.baselines import UNIFORM_WEIGHT_KEY, ClippingNorm, LocalDpNoise
from client.messages.common import merge_configs
from protocols.config import RunConfig
from protocols.privacy import GaussianEvent, PrivacyLedger, RdpAccountant, calibrate_noise_multiplier
from protocols.privacy.signal import NoiseEstimate, gaussian_norm
from strategies.base import CancelStrategy, RoundFailed, RoundState
from strategies.validation import gaussian_norm_bound


class FedAvgStrategy(CancelStrategy):
    """Federated averaging without privacy protection (the utility upper bound; no accounts: epsilon inf)."""

    def account_round(self, state: RoundState) -> None:
        """Nothing to compose; the round adds no noise anywhere."""
        self.report(upload_noise_std=0.0, model_noise_std=0.0)


class LocalDPStrategy(CancelStrategy):
    """Client-level local DP (DP-FedAvg with client-side noise)."""

    wire_dtype = np.float64

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.z = calibrate_noise_multiplier(cfg.epsilon, cfg.delta, 1.0, cfg.num_rounds)
        self.privacy = PrivacyLedger(cfg.delta, uplink=RdpAccountant(), downlink=RdpAccountant(), headline="uplink")

    def train_config(self, server_round: int) -> ConfigRecord:
        """The round number and the std of the noise each client adds (a ``LocalDpNoise``)."""
        return merge_configs(super().train_config(server_round), LocalDpNoise(self.z * self.cfg.clip).to_config())

    def weight_of(self, reply: Message) -> float:
        """Uniform mean: each upload carries its own noise; size weights would change the bound."""
        return 1.0

    def describe(self) -> dict[str, float | str]:
        return {"noise_multiplier": self.z, "noise_std": self.z * self.cfg.clip}

    def noise_estimate(self, num_params: int) -> NoiseEstimate:
        """Uniform mean of m uploads: noise std ``z clip / sqrt(m)`` per entry; the clipped mean has norm <= clip."""
        m = self.cfg.clients_per_round
        return NoiseEstimate(gaussian_norm(self.z * self.cfg.clip / math.sqrt(m), num_params), self.cfg.clip,
                             self.cfg.num_rounds)

    def norm_limit(self, state: RoundState, node: int) -> float | None:
        """Clipped update plus its N(0, (z clip)^2 I_d) noise: ``clip + z clip (sqrt(d) + t)`` (tail prob ~1e-14)."""
        dim = sum(int(np.prod(a.shape)) for a in self.round_model.values()) if self.round_model is not None else 0
        return self.cfg.clip + gaussian_norm_bound(self.z * self.cfg.clip, dim)

    def account_round(self, state: RoundState) -> None:
        """Each upload: Gaussian with multiplier z, no amplification; the uniform mean of m: ``z sqrt(m)``, rate m/N."""
        self.privacy.uplink.compose(GaussianEvent(self.z))
        m = self.cfg.clients_per_round
        self.privacy.downlink.compose(GaussianEvent(self.z * math.sqrt(m), m / self.cfg.num_clients))
        k = max(len(state.participants), 1)  # independent noises: the uniform mean keeps std z clip / sqrt(k)
        self.report(upload_noise_std=self.z * self.cfg.clip, model_noise_std=self.z * self.cfg.clip / math.sqrt(k))


class CentralDPStrategy(CancelStrategy):
    """Central DP through Flower's client-side fixed-clipping wrapper."""

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.q = cfg.clients_per_round / cfg.num_clients
        self.z = calibrate_noise_multiplier(cfg.epsilon, cfg.delta, self.q, cfg.num_rounds)
        # Trusted server: no uplink guarantee; the noised mean is amplified by sampling m of N.
        self.privacy = PrivacyLedger(cfg.delta, downlink=RdpAccountant(), headline="downlink")
        self.inner = DifferentialPrivacyClientSideFixedClipping(
            FedAvg(weighted_by_key=UNIFORM_WEIGHT_KEY), noise_multiplier=self.z, clipping_norm=cfg.clip,
            num_sampled_clients=cfg.clients_per_round)

    def train_config(self, server_round: int) -> ConfigRecord:
        """The round number and the norm ``fixedclipping_mod`` clips each update to (a ``ClippingNorm``)."""
        return merge_configs(super().train_config(server_round), ClippingNorm(self.cfg.clip).to_config())

    def aggregate(self, state: RoundState, by_node: dict[int, Message], errors: list[str]) -> ArrayRecord | None:
        """Flower's uniform mean of the clipped updates plus its Gaussian noise (std ``z clip / m``)."""
        arrays, _ = self.inner.aggregate_train(state.round, [by_node[n] for n in sorted(by_node)])
        if arrays is None:
            raise RoundFailed(f"round {state.round}: Flower's central-DP aggregation returned no model")
        return arrays

    def describe(self) -> dict[str, float | str]:
        return {"noise_multiplier": self.z, "aggregate_noise_std": self.z * self.cfg.clip / self.cfg.clients_per_round}

    def noise_estimate(self, num_params: int) -> NoiseEstimate:
        """Server noise std ``z clip / m`` per entry of the mean; the mean of clipped updates has norm <= clip."""
        return NoiseEstimate(gaussian_norm(self.z * self.cfg.clip / self.cfg.clients_per_round, num_params),
                             self.cfg.clip, self.cfg.num_rounds)

    def norm_limit(self, state: RoundState, node: int) -> float | None:
        """``fixedclipping_mod`` clips the update to ``clip`` (in float32: a relative slack of 1e-3 plus 1e-5 ||w||)."""
        arrays = self.round_model.values() if self.round_model is not None else []
        norm = math.sqrt(sum(float(np.sum(np.square(a.numpy(), dtype=np.float64))) for a in arrays))
        return self.cfg.clip * (1 + 1e-3) + 1e-5 * norm

    def account_round(self, state: RoundState) -> None:
        """The noised mean of the m clipped updates: a Gaussian with multiplier z, amplified by sampling (rate m/N)."""
        self.privacy.downlink.compose(GaussianEvent(self.z, self.q))
        self.report(upload_noise_std=0.0, model_noise_std=self.z * self.cfg.clip / self.cfg.clients_per_round)
