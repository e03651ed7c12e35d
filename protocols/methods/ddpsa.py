"""DDP-SA's card: its options, regime, guarantee and registry entry (formulas: :mod:`protocols.ddpsa`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from protocols.config_checks import fault_withheld
from protocols.methods.common import FULL_BATCH_GRADIENT, MODEL
from protocols.methods.registry import register
from protocols.methods.spec import Guarantee, MethodSpec
from protocols.options import ConfigError, MethodOptions, option

SERVER_SECAGG = ("the server, fewer than ddpsa-threshold colluding intermediate servers and at most a ddpsa-collude-frac "
                 "share of the round's participants colluding (DDP-SA)")
#: ``ddpsa-noise``: one central Laplace split over the participants (:mod:`protocols.ddpsa`), the paper's Laplace per
#: client, or one central Gaussian (cdp's calibration, (epsilon, delta)) split over the participants.
NOISE_MODES: tuple[str, ...] = ("distributed", "local", "gaussian")
#: ``ddpsa-composition``: what certifies the per-round epsilons (:func:`protocols.privacy.per_round_epsilons`).
COMPOSITIONS: tuple[str, ...] = ("basic", "pld", "advanced")
#: FedSGD with per-sample L1 clipping and Laplace noise: T rounds compose (PLD) to a total signal-to-noise that is
#: largest in one release, so the small datasets take one step from the zero model; the large ones (about 8 records
#: per parameter on MNIST) spend it on 8 steps, which the extra optimisation repays.
DDPSA_REGIME = {"small": {"hidden": "", "lr": 100.0, "clip": 1.0, "num-rounds": 1},
                "large": {"num-rounds": 8, "lr": 150.0}}


def fewest_summed(participants: int, dropout_frac: float) -> int:
    """``n - floor(d n)``: the fewest of ``n`` participants a distributed share may be summed with."""
    return int(participants) - math.floor(dropout_frac * participants)


def sharing_threshold(threshold: int, servers: int) -> int:
    """``ddpsa-threshold`` resolved for ``servers`` intermediate servers: itself, or for 0 ``max(2, servers - 1)``."""
    return int(threshold) if threshold else max(2, int(servers) - 1)


@dataclass(frozen=True)
class DdpsaOptions(MethodOptions):
    """DDP-SA's intermediate servers, secret sharing, per-round budget (Theorem 2, Eq. 12) and noise placement."""

    prefix = "ddpsa"
    title = "DDP-SA"

    servers: str = option("", "host:port,... of intermediate servers (\"\" = start locally)")
    ca: str = option("", "PEM CA certificate of the intermediate servers' TLS certificates")
    server_key: str = option("", "the parameter server's Ed25519 identity key (PEM): reads partial sums")
    num_servers: int = option(3, "m: secret shares = intermediate servers (>= 2)", low=2)
    frac_bits: int = option(24, "fixed-point fractional bits of the Z_2^64 encoding", low=8, high=40)
    composition: str = option("basic", "how the rounds' Laplace releases compose: basic (pure epsilon, Theorem 2) | "
                                       "pld (privacy-loss distribution, (epsilon, delta)) | advanced (Theorem 2)",
                              choices=COMPOSITIONS)
    allocation: str = option("uniform", "per-round budget schedule (Eq. 12)", choices=("uniform", "exponential"))
    decay: float = option(0.9, "decay of the exponential allocation", low=0.0, high=1.0, low_open=True)
    noise: str = option("distributed", "distributed (one central Laplace split over participants, pure epsilon) | "
                                       "local (paper) | gaussian (one central Gaussian of cdp's calibration split "
                                       "over participants, L2 clipping, (epsilon, delta))",
                        choices=NOISE_MODES)
    collude_frac: float = option(0.1, "distributed noise: fraction of participants that may collude with the "
                                      "parameter server", low=0.0, high=1.0, high_open=True, trust="at-least")
    dropout_frac: float = option(0.0, "distributed noise: fraction of participants a round may lose and still "
                                      "release; each share is sized for the rest (more noise per share)",
                                 low=0.0, high=1.0, high_open=True)
    centering: bool = option(True, "centre each record's output-layer gradient on its median over the classes "
                                   "(softmax shift invariance: same model function, L1 norm up to halved; "
                                   "linear model only, a model with hidden layers is left as is)")
    threshold: int = option(0, "servers needed to reconstruct (Shamir); = num-servers: additive; 0 = auto (m - 1, "
                               ">= 2)", trust="at-least")

    @property
    def sharing_threshold(self) -> int:
        """Intermediate servers whose partial sums reconstruct a round (``ddpsa-threshold``; 0 = auto).

        Auto: ``m - 1`` (one server may be lost) but at least 2 (one server alone must learn nothing); equal to
        ``m``: the paper's additive sharing; smaller: Shamir sharing.
        """
        return sharing_threshold(self.threshold, self.num_servers)

    def assumed(self, key: str, cfg: Any) -> float:
        """``ddpsa-threshold``: the resolved :attr:`sharing_threshold` (0 = auto for ``ddpsa-num-servers``)."""
        return float(self.sharing_threshold) if key == "ddpsa-threshold" else super().assumed(key, cfg)

    def validate(self) -> None:
        if self.threshold != 0 and not 2 <= self.threshold <= self.num_servers:
            raise ConfigError(f"run-config 'ddpsa-threshold' = {self.threshold} must be 0 (auto) or in "
                              f"[2, ddpsa-num-servers = {self.num_servers}]")
        if self.noise == "gaussian" and (self.composition != "basic" or self.allocation != "uniform"):
            raise ConfigError("run-config 'ddpsa-noise' = \"gaussian\" calibrates one noise multiplier for all rounds "
                              "(cdp's) and composes them as Gaussian DP; 'ddpsa-composition' and 'ddpsa-allocation' schedule "
                              "Laplace rounds only: leave them at \"basic\" and \"uniform\"")

    def validate_run(self, cfg: Any) -> None:
        if self.servers.strip() and not self.ca:
            raise ConfigError("run-config 'ddpsa-servers' needs 'ddpsa-ca' (the CA of the servers' TLS certificates)")
        n = cfg.clients_per_round
        lost = fault_withheld(cfg.fault_drop_rate, n)
        if lost and n - lost < 2:
            raise ConfigError(f"run-config 'fault-drop-rate' = {cfg.fault_drop_rate:g} withholds {lost} of the {n} "
                              "clients of every round and a DDP-SA partial sum needs at least 2: every round would "
                              "be aborted unreleased; lower 'fault-drop-rate' or raise 'num-clients'")
        if lost and self.noise != "local" and lost > n - fewest_summed(n, self.dropout_frac):
            raise ConfigError(f"run-config 'fault-drop-rate' = {cfg.fault_drop_rate:g} withholds {lost} of the {n} "
                              f"clients of every round, more than 'ddpsa-dropout-frac' = {self.dropout_frac:g} lets a "
                              f"round lose ({n - fewest_summed(n, self.dropout_frac)}): every round would be aborted "
                              f"unreleased; set 'ddpsa-dropout-frac' >= {lost}/{n} or lower 'fault-drop-rate'")


def unallocatable(cfg: Any, err: Exception) -> ConfigError:
    """The ``ConfigError`` for a per-round epsilon schedule the run's keys cannot give (``err``: the allocation's)."""
    way_out = ("raise 'ddpsa-decay' (its power over the rounds leaves the last ones no budget) or set "
               "'ddpsa-allocation' = \"uniform\"" if cfg.ddpsa_allocation == "exponential" else "change them")
    return ConfigError(f"method 'ddpsa' cannot allocate epsilon = {cfg.epsilon:g} over {cfg.num_rounds} rounds with "
                       f"run-config 'ddpsa-allocation' = {cfg.ddpsa_allocation!r}, 'ddpsa-decay' = {cfg.ddpsa_decay:g}, "
                       f"'ddpsa-composition' = {cfg.ddpsa_composition!r}: {err}; {way_out}")


def local_servers(cfg: Any) -> int:
    """Intermediate servers ``cancelfl`` starts for a run: ``ddpsa-num-servers`` unless ``ddpsa-servers`` names them."""
    return 0 if cfg.ddpsa_servers.strip() else cfg.ddpsa_num_servers


register(MethodSpec("ddpsa", "strategies.ddpsa:DdpsaStrategy", "client.methods.ddpsa:train",
                    queries={"ddpsa_identity": "client.methods.ddpsa:identity"}, family="ddpsa", paper="DDP-SA",
                    options=(DdpsaOptions,), regime=DDPSA_REGIME, fixed=FULL_BATCH_GRADIENT,
                    privacy=Guarantee("record", SERVER_SECAGG, MODEL),
                    min_per_round=2, server_step_lr="lr", local_services=local_servers,
                    audit="server.audits.ddpsa:DdpsaAudit", round_time_goal=1.5, deployment_round_time_goal=1.2,
                    dropout_plan="ddpsa-dropout-frac"))
