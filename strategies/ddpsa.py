"""DDP-SA parameter server (Wei et al., Algorithm 2): reconstruct the secret-shared noisy sum.

Round ``t``:

1. ``configure_train`` makes sure the ``m`` intermediate servers answer ``Health``
   (a dead one fails the round *before* clients work, naming it), then sends the global
   model plus ``ddpsa-epsilon`` (this round's ``eps_t``), ``ddpsa-servers``,
   ``ddpsa-run-id``, ``ddpsa-frac-bits`` and ``ddpsa-max-clients``;
2. each client (:mod:`client.methods.ddpsa`) pushes one additive share of its encoded
   noisy clipped gradient sum to every intermediate server and replies with metrics;
3. ``aggregate_train`` asks every server for its partial sum over exactly the clients
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

Privacy budget (``privacy_report``): run-config ``epsilon``/``delta`` are the *total*
budget; :func:`protocols.composition.per_round_epsilons` turns it into ``eps_t`` with
the ``ddpsa-allocation`` shape (``uniform`` or Eq. 12 ``exponential`` with
``alpha = ddpsa-decay``) certified by ``ddpsa-composition`` (Theorem 2: ``basic`` =
the ``eps_t`` sum to ``epsilon``; ``advanced`` = heterogeneous advanced composition with
``delta' = delta`` meets ``epsilon``).  After round ``t`` we report the epsilon spent by
rounds ``1..t``: the basic sum, or under ``advanced`` the smaller of the two valid
bounds.  Each ``eps_t`` protects one *sample* of a client's data (per-sample L1
clipping, add/remove adjacency), not a whole client as the ``ldp`` baseline does.  The
secret sharing adds no privacy loss (post-processing; Corollary 1); downlink = uplink.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from logging import WARNING

import grpc
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from client.intermediate import IntermediateServerClient, PartialSumUnavailableError, reconstruct_sum
from client.wire import Weights, from_record, to_record
from protocols.arrays import flatten, unflatten
from protocols.composition import BudgetSchedule, compose_advanced, per_round_epsilons
from protocols.config import ConfigError, RunConfig
from protocols.secret_sharing import FixedPointCodec
from strategies.base import CancelStrategy, RoundFailed, split_replies

#: Seconds the pre-round health check waits for each intermediate server.
HEALTH_TIMEOUT_S = 5.0


def parse_servers(text: str) -> list[str]:
    """``"h1:p1, h2:p2"`` -> ``["h1:p1", "h2:p2"]`` (empty string -> [])."""
    return [a.strip() for a in text.split(",") if a.strip()]


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
        self.external = parse_servers(cfg.ddpsa_servers)
        if not self.external:
            raise ConfigError(
                "method 'ddpsa' needs its intermediate servers: set run-config 'ddpsa-servers' (host:port,...), "
                "or start the run with `cancelfl run/deploy` or the cancelfl ServerApp, which start local ones"
            )
        if len(self.external) != self.m:
            raise ConfigError(
                f"run-config 'ddpsa-servers' lists {len(self.external)} address(es) but 'ddpsa-num-servers' = {self.m}; "
                "give exactly one host:port per intermediate server"
            )
        self.schedule: BudgetSchedule = per_round_epsilons(
            cfg.epsilon, cfg.delta, cfg.num_rounds, allocation=cfg.ddpsa_allocation, alpha=cfg.ddpsa_decay,
            composition=cfg.ddpsa_composition,
        )
        self.codec = FixedPointCodec(frac_bits=cfg.ddpsa_frac_bits, max_clients=max(cfg.num_clients, 2))
        self.run_id = uuid.uuid4().hex
        self._global: Weights | None = None
        #: Last reconstructed aggregate: decoded sum of the clients' noisy sums (diagnostics, tests).
        self.last_decoded_sum: np.ndarray | None = None

    # ------------------------------------------------------------ servers
    @property
    def addresses(self) -> list[str]:
        """Addresses of the m intermediate servers."""
        return list(self.external)

    def _check_servers(self, server_round: int, addresses: list[str]) -> None:
        """Fail the round early (clients do no work) if an intermediate server is down."""
        down = []
        for j, addr in enumerate(addresses):
            with IntermediateServerClient(addr) as client:
                try:
                    client.health(timeout=HEALTH_TIMEOUT_S)
                except grpc.RpcError as exc:
                    code = exc.code().name if isinstance(exc, grpc.Call) else "ERROR"
                    down.append(f"intermediate server #{j} ({addr}): {code}")
        if down:
            raise RoundFailed(
                f"round {server_round}: DDP-SA needs all {len(addresses)} intermediate servers (full-threshold "
                f"secret sharing) but {len(down)} did not answer: " + "; ".join(down)
            )

    # ------------------------------------------------------------ rounds
    def epsilon_of_round(self, server_round: int) -> float:
        """``eps_t`` of round ``server_round`` (1-based)."""
        return float(self.schedule.epsilons[server_round - 1])

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Check the m servers, then send the model and this round's DDP-SA parameters."""
        self._round_report = {}
        nodes = self.sample_nodes(grid, server_round)
        addresses = self.addresses
        self._check_servers(server_round, addresses)
        self._global = from_record(arrays)
        rec = self.train_config(server_round)
        rec["ddpsa-epsilon"] = self.epsilon_of_round(server_round)
        rec["ddpsa-servers"] = ",".join(addresses)
        rec["ddpsa-run-id"] = self.run_id
        rec["ddpsa-frac-bits"] = self.codec.frac_bits
        rec["ddpsa-max-clients"] = self.codec.max_clients
        return self.make_messages(nodes, lambda _n: RecordDict({"arrays": arrays, "config": rec}))

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Fetch all m partial sums, reconstruct, decode, average by N and take the SGD step."""
        good, errors = split_replies(replies)
        for e in errors:
            log(WARNING, "round %d: %s", server_round, e.splitlines()[0])
        if not good:
            first = errors[0].splitlines()[0] if errors else "no reply"
            raise RoundFailed(f"round {server_round}: no client delivered its shares ({len(errors)} errors; first: {first})")
        if self._global is None:
            raise RoundFailed(f"round {server_round}: aggregate_train called before configure_train")
        expected = sorted(r.metadata.src_node_id for r in good)
        n_total = sum(float(r.content["metrics"]["num-examples"]) for r in good)
        t0 = time.perf_counter()
        try:
            ring_total = reconstruct_sum(self.addresses, self.run_id, server_round, expected)
        except PartialSumUnavailableError as err:
            raise RoundFailed(f"round {server_round}: DDP-SA reconstruction impossible, {err}") from err
        reconstruct_time = time.perf_counter() - t0
        decoded = self.codec.decode(ring_total)
        theta = flatten(self._global)
        if decoded.size != theta.size:
            raise RoundFailed(f"round {server_round}: reconstructed {decoded.size} values, the model has {theta.size}")
        self.last_decoded_sum = decoded
        grad = decoded / n_total
        new = unflatten(theta - self.cfg.lr * grad, self._global)
        self.report(
            epsilon_round=self.epsilon_of_round(server_round),
            grad_norm=float(np.linalg.norm(grad)),
            reconstruct_time_s=reconstruct_time,
            # Fixed-point round-off of the averaged gradient: <= n * 2^-(frac_bits+1) / N per coordinate.
            roundoff_bound=len(expected) * self.codec.resolution / 2 / n_total,
        )
        return to_record(new, self.wire_dtype), self.mean_metrics(good)

    # ------------------------------------------------------------ reporting
    def describe(self) -> dict[str, float | str]:
        eps = self.schedule.epsilons
        return {
            "num_intermediate_servers": self.m,
            "intermediate_servers": ",".join(self.external),
            "composition": self.schedule.composition,
            "allocation": self.cfg.ddpsa_allocation,
            "decay": self.cfg.ddpsa_decay,
            "epsilon_first_round": float(eps[0]),
            "epsilon_last_round": float(eps[-1]),
            "epsilon_total_certified": self.schedule.spent.epsilon,
            "delta_total_certified": self.schedule.spent.delta,
            "laplace_scale_first_round": self.cfg.clip / float(eps[0]),
            "frac_bits": self.codec.frac_bits,
        }

    def spent(self, server_round: int) -> float:
        """Epsilon spent by rounds ``1..server_round`` (at the run-config delta)."""
        eps = self.schedule.epsilons[: max(0, min(server_round, len(self.schedule.epsilons)))]
        if eps.size == 0:
            return 0.0
        basic = float(eps.sum())
        if self.schedule.composition == "advanced":
            return min(basic, compose_advanced(eps, delta_prime=self.schedule.delta_prime).epsilon)
        return basic

    def privacy_report(self, server_round: int) -> dict[str, float]:
        eps = self.spent(server_round)
        return {"epsilon": eps, "epsilon_uplink": eps, "epsilon_downlink": eps}
