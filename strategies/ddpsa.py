"""DDP-SA parameter server (Wei et al., Algorithm 2): reconstruct the secret-shared noisy sum.

Round ``t`` (the stages of :mod:`strategies.stages`):

1. ``plan`` learns each new sampled node's roster name (``query.ddpsa_identity``), then opens the round
   on the ``m`` intermediate servers (signed with ``ddpsa-server-key``) with the participants' names; fewer than
   the sharing threshold ``t`` taking it fails the round before clients work;
2. each client (:mod:`client.methods.ddpsa`) pushes one share of its encoded noisy clipped gradient sum to every
   intermediate server and replies with a receipt;
3. ``aggregate`` asks every server for its partial sum over the clients that replied (a distributed or Gaussian
   round: all of its participants, :func:`protocols.ddpsa_floor.ddpsa_min_summed`, the terms the clients' pushes carry),
   reconstructs from ``t`` of them (else :class:`RoundFailed`, the round sealed unreleased), divides by
   ``N = sum N_i`` and steps with the server optimizer (``server-optimizer``; SGD:
   ``theta_{t+1} = theta_t - eta * sum_i s_i / N``);
4. ``account`` composes the round's ``eps_t`` once its sum was reconstructed, and its planned release when the
   round was aborted after clients pushed (their ledgers record it); a checkpoint written while the round is in
   flight holds that planned release, so a crash and ``--resume`` keep server and clients agreeing.

``self.privacy`` composes ``eps_t`` (:func:`protocols.privacy.per_round_epsilons`, Theorem 2, Eq. 12, or the PLD
calibration of ``ddpsa-composition = "pld"``) when a round's sum is reconstructed, or the epsilon the noise present
really gives (:func:`protocols.ddpsa.gamma_difference_epsilon`) as a pure-DP release; ``ddpsa-noise = "gaussian"``
rounds compose exactly (Gaussian DP) as Gaussian releases of cdp's multiplier ``z``, or of the smaller multiplier
the honest shares present leave (:func:`protocols.ddpsa.present_multiplier`).
Sharing, noise, trust: ``docs/methods/ddpsa.md``.
"""

from __future__ import annotations

import math
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from protocols.arrays import flatten, unflatten
from protocols.config import ConfigError, RunConfig
from protocols.ddpsa import (
    central_scale,
    composition_accountant,
    gamma_difference_epsilon,
    gaussian_multiplier,
    gaussian_share_std,
    honest_participants,
    honest_present,
    min_frac_bits,
    present_multiplier,
)
from protocols.ddpsa_floor import ddpsa_min_summed, separable_sums
from protocols.methods.ddpsa import DdpsaOptions, unallocatable
from protocols.privacy import (
    BudgetSchedule,
    DpEvent,
    Event,
    GaussianEvent,
    LaplaceEvent,
    PrivacyLedger,
    l1_sensitivity,
    laplace_scale,
    per_round_epsilons,
)
from protocols.privacy.budget import crosses
from protocols.privacy.signal import NoiseEstimate, Release, gaussian_norm
from protocols.secret_sharing import FixedPointCodec
from protocols.server_optimizers import make_server_optimizer, optimizer_from_state
from protocols.wire.arrays import Weights, from_record
from protocols.wire.common import merge_configs, num_examples
from protocols.wire.ddpsa import IDENTITY_ACTION, DdpsaRound, RosterName, ShareReceipt
from protocols.wire.intermediate import (
    IntermediateServers,
    PartialSumUnavailableError,
    abort_round,
    reconstruct_sum,
    register_run,
)
from protocols.wire.intermediate.auth import load_signer
from strategies.base import CancelStrategy, RoundFailed, RoundState
from strategies.records import to_record
from strategies.validation import UploadSpec

#: Seconds the pre-round registration waits for each intermediate server.
REGISTER_TIMEOUT_S = 5.0


def parse_servers(text: str) -> list[str]:
    """``"h1:p1, h2:p2"`` -> ``["h1:p1", "h2:p2"]`` (empty string -> [])."""
    return [a.strip() for a in text.split(",") if a.strip()]


@dataclass
class DdpsaState(RoundState):
    """One DDP-SA round: the global model the clients' gradient sums were computed at, the participants' names."""

    global_weights: Weights
    #: participant node -> its roster name (the names its shares are pushed under).
    names: dict[int, str]
    #: What the round's reconstructed sum released (set by the aggregate stage; None: nothing released).
    released: Event | None = None


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
        try:
            self.schedule: BudgetSchedule = per_round_epsilons(
                cfg.epsilon, cfg.delta, cfg.num_rounds, allocation=cfg.ddpsa_allocation, alpha=cfg.ddpsa_decay,
                composition=cfg.ddpsa_composition)
        except ValueError as err:
            raise unallocatable(cfg, err) from err
        # Rounds released so far, composed as the schedule was certified and as every client's ledger composes them.
        #: ``ddpsa-noise = "gaussian"``: cdp's noise multiplier for the run's (epsilon, delta, rounds); else None.
        self.z: float | None = (gaussian_multiplier(cfg.epsilon, cfg.delta, cfg.num_rounds)
                                if cfg.ddpsa_noise == "gaussian" else None)
        if cfg.ddpsa_noise != "local":
            try:
                self._counted(max(cfg.clients_per_round, 1))
            except ValueError as err:
                raise ConfigError(f"method 'ddpsa': run-config 'ddpsa-collude-frac' / 'ddpsa-dropout-frac': {err}"
                                  ) from err
        spent = composition_accountant(cfg.ddpsa_composition, cfg.ddpsa_noise)
        self.privacy = PrivacyLedger(cfg.delta, uplink=spent, downlink=spent)
        self.codec = FixedPointCodec(frac_bits=cfg.ddpsa_frac_bits, max_clients=max(cfg.num_clients, 2))
        if cfg.ddpsa_noise != "local":  # every client refuses a grid that rounds its split noise away
            need = min_frac_bits(max(cfg.clients_per_round, 1), central_scale(
                cfg.clip, adjacency=cfg.adjacency, epsilon=max(self.schedule.epsilons), multiplier=self.z or 0.0))
            most = DdpsaOptions.keys()["ddpsa-frac-bits"].metadata["high"]
            if self.codec.frac_bits < need:
                fix = (f"set it to {need} or more" if need <= most else f"the most it takes is {most}: lower "
                       "'epsilon' or raise 'clip' for a central noise the grid can keep")
                raise ConfigError(f"method 'ddpsa': run-config 'ddpsa-frac-bits' = {self.codec.frac_bits} is too "
                                  f"coarse for this run's noise (its clients need at least {need}: the fixed-point "
                                  f"round-off of their shares must stay far below the central noise); {fix}")
        #: Servers whose partial sums reconstruct a round; ``shamir`` is it for Shamir sharing, None for additive.
        self.threshold = cfg.ddpsa_sharing_threshold
        self.shamir: int | None = None if self.threshold == self.m else self.threshold
        if cfg.ddpsa_noise != "local" and cfg.ddpsa_dropout_frac > 0 and separable_sums(self.threshold, self.m):
            raise ConfigError(f"method 'ddpsa': run-config 'ddpsa-dropout-frac' = {cfg.ddpsa_dropout_frac:g} needs "
                              f"'ddpsa-threshold' above half of the {self.m} intermediate servers (got "
                              f"{self.threshold}): two disjoint sets of {self.threshold} servers could each "
                              "reconstruct a sum over other clients, so every share is summed with all the "
                              "participants it was shown and no dropout is tolerated")
        # The servers last: `cancelfl run`/`deploy` start local ones after preflight, which checks all of the above.
        self.addresses = parse_servers(cfg.ddpsa_servers)
        if not self.addresses:
            raise ConfigError(
                "method 'ddpsa' needs its intermediate servers: set run-config 'ddpsa-servers' (host:port,...), "
                "'ddpsa-ca' and 'ddpsa-server-key' (clients take the servers from their own configuration), or start "
                "the run with `cancelfl run` / `cancelfl deploy`, which start local ones"
            )
        if len(self.addresses) != self.m:
            raise ConfigError(
                f"run-config 'ddpsa-servers' lists {len(self.addresses)} address(es) but 'ddpsa-num-servers' = {self.m}; "
                "give exactly one host:port per intermediate server"
            )
        try:
            self.servers = IntermediateServers.load(self.addresses, cfg.ddpsa_ca)
            #: The parameter server's identity: the only signer the intermediate servers let read partial sums.
            self.signer = load_signer(cfg.ddpsa_server_key)
        except (OSError, ValueError) as err:
            raise ConfigError(f"method 'ddpsa': cannot load run-config 'ddpsa-ca' / 'ddpsa-server-key' ({err})") from err
        self.run_id = uuid.uuid4().hex
        #: The step with the reconstructed mean gradient: SGD with ``lr`` (Algorithm 2) or Adam (the paper's Sec. VI).
        self.optimizer = make_server_optimizer(cfg.server_optimizer, cfg.lr)
        #: Last reconstructed aggregate: decoded sum of the clients' noisy sums (diagnostics, tests).
        self.last_decoded_sum: np.ndarray | None = None
        #: node -> roster name, learned once per node (``query.ddpsa_identity``).
        self.names: dict[int, str] = {}
        #: The round whose train messages went out and its planned release, until its account stage.
        self._in_flight: tuple[int, Event] | None = None

    # ------------------------------------------------------------ servers
    def _open_round(self, server_round: int, length: int, participants: list[str]) -> None:
        """Open the round for ``participants`` on the m servers; fail it early (clients do no work) below threshold."""
        failures = register_run(self.servers, self.run_id, server_round, length, max(self.cfg.clients_per_round, 2), self.signer,
                                participants=participants, prime_field=self.shamir is not None,
                                timeout=REGISTER_TIMEOUT_S)
        if self.m - len(failures) < self.threshold:
            scheme = "additive" if self.shamir is None else f"{self.threshold}-of-{self.m} Shamir"
            raise RoundFailed(
                f"round {server_round}: DDP-SA needs {self.threshold} of {self.m} intermediate servers ({scheme} "
                f"secret sharing) but {len(failures)} did not open the round: "
                + "; ".join(f"intermediate {f}" for f in failures)
            )
        for f in failures:
            log(WARNING, "round %d: intermediate %s is down; %d-of-%d sharing goes on without it", server_round, f,
                self.threshold, self.m)

    # ------------------------------------------------------------ round hooks
    def epsilon_of_round(self, server_round: int) -> float:
        """``eps_t`` of round ``server_round`` (1-based)."""
        return float(self.schedule.epsilons[server_round - 1])

    def learn_names(self, grid: Grid, nodes: list[int]) -> dict[int, str]:
        """Roster names of ``nodes`` (asked once per node); nodes without one, or sharing one, are left out."""
        unknown = [n for n in nodes if n not in self.names]
        if unknown:
            replies, _ = self.exchange(grid, unknown, lambda _n: RecordDict(), IDENTITY_ACTION)
            for node, reply in replies.items():
                try:
                    self.names[node] = RosterName.from_content(reply.content).name
                except ValueError as err:
                    log(WARNING, "node %s: no roster name (%s); left out", node, err)
        named = {n: self.names[n] for n in nodes if n in self.names}
        counts = Counter(named.values())
        for n in [n for n, name in named.items() if counts[name] > 1]:
            log(WARNING, "node %s gives the roster name %r of another sampled node; left out", n, named.pop(n))
        return named

    def plan(self, grid: Grid, st: RoundState) -> DdpsaState:
        """Plan stage: learn the participants' names, open the round on the m servers before any client works.

        Raises:
            RoundFailed: fewer than 2 sampled nodes gave a usable roster name, or the servers refused the round.
        """
        assert self.round_model is not None
        server_round = st.round
        weights = from_record(self.round_model)
        names = self.learn_names(grid, st.participants)
        if len(names) < 2:
            raise RoundFailed(f"round {server_round}: {len(names)} sampled node(s) gave a usable roster name; "
                              "DDP-SA needs at least 2")
        if self.cfg.ddpsa_noise != "local":  # the clients refuse a round too short for the colluders they count
            try:
                self._counted(len(names))
            except ValueError as err:
                raise RoundFailed(f"round {server_round}: {err}") from err
        self._open_round(server_round, flatten(weights).size, sorted(names.values()))
        return DdpsaState(server_round, sorted(names), weights, names)

    def upload_spec(self, state: RoundState) -> UploadSpec:
        """No arrays: the shares go to the intermediate servers (a reply is checked for size and num-examples)."""
        return {}

    def train_config(self, server_round: int) -> dict[str, Any]:
        """The round number and this round's :class:`~protocols.wire.ddpsa.DdpsaRound` (after :meth:`plan`)."""
        state = self._state
        if not isinstance(state, DdpsaState) or state.round != server_round:
            raise RoundFailed(f"round {server_round}: no participant list (the plan stage did not run for this round)")
        plan = DdpsaRound(self.epsilon_of_round(server_round), self.cfg.ddpsa_noise,
                          tuple(sorted(state.names.values())), tuple(self.addresses), self.threshold, self.run_id,
                          self.codec.frac_bits, self.codec.max_clients, self.z or 0.0)
        return merge_configs(super().train_config(server_round), plan.to_config())

    def aggregate(self, state: DdpsaState) -> ArrayRecord:
        """Aggregate stage: fetch the m partial sums over the replying clients, reconstruct, decode, average by N, step.

        Raises:
            RoundFailed: too few pushed under their roster names, no finite epsilon, or the reconstruction failed
                (each seals the round unreleased on the servers), or the decoded sum does not fit the model.
        """
        rnd = state.round
        by_node = dict(state.replies)
        for node, r in list(by_node.items()):
            try:
                named = ShareReceipt.client_of(r.content)
            except ValueError as err:
                named = f"none ({err})"
            if named != state.names.get(node):  # left out of the sum (as a dropout); its name is asked again
                log(WARNING, "round %d: node %s pushed as %r, not as its roster name %r; left out", rnd, node, named,
                    state.names.get(node))
                del by_node[node]
                self.names.pop(node, None)
        expected = sorted(state.names[n] for n in by_node)
        if len(expected) < 2:
            abort_round(self.servers, self.run_id, rnd, self.signer)
            raise RoundFailed(f"round {rnd}: {len(expected)} participant(s) pushed under their roster names; "
                              "a partial sum needs at least 2")
        least = ddpsa_min_summed(self.cfg, self.cfg.ddpsa_noise, len(state.names), threshold=self.threshold,
                                 servers=self.m)
        if len(expected) < least:  # the clients' signed terms: the intermediate servers would refuse the sum
            abort_round(self.servers, self.run_id, rnd, self.signer)
            raise RoundFailed(f"round {rnd}: only {len(expected)} of {len(state.names)} participants pushed their "
                              f"shares; a distributed noise share is summed only with at least {least} of the "
                              "participants its client was shown (run-config 'ddpsa-dropout-frac' sizes the shares "
                              "for more dropouts), so the round is aborted unreleased")
        n_total = float(sum(num_examples(r.content["metrics"]) for r in by_node.values()))
        event = self.round_event(rnd, len(state.names), len(expected), flatten(state.global_weights).size)
        if event is None:
            abort_round(self.servers, self.run_id, rnd, self.signer)
            raise RoundFailed(
                f"round {rnd}: only {len(expected)} of {len(state.names)} participants pushed their shares; the "
                f"distributed noise present gives no finite epsilon (ddpsa-collude-frac "
                f"{self.cfg.ddpsa_collude_frac}), so the round is aborted unreleased")
        if crosses(self.privacy, event, self.cfg.epsilon):  # the run's epsilon is a hard cap
            abort_round(self.servers, self.run_id, rnd, self.signer)
            cost = (f"noise multiplier {event.noise_multiplier:.4g}" if isinstance(event, GaussianEvent)
                    else f"epsilon {event.epsilon:.4g}")
            raise RoundFailed(f"round {rnd}: its release would cost {cost} ({len(expected)} of "
                              f"{len(state.names)} participants pushed their shares) and take the run past its target "
                              f"epsilon {self.cfg.epsilon:g}, so the round is aborted unreleased")
        t0 = time.perf_counter()
        try:
            ring_total = reconstruct_sum(self.servers, self.run_id, rnd, expected, self.signer, threshold=self.shamir)
        except PartialSumUnavailableError as err:
            # Seal the round unreleased wherever possible and forget the partial sums: no model, no epsilon.
            abort_round(self.servers, self.run_id, rnd, self.signer)
            raise RoundFailed(f"round {rnd}: DDP-SA reconstruction impossible, {err}") from err
        reconstruct_time = time.perf_counter() - t0
        state.released = event  # the round's noisy sum is reconstructed: the account stage charges it
        decoded = self.codec.decode(ring_total)
        theta = flatten(state.global_weights)
        if decoded.size != theta.size:
            raise RoundFailed(f"round {rnd}: reconstructed {decoded.size} values, the model has {theta.size}")
        self.last_decoded_sum = decoded
        grad = decoded / n_total
        # What the server steps with (the runner's measured noise check), and the noise in it.
        std = self.mean_noise_std(len(expected), n_total, rnd, participants=len(state.names))
        self.last_release = Release(grad.copy(), grad.size * std ** 2)
        try:  # the server's step with the released gradient (post-processing; run-config server-optimizer)
            (theta_new,) = self.optimizer.step([theta], [grad])
        except ValueError as err:
            raise RoundFailed(f"round {rnd}: {err}") from err
        new = unflatten(theta_new, state.global_weights)
        self.report(
            **({"noise_multiplier_round": event.noise_multiplier} if isinstance(event, GaussianEvent)
               else {"epsilon_round": event.epsilon}),
            grad_norm=float(np.linalg.norm(grad)),
            reconstruct_time_s=reconstruct_time,
            # Fixed-point round-off of the averaged gradient: <= n * 2^-(frac_bits+1) / N per coordinate.
            roundoff_bound=len(expected) * self.codec.resolution / 2 / n_total,
        )
        return to_record(new, self.wire_dtype)

    # ------------------------------------------------------------ reporting
    def _counted(self, participants: int) -> int:
        """``n'``: the shares of ``participants`` counted on for one central noise (:func:`honest_participants`)."""
        return honest_participants(participants, self.cfg.ddpsa_collude_frac, self.cfg.ddpsa_dropout_frac,
                                   per_round=self.cfg.clients_per_round)

    def _present(self, participants: int, pushed: int) -> int:
        """Honest shares a sum over ``pushed`` of ``participants`` holds at least (:func:`honest_present`)."""
        return honest_present(participants, pushed, self.cfg.ddpsa_collude_frac, self.cfg.clients_per_round)

    def round_charge(self, server_round: int, participants: int, pushed: int, dim: int) -> float:
        """Epsilon of round ``server_round`` when ``pushed`` of ``participants`` shares are summed.

        ``"local"``: ``eps_t``.  ``"distributed"``: the honest shares present (:meth:`_present`; at least a receiving
        participant's own share is known), out of the
        ``n'`` that make one ``Lap(b)``: :func:`protocols.ddpsa.gamma_difference_epsilon` (``inf`` when unbounded).
        """
        eps_t = self.epsilon_of_round(server_round)
        if self.cfg.ddpsa_noise == "local":
            return eps_t
        honest = self._counted(participants)
        present = self._present(participants, pushed)
        if present <= 0:
            return math.inf
        return gamma_difference_epsilon(present / honest, eps_t, dim)

    def round_event(self, server_round: int, participants: int, pushed: int, dim: int) -> Event | None:
        """What round ``server_round`` releases when ``pushed`` of ``participants`` shares are summed (None: unbounded).

        Laplace modes: :meth:`laplace_release` of :meth:`round_charge` (a :class:`LaplaceEvent` at ``eps_t``, a
        pure-DP :class:`DpEvent` above it).  ``"gaussian"``: a :class:`GaussianEvent` of the
        multiplier the honest shares present leave (:func:`protocols.ddpsa.present_multiplier`; composed exactly).
        """
        if self.z is not None:
            z = present_multiplier(self.z, self._counted(participants),
                                   self._present(participants, pushed))
            return GaussianEvent(z) if z > 0 else None
        epsilon = self.round_charge(server_round, participants, pushed, dim)
        return self.laplace_release(server_round, epsilon) if math.isfinite(epsilon) else None

    def mean_noise_std(self, clients: int, examples: float, server_round: int, *, participants: int | None = None
                       ) -> float:
        """Per-entry std of the noise in the mean gradient: ``clients`` noisy sums over ``examples``.

        b = 2 clip / eps_t.  Local: each sum holds Lap(b) (variance 2 b^2), std ``sqrt(2 clients) b / examples``.
        Distributed: each holds a Gamma(1/n', b) difference (variance 2 b^2 / n', ``n'`` from ``participants``,
        default ``clients``), std ``sqrt(2 clients / n') b / examples``.  Gaussian: each holds
        ``N(0, (z Delta_2)^2 / n')``, std ``sqrt(clients / n') z Delta_2 / examples``.
        """
        if self.z is not None:  # each share N(0, (z Delta_2)^2 / n')
            honest = self._counted(clients if participants is None else participants)
            share = gaussian_share_std(l1_sensitivity(self.cfg.clip, adjacency=self.cfg.adjacency), self.z, honest)
            return math.sqrt(clients) * share / examples
        b = laplace_scale(l1_sensitivity(self.cfg.clip, adjacency=self.cfg.adjacency), self.epsilon_of_round(server_round))
        shares = 1
        if self.cfg.ddpsa_noise == "distributed":
            shares = self._counted(clients if participants is None else participants)
        return math.sqrt(2.0 * clients / shares) * b / examples

    def noise_estimate(self, num_params: int) -> NoiseEstimate | None:
        """Round-1 Laplace noise in the mean gradient (:meth:`mean_noise_std`, m clients) vs clip.

        N = all clients' examples (the largest partition times the clients when the runner knows it).
        """
        if self.max_examples is None:
            return None
        m = self.cfg.clients_per_round
        std = self.mean_noise_std(m, m * self.max_examples, 1)
        return NoiseEstimate(gaussian_norm(std, num_params), self.cfg.clip, self.cfg.num_rounds, space="gradient")

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
            "laplace_scale_first_round": laplace_scale(l1_sensitivity(self.cfg.clip, adjacency=self.cfg.adjacency),
                                                       float(eps[0])),
            "noise": self.cfg.ddpsa_noise,
            **({"noise_multiplier": self.z, "clip_norm": "l2"} if self.z is not None else {}),
            "collude_frac": self.cfg.ddpsa_collude_frac,
            "dropout_frac": self.cfg.ddpsa_dropout_frac,
            "frac_bits": self.codec.frac_bits,
            "sharing_threshold": self.threshold,
            "server_optimizer": self.optimizer.describe(),
        }

    def charge_release(self, st: RoundState) -> None:
        """Train stage: the round is in flight (the checkpoint written before its messages leave charges it).

        Nothing is composed yet: :meth:`account` composes what the round's sum released.
        """
        self._in_flight = (st.round, self.planned_release(st.round))

    def state_dict(self) -> dict:
        """The ledger plus the server optimizer's moments (resume continues the same Adam).

        While a round is in flight (its messages went out, its account stage has not run) the ledger includes its
        planned release: a client records it when it pushes its shares, so a crash before the account stage
        resumes with the server's account equal to the clients' ledgers (the repeated round is charged again).
        """
        out = {**super().state_dict(), "optimizer": self.optimizer.to_state()}
        st = self._state
        if (self._in_flight is not None and st is not None and st.round == self._in_flight[0] and not st.aggregating
                and not st.replies and not st.dropped):
            ledger = PrivacyLedger.from_state(out["privacy"])
            ledger.compose(self._in_flight[1])
            out["privacy"] = ledger.to_state()
        return out

    def load_state(self, state) -> None:
        super().load_state(state)
        if "optimizer" in state:
            self.optimizer = optimizer_from_state(state["optimizer"])

    def laplace_release(self, server_round: int, epsilon: float | None = None) -> Event:
        """Round ``server_round``'s pure-DP release of ``epsilon`` (:meth:`round_charge`), default ``eps_t``.

        A round whose noise is the full ``Lap(Delta_1 / eps_t)`` is a :class:`LaplaceEvent`; one whose noise gives a
        larger epsilon (missing shares: a difference of Gammas, not a Laplace) is a pure-DP :class:`DpEvent` of that
        epsilon, which every accountant charges at least as much as the nominal Laplace round.  Raises ValueError
        for an ``epsilon`` below ``eps_t``.
        """
        eps_t = self.epsilon_of_round(server_round)
        if epsilon is None or epsilon == eps_t:
            return LaplaceEvent(eps_t)
        if epsilon > eps_t:
            return DpEvent(epsilon, 0.0)
        raise ValueError(f"round {server_round}: charge {epsilon} below the round's nominal eps_t = {eps_t}")

    def planned_release(self, server_round: int) -> Event:
        """What round ``server_round`` composes when every participant's share is summed (the budget guard's plan).

        ``GaussianEvent(z)`` for ``ddpsa-noise = "gaussian"``, else ``LaplaceEvent(eps_t)`` of the run's schedule
        (Eq. 12 or the PLD calibration): the rounds the schedule certifies within the run's epsilon.
        """
        return GaussianEvent(self.z) if self.z is not None else self.laplace_release(server_round)

    def release_round(self, server_round: int, epsilon: float | None = None) -> None:
        """Compose :meth:`laplace_release` of round ``server_round`` (raises as it does)."""
        self.privacy.compose(self.laplace_release(server_round, epsilon))

    def account(self, state: DdpsaState) -> None:
        """Account stage: the round's release (:meth:`round_event`) once its noisy sum was reconstructed.

        A round aborted unreleased after clients pushed (sealed on every server reached; the parameter server
        holds fewer than ``t`` partial sums) is charged its planned release all the same: each pushing client's
        ledger records it, since no client can verify that its shares were never summed.
        """
        self._in_flight = None
        if state.released is not None:
            self.privacy.compose(state.released)
        elif state.replies:  # aborted unreleased after clients pushed: their ledgers hold the planned release
            self.privacy.compose(self.planned_release(state.round))
