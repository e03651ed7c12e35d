"""NISS (Yang et al., IEEE IoT-J 2022): DP noise built from shares whose negations cancel on the server.

Round ``r`` (all phases run inside :meth:`NissStrategy.configure_train` through the Grid):

1. ``query.keys`` (shared key phase, :func:`strategies.pairwise_phase.run_key_phase`):
   sampled clients without a key of the key epoch return an X25519 public key.  The server, acting as
   the paper's *tracker*, draws the round's neighbour lists: the adjacency of a
   complete graph or of a random n-out graph over the clients with valid keys
   (run-config ``graph``/``n-out``).
2. ``query.shares``: each client gets its neighbours' ids and public keys and its
   aggregation weight ``p_k``.  It calibrates ``sigma_k`` (below), splits its noise
   into ``v = ceil(sigma_k^2 / sigma^2)`` unit shares (``sigma^2`` = run-config
   ``niss-unit-variance``), assigns them to its neighbours, and returns *one*
   AES-256-GCM-sealed payload per neighbour (count may be 0, so the server cannot
   drop a payload unnoticed and, with the ``seed`` encoding, cannot see who got
   shares).  The relay key is the pairwise HKDF seed for purpose
   ``niss-relay-key``; the associated data binds (sender, receiver, round, run id,
   encoding).  Payload: ``seed`` encoding = (count, share std, 32-byte seed) from
   which both sides expand the same shares with :mod:`protocols.prg`;
   ``vector`` encoding = the negated share vectors themselves (float64).
   A client that fails this phase (or answers malformed) is removed, the graph is
   rebuilt over the others and the phase is re-run (fresh shares), so every share
   that is sent is also received.
3. ``train``: the server relays each client's incoming ciphertexts (it never sees
   a share) with the global model.  The client opens all of them *before*
   training; if any payload is missing, duplicated or fails authentication it
   uploads nothing and reports the offending senders, and the server fails the
   round (:class:`RoundFailed`, naming the pairs).  Dropping the pair instead is
   not possible consistently: the sender has already added its share to its own
   upload, and removing it would mean revealing part of the sender's noise to the
   server.  Otherwise the client uploads ``p_k w_k + sum_i (n_i + s_i r_i)``
   (float64) with ``s_i ~ N(1, tau_k^2)`` per coordinate from its private
   randomness.  The server *sums* the uploads; a client that drops out after the
   share exchange also fails the round (its shares cannot cancel).

Privacy calibration (documented interpretation).  A client clips its model
update ``Delta_k = w_k - w`` to L2 norm ``clip`` and uploads the weighted model
``p_k (w + Delta_k)``; since ``w`` and ``p_k`` are public, the L2 sensitivity of
the upload w.r.t. client k's data (client-level DP, add/remove convention, as
the ``ldp`` baseline) is ``p_k * clip``.  Run-config ``epsilon``/``delta`` is the
client's budget for the *whole run* (the convention of every cancelfl method):
``sigma_k = z * p_k * clip`` with ``z`` the smallest noise multiplier for which
``num-rounds`` Gaussian releases are (epsilon, delta)-DP under RDP composition
(:func:`protocols.accounting.calibrate_noise_multiplier`; no sampling
amplification, as the server knows who it sampled).  Each round is thus exactly
a Gaussian mechanism; the paper's per-round view (its Theorem 1, which is only
valid for epsilon < 1) is reported as ``epsilon_round_analytic`` (the analytic
Gaussian mechanism of one round at the same delta).  With ``tau = 1`` the
aggregate noise variance ``sum_k sigma_k^2`` equals that of ``ldp`` at the same
epsilon (uniform mean, noise std ``z * clip`` per update), so the two are
directly comparable.  Weights are uniform, ``p_k = 1/m`` (m = clients left
after the share phase): data-size weights would need the sizes before the share
phase (one more round trip) and would make the sensitivity depend on other
clients' data; the ``ldp`` baseline averages uniformly for the same reason.

Reported each round: ``theorem2_variance`` = ``sum_k sigma_k^2 tau_k^2`` (paper's
Theorem 2, from the clients' reported sigma_k, tau_k), and -- DIAGNOSTIC ONLY,
with run-config ``cancellation-check = true`` -- ``measured_noise_variance``:
clients then also send their noiseless weighted update ``p_k w_k`` in a side
record ``diagnostic`` so that the server can measure the per-coordinate variance
of ``aggregate - sum_k p_k w_k``.  That side channel hands the server every
client's unprotected update and must never be enabled in production; the same
mode reports ``exact_noise_variance`` (sum over clients of received share
variance x tau^2, which reveals share counts), ``aggregate_error_rel`` =
``||aggregate - sum_k p_k w_k|| / ||sum_k p_k w_k||`` and the framework's
random-projection ``cancellation_residual`` of the clients' total noise
(~1e-16 when tau = 0; O(1) by design when tau > 0, where the distortion is
meant to survive: compare ``measured_noise_variance`` with Theorem 2 instead).

Epsilon: uplink (what the server sees of one client) = RDP of ``server_round``
Gaussian releases with noise multiplier ``z``; this assumes the receivers of a
client's shares do not collude with the server.  Against a colluding fraction
``rho`` of neighbours, Theorem 3 asks ``tau^2 >= max(2 rho - 1, 0)``; the paper
only matches the *variance* of the residual noise (a Gaussian-times-Gaussian
sum, not a Gaussian), so that case is heuristic and ``describe()`` states
whether the configured tau meets it.  Downlink (what the global model reveals):
the aggregate noise has std ``tau * z * clip / sqrt(m)`` per coordinate, i.e.
noise multiplier ``tau * z * sqrt(m)`` over the mean's sensitivity
``clip / m``, accounted with sampling rate ``m / num-clients`` (infinite for
tau = 0; also heuristic for tau > 0 because the product noise is only
approximately Gaussian).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from client.wire import from_record, to_record
from protocols import niss as niss_math
from protocols.accounting import gaussian_epsilon, noise_multiplier
from protocols.config import RunConfig
from protocols.graphs import complete_graph, n_out_graph
from protocols.niss import client_tau
from strategies.base import CancelStrategy, RoundFailed, split_replies
from strategies.pairwise_phase import KeyRound, forget_keys, forget_unresponsive, probe_residual, run_key_phase

#: How often the share phase is re-run after clients failed it, before the round fails.
MAX_SHARE_ATTEMPTS = 3


# ------------------------------------------------------------------------------ server
@dataclass
class _RoundState:
    """What the server remembers between configure_train and aggregate_train."""

    round: int
    participants: list[int]
    neighbours: dict[int, list[int]]
    weight: float
    dropped: list[int] = field(default_factory=list)


def _node_list(values: Iterable) -> list[int]:
    return [int(v) for v in values]


class NissStrategy(CancelStrategy):
    """Server side of NISS: tracker (neighbour lists), ciphertext relay, plain sum of uploads."""

    wire_dtype = np.float64

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.z = noise_multiplier(cfg.epsilon, cfg.delta, cfg.num_rounds)
        self.tau = client_tau(cfg)
        self._state: _RoundState | None = None

    # ------------------------------------------------------------------ phases
    def _graph(self, nodes: list[int]) -> dict[int, list[int]]:
        """Tracker: each client's neighbour list (complete, or a fresh random n-out graph)."""
        if self.cfg.graph == "n-out" and self.cfg.n_out < len(nodes) - 1:
            return n_out_graph(nodes, self.cfg.n_out, os.urandom(32))
        return complete_graph(nodes)

    @staticmethod
    def _valid_share_reply(reply: Message, expected: list[int]) -> bool:
        """One sealed payload (bytes) per neighbour, in neighbour order."""
        if "config" not in reply.content:
            return False
        cfg = reply.content["config"]
        try:
            to = _node_list(cfg["niss-to"])
            blobs = list(cfg["niss-payloads"])
        except (KeyError, TypeError, ValueError):
            return False
        return to == expected and len(blobs) == len(to) and all(isinstance(b, bytes) for b in blobs)

    def _share_phase(self, grid: Grid, rnd: int, keys: KeyRound) -> tuple[_RoundState, dict[int, Message]]:
        """Run ``query.shares`` until every remaining participant answered correctly."""
        participants = list(keys.participants)
        neighbours = keys.neighbours
        dropped: list[int] = list(keys.dropped)
        for _attempt in range(MAX_SHARE_ATTEMPTS):
            weight = 1.0 / len(participants)

            def content(node: int, nbrs=neighbours, weight=weight) -> RecordDict:
                peers = nbrs[node]
                return RecordDict({"config": ConfigRecord({
                    "round": rnd,
                    "niss-weight": weight,
                    "peer-ids": [str(p) for p in peers],
                    "peer-keys": [keys.public_keys[p] for p in peers],
                    "key-epoch": keys.key_epoch,
                })})

            replies, _errors = self.exchange(grid, participants, content, "shares")
            good = {n: r for n, r in replies.items() if n in neighbours and self._valid_share_reply(r, neighbours[n])}
            failed = sorted(set(participants) - set(good))
            if not failed:
                return _RoundState(rnd, participants, neighbours, weight, dropped), good
            dropped += failed
            forget_keys(self, failed)  # re-keyed when next sampled (e.g. a node that lost its state)
            participants = sorted(good)
            if len(participants) < 2:
                break
            neighbours = self._graph(participants)
        raise RoundFailed(f"round {rnd}: NISS share exchange did not complete "
                          f"({len(participants)} client(s) left after dropping {sorted(set(dropped))})")

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Key phase, share phase, then the train messages carrying the relayed ciphertexts."""
        self._round_report = {}
        self._state = None
        nodes = self.sample_nodes(grid, server_round)
        keys = run_key_phase(self, grid, server_round, nodes)
        state, replies = self._share_phase(grid, server_round, keys)
        # Relay: the server only moves opaque ciphertexts from sender to receiver.
        inbox: dict[int, tuple[list[str], list[bytes]]] = {n: ([], []) for n in state.participants}
        for sender in state.participants:
            cfg = replies[sender].content["config"]
            for receiver, blob in zip(_node_list(cfg["niss-to"]), cfg["niss-payloads"], strict=True):
                inbox[receiver][0].append(str(sender))
                inbox[receiver][1].append(blob)
        self._state = state
        self.report(participants=len(state.participants), dropped=len(set(state.dropped)))

        def content(node: int) -> RecordDict:
            senders, blobs = inbox[node]
            return RecordDict({"arrays": arrays, "config": ConfigRecord({
                "round": server_round,
                "niss-weight": state.weight,
                "niss-from": senders,
                "niss-payloads": blobs,
                "probe-seed": keys.probe_seed,
            })})

        return self.make_messages(state.participants, content)

    # -------------------------------------------------------------- aggregation
    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Sum the uploads; fail the round if any share could not cancel."""
        state = self._state
        if state is None or state.round != server_round:
            raise RoundFailed(f"round {server_round}: no NISS share exchange state for this round")
        good, errors = split_replies(replies)
        forget_unresponsive(self, state.participants, good)
        by_node = {r.metadata.src_node_id: r for r in good}
        auth = []
        for node, r in sorted(by_node.items()):
            if "config" in r.content and list(r.content["config"].get("niss-auth-failed", [])):
                auth += [f"{s} -> {node}: {why}" for s, why in zip(r.content["config"]["niss-auth-failed"],
                                                                     r.content["config"]["niss-auth-reason"],
                                                                     strict=True)]
        if auth:
            raise RoundFailed(f"round {server_round}: relayed NISS share payload(s) rejected by the recipient "
                              f"(tampered, replayed, misrouted or missing); the round is dropped so that no "
                              f"uncancelled noise enters the model: {'; '.join(auth)}")
        missing = sorted(set(state.participants) - {n for n, r in by_node.items() if "arrays" in r.content})
        if missing:
            raise RoundFailed(f"round {server_round}: client(s) {missing} dropped out after the NISS share exchange; "
                              f"the shares they exchanged cannot cancel, so the round is dropped "
                              f"({len(errors)} error replies)")
        ordered = [by_node[n] for n in state.participants]
        uploads = [from_record(r.content["arrays"]) for r in ordered]
        agg = {k: np.sum([u[k] for u in uploads], axis=0, dtype=np.float64) for k in uploads[0]}
        sig = np.array([float(r.content["metrics"]["niss-sigma"]) for r in ordered])
        taus = np.array([float(r.content["metrics"]["niss-tau"]) for r in ordered])
        self.report(theorem2_variance=niss_math.theorem2_variance(sig, taus))
        if all("diagnostic" in r.content for r in ordered):
            self._diagnostics(agg, ordered, taus)
        return to_record(agg, self.wire_dtype), self.mean_metrics(ordered)

    def _diagnostics(self, agg: dict[str, np.ndarray], ordered: list[Message], taus: np.ndarray) -> None:
        """DIAGNOSTIC (cancellation-check): measured aggregate noise against the noiseless sum."""
        clean = [from_record(r.content["diagnostic"]) for r in ordered]
        keys = list(agg)
        noiseless = np.concatenate([np.sum([c[k] for c in clean], axis=0).ravel() for k in keys])
        total = np.concatenate([agg[k].ravel() for k in keys])
        resid = total - noiseless
        recv = np.array([float(r.content["metrics"].get("niss-received-var", 0.0)) for r in ordered])
        values = {
            "measured_noise_variance": float(np.mean(resid**2)),
            "exact_noise_variance": float(np.sum(recv * taus**2)),
            "aggregate_error_rel": float(np.linalg.norm(resid) / max(np.linalg.norm(noiseless), 1e-300)),
        }
        probe = probe_residual(ordered)
        if probe is not None:
            values["cancellation_residual"] = probe
        self.report(**values)

    # ---------------------------------------------------------------- reporting
    def describe(self) -> dict[str, float | str]:
        m = self.cfg.clients_per_round
        sigma = self.z * self.cfg.clip / m
        tau_needed = niss_math.tau_for_collusion(self.cfg.niss_rho)
        return {
            "noise_multiplier": self.z,
            "sigma_k": sigma,
            "unit_variance": self.cfg.niss_unit_variance,
            "shares_per_client": niss_math.plan_shares(sigma, math.sqrt(self.cfg.niss_unit_variance)).num_shares,
            "tau": self.tau,
            "rho": self.cfg.niss_rho,
            "tau_required_theorem3": tau_needed,
            "collusion_protected": "yes" if self.tau >= tau_needed - 1e-12 else "no",
            "share_encoding": self.cfg.niss_share_encoding,
            "epsilon_round_analytic": niss_math.analytic_gaussian_epsilon(self.z, self.cfg.delta),
            "theorem2_variance_full_round": m * sigma**2 * self.tau**2,
        }

    def privacy_report(self, server_round: int) -> dict[str, float]:
        up = gaussian_epsilon(self.z, 1.0, server_round, self.cfg.delta)
        m = self.cfg.clients_per_round
        if self.tau > 0:
            down = gaussian_epsilon(self.tau * self.z * math.sqrt(m), m / self.cfg.num_clients, server_round,
                                    self.cfg.delta)
        else:
            down = math.inf
        return {"epsilon": up, "epsilon_uplink": up, "epsilon_downlink": down}


__all__ = ["NissStrategy", "MAX_SHARE_ATTEMPTS"]

