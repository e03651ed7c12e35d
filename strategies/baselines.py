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
from protocols.privacy import calibrate_noise_multiplier, gaussian_epsilon
from strategies.base import CancelStrategy, RoundFailed, RoundState


class FedAvgStrategy(CancelStrategy):
    """Federated averaging without privacy protection (the utility upper bound)."""

    def privacy_report(self, server_round: int) -> dict[str, float]:
        return {"epsilon": math.inf, "epsilon_uplink": math.inf, "epsilon_downlink": math.inf}


class LocalDPStrategy(CancelStrategy):
    """Client-level local DP (DP-FedAvg with client-side noise)."""

    wire_dtype = np.float64

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.z = calibrate_noise_multiplier(cfg.epsilon, cfg.delta, 1.0, cfg.num_rounds)

    def train_config(self, server_round: int) -> ConfigRecord:
        """The round number and the std of the noise each client adds (a ``LocalDpNoise``)."""
        return merge_configs(super().train_config(server_round), LocalDpNoise(self.z * self.cfg.clip).to_config())

    def weight_of(self, reply: Message) -> float:
        """Uniform mean: each upload carries its own noise; size weights would change the bound."""
        return 1.0

    def describe(self) -> dict[str, float | str]:
        return {"noise_multiplier": self.z, "noise_std": self.z * self.cfg.clip}

    def privacy_report(self, server_round: int) -> dict[str, float]:
        up = gaussian_epsilon(self.z, 1.0, server_round, self.cfg.delta)
        m = self.cfg.clients_per_round
        down = gaussian_epsilon(self.z * math.sqrt(m), m / self.cfg.num_clients, server_round, self.cfg.delta)
        return {"epsilon": up, "epsilon_uplink": up, "epsilon_downlink": down}


class CentralDPStrategy(CancelStrategy):
    """Central DP through Flower's client-side fixed-clipping wrapper."""

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.q = cfg.clients_per_round / cfg.num_clients
        self.z = calibrate_noise_multiplier(cfg.epsilon, cfg.delta, self.q, cfg.num_rounds)
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

    def privacy_report(self, server_round: int) -> dict[str, float]:
        down = gaussian_epsilon(self.z, self.q, server_round, self.cfg.delta)
        return {"epsilon": down, "epsilon_uplink": math.inf, "epsilon_downlink": down}
