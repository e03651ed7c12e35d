"""DDP-SA parameter server (Wei et al., Algorithm 2): reconstruct the secret-shared noisy sum.

Round ``t``:

1. ``prepare_round`` makes sure the ``m`` intermediate servers answer ``Health``
   (a dead one fails the round *before* clients work, naming it); the train message
   carries the global model and a :class:`client.messages.ddpsa.DdpsaRound` (this
   round's ``eps_t``, the servers, the run id and the fixed-point codec);
2. each client (:mod:`client.methods.ddpsa`) pushes one additive share of its encoded
   noisy clipped gradient sum to every intermediate server and replies with metrics;
3. ``aggregate`` asks every server for its partial sum over exactly the clients
   that replied successfully, reconstructs only when all ``m`` arrived
   (full-threshold sharing; a missing one raises :class:`RoundFailed` naming the server),
   decodes, divides by ``N = sum N_i`` and takes the step
   ``theta_{t+1} = theta_t - eta * sum_i s_i / N`` (``eta`` = run-config ``lr``).  The
   paper's experiments use Adam at the server; we use plain SGD (one hyper-parameter,
   no optimizer state) -- a documented deviation.

Intermediate servers: ``ddpsa-servers`` (comma-separated ``host:port``, exactly
``ddpsa-num-servers`` of them).  The strategy never starts servers: when the user leaves
``ddpsa-servers`` empty, the server layer starts ``m`` local ones (the one place that does:
:func:`server.intermediate.launcher.local_intermediate_servers`) and hands their addresses
in through the run config.  Every run uses a fresh random ``run_id`` so runs sharing servers
never mix.

Privacy budget (``self.privacy``, read by ``privacy_report``): run-config ``epsilon``/``delta`` are the *total*
budget; :func:`protocols.privacy.per_round_epsilons` turns it into ``eps_t`` with
the ``ddpsa-allocation`` shape (``uniform`` or Eq. 12 ``exponential`` with
``alpha = ddpsa-decay``) certified by ``ddpsa-composition`` (Theorem 2: ``basic`` =
the ``eps_t`` sum to ``epsilon``; ``advanced`` = heterogeneous advanced composition with
``delta' = delta`` meets ``epsilon``).  Each round released composes ``eps_t``
(:class:`protocols.privacy.DpCompositionAccountant`); we report the epsilon spent so far:
the basic sum, or under ``advanced`` the smaller of the two valid bounds.  Each ``eps_t``
protects one *sample* of a client's data (per-sample L1
clipping, add/remove adjacency), not a whole client as the ``ldp`` baseline does.  The
secret sharing adds no privacy loss (post-processing; Corollary 1); downlink = uplink.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import grpc
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from client.intermediate import IntermediateServerClient, PartialSumUnavailableError, reconstruct_sum
from client.messages.common import merge_configs, num_examples
from client.messages.ddpsa import DdpsaRound
from client.wire import Weights, from_record, to_record
from protocols.arrays import flatten, unflatten
from protocols.config import ConfigError, RunConfig
from protocols.privacy import (
    BudgetSchedule,
    DpCompositionAccountant,
    LaplaceEvent,
    PrivacyLedger,
    laplace_scale,
    per_round_epsilons,
)
from protocols.secret_sharing import FixedPointCodec
from strategies.base import CancelStrategy, RoundFailed, RoundState
from strategies.validation import UploadSpec

#: Seconds the pre-round health check waits for each intermediate server.
HEALTH_TIMEOUT_S = 5.0


def parse_servers(text: str) -> list[str]:
    """``"h1:p1, h2:p2"`` -> ``["h1:p1", "h2:p2"]`` (empty string -> [])."""
    return [a.strip() for a in text.split(",") if a.strip()]


@dataclass
class DdpsaState(RoundState):
    """One DDP-SA round: the global model the clients' gradient sums were computed at."""

    global_weights: Weights


class DdpsaStrategy(CancelStrategy):
    """Parameter server of DDP-SA with m intermediate aggregation servers."""

    wire_dtype = np.float64  # the model is updated from a decoded sum; keep it exact on the wire

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.m = cfg.ddpsa_num_servers
        if cfg.clients_per_round < 2:
            raise ConfigError(
                "method 'ddpsa' needs at least 2 clients per round (run-config 'num-clients' x 'sample-rate'): "
                "intermediate servers refuse a partial sum over one client, which would expose its update"
            )
        self.addresses = parse_servers(cfg.ddpsa_servers)
        if not self.addresses:
            raise ConfigError(
                "method 'ddpsa' needs its intermediate servers: set run-config 'ddpsa-servers' (host:port,...), "
                "or start the run with `cancelfl run/deploy` or the cancelfl ServerApp, which start local ones"
            )
        if len(self.addresses) != self.m:
            raise ConfigError(
                f"run-config 'ddpsa-servers' lists {len(self.addresses)} address(es) but 'ddpsa-num-servers' = {self.m}; "
                "give exactly one host:port per intermediate server"
            )
        self.schedule: BudgetSchedule = per_round_epsilons(
            cfg.epsilon, cfg.delta, cfg.num_rounds, allocation=cfg.ddpsa_allocation, alpha=cfg.ddpsa_decay,
            composition=cfg.ddpsa_composition,
        )
        # Rounds released so far, composed as the schedule was certified (advanced: the smaller of the two bounds).
        spent = DpCompositionAccountant(composition="best" if self.schedule.composition == "advanced" else "basic")
        self.privacy = PrivacyLedger(cfg.delta, uplink=spent, downlink=spent)
        self.codec = FixedPointCodec(frac_bits=cfg.ddpsa_frac_bits, max_clients=max(cfg.num_clients, 2))
        self.run_id = uuid.uuid4().hex
        #: Last reconstructed aggregate: decoded sum of the clients' noisy sums (diagnostics, tests).
        self.last_decoded_sum: np.ndarray | None = None

    # ------------------------------------------------------------ servers
    def _check_servers(self, server_round: int) -> None:
        """Fail the round early (clients do no work) if an intermediate server is down."""
        down = []
        for j, addr in enumerate(self.addresses):
            with IntermediateServerClient(addr) as client:
                try:
                    client.health(timeout=HEALTH_TIMEOUT_S)
                except grpc.RpcError as exc:
                    code = exc.code().name if isinstance(exc, grpc.Call) else "ERROR"
                    down.append(f"intermediate server #{j} ({addr}): {code}")
        if down:
            raise RoundFailed(
                f"round {server_round}: DDP-SA needs all {len(self.addresses)} intermediate servers (full-threshold "
                f"secret sharing) but {len(down)} did not answer: " + "; ".join(down)
            )

    # ------------------------------------------------------------ round hooks
    def epsilon_of_round(self, server_round: int) -> float:
        """``eps_t`` of round ``server_round`` (1-based)."""
        return float(self.schedule.epsilons[server_round - 1])

    def prepare_round(self, grid: Grid, server_round: int, nodes: list[int], arrays: ArrayRecord) -> DdpsaState:
        """Check the m servers before any client works; keep the model the gradients will be taken at."""
        self._check_servers(server_round)
        return DdpsaState(server_round, list(nodes), from_record(arrays))

    def upload_spec(self, state: RoundState) -> UploadSpec:
        """No arrays: the shares go to the intermediate servers (a reply is checked for size and num-examples)."""
        return {}

    def train_config(self, server_round: int) -> ConfigRecord:
        """The round number and this round's :class:`~client.messages.ddpsa.DdpsaRound`."""
        plan = DdpsaRound(self.epsilon_of_round(server_round), tuple(self.addresses), self.run_id,
                          self.codec.frac_bits, self.codec.max_clients)
        return merge_configs(super().train_config(server_round), plan.to_config())

    def aggregate(self, state: DdpsaState, by_node: dict[int, Message], errors: list[str]) -> ArrayRecord:
        """Fetch all m partial sums over the replying clients, reconstruct, decode, average by N, take the SGD step."""
        rnd = state.round
        expected = sorted(by_node)
        n_total = float(sum(num_examples(r.content["metrics"]) for r in by_node.values()))
        t0 = time.perf_counter()
        try:
            ring_total = reconstruct_sum(self.addresses, self.run_id, rnd, expected)
        except PartialSumUnavailableError as err:
            raise RoundFailed(f"round {rnd}: DDP-SA reconstruction impossible, {err}") from err
        reconstruct_time = time.perf_counter() - t0
        decoded = self.codec.decode(ring_total)
        theta = flatten(state.global_weights)
        if decoded.size != theta.size:
            raise RoundFailed(f"round {rnd}: reconstructed {decoded.size} values, the model has {theta.size}")
        self.last_decoded_sum = decoded
        grad = decoded / n_total
        new = unflatten(theta - self.cfg.lr * grad, state.global_weights)
        self.report(
            epsilon_round=self.epsilon_of_round(rnd),
            grad_norm=float(np.linalg.norm(grad)),
            reconstruct_time_s=reconstruct_time,
            # Fixed-point round-off of the averaged gradient: <= n * 2^-(frac_bits+1) / N per coordinate.
            roundoff_bound=len(expected) * self.codec.resolution / 2 / n_total,
        )
        return to_record(new, self.wire_dtype)

    # ------------------------------------------------------------ reporting
    def describe(self) -> dict[str, float | str]:
        eps = self.schedule.epsilons
        return {
            "num_intermediate_servers": self.m,
            "intermediate_servers": ",".join(self.addresses),
            "composition": self.schedule.composition,
            "allocation": self.cfg.ddpsa_allocation,
            "decay": self.cfg.ddpsa_decay,
            "epsilon_first_round": float(eps[0]),
            "epsilon_last_round": float(eps[-1]),
            "epsilon_total_certified": self.schedule.spent.epsilon,
            "delta_total_certified": self.schedule.spent.delta,
            "laplace_scale_first_round": laplace_scale(self.cfg.clip, float(eps[0])),
            "frac_bits": self.codec.frac_bits,
        }

    def account_round(self, state: RoundState) -> None:
        """Each client's round-``t`` upload is ``eps_t``-DP (Laplace); one bound for both views."""
        self.privacy.compose(LaplaceEvent(self.epsilon_of_round(state.round)))
