"""Server side of NADP-FL (Noise-Annihilation DP-FL).

Round ``t`` (all inside ``configure_train`` / ``aggregate_train``):

1. sample ``round(q N)`` clients (run-config ``sample-rate`` = q);
2. key phase (:func:`strategies.pairwise_phase.run_key_phase`): X25519
   keys of the key epoch plus each client's ``|D_i|`` (fetched only from clients
   the server holds no key of); the participants are those with a key;
3. calibration (Theorem 1 / Eq. 3 with the record-level sensitivity of the
   clients' per-example-clipped local SGD, :func:`protocols.nadp.local_sgd_sensitivity`):
   ``sigma_up = Delta_up sqrt(4T ln(1/delta))/eps`` for each upload and
   ``sigma_down = Delta_down sqrt(4T ln(1/delta))/eps`` for the aggregate;
   ``lambda`` from ``nadp-lambda`` (> 0) or Eq. 8 from ``nadp-tau``;
4. the train message carries the public plan (ids, sizes, sigmas, lambda); each
   client recomputes the allocation (Alg. 2) and uploads its noised model;
5. aggregation ``sum_i p_i upload_i`` in float64: the pair noise cancels, the
   residual noise (std ``sigma_down``) stays. A client that drops out after the
   key phase leaves its pair noise with the survivors uncancelled; the round
   goes on over the survivors (weights renormalised) and reports it.

Accounting (:meth:`NadpStrategy.privacy_report`), per record, over the rounds
its owner took part in (sampling is public here: the server draws it from the
run seed, so no amplification by sampling is claimed):

* ``epsilon_uplink``: RDP accountant on what the server / an eavesdropper sees
  of a client: *all* uploads jointly (pair noise is correlated across uploads,
  :meth:`protocols.nadp.NoiseAllocation.joint_uplink_std`); the aggregate is a
  function of the uploads, so this view includes it;
* ``epsilon_downlink``: RDP accountant on the published aggregate alone;
* ``epsilon`` = max of the two (the worst of the two adversaries).

The paper's own figures (Lemma 2 composition: uplink and downlink as ``2T``
queries, no ``rho`` term) go to ``epsilon_paper``, ``epsilon_uplink_paper``,
``epsilon_downlink_paper`` via :meth:`report`, next to
``epsilon_uplink_marginal`` (accountant on one upload seen alone, the paper's
uplink view).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from logging import WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from client.wire import from_record, to_record
from protocols.arrays import flatten, unflatten
from protocols.config import ConfigError, RunConfig
from protocols.nadp import (
    AccountantSpec,
    NoiseAllocation,
    calibrate_from_sensitivities,
    compensation_factor,
    dropout_residual,
    gaussian_sigma,
    local_sgd_sensitivity,
    normalize_weights,
    rdp_epsilon,
    upload_noise_scales,
)
from strategies.base import CancelStrategy, RoundFailed, split_replies
from strategies.pairwise_phase import KeyRound, forget_unresponsive, probe_residual, run_key_phase


@dataclass
class RoundState:
    """What the server keeps between ``configure_train`` and ``aggregate_train`` of one round."""

    keys: KeyRound
    sizes: dict[int, int]
    weights: dict[int, float]
    sensitivity: dict[int, float]  # per-record L2 sensitivity of each client's local model
    lam: float
    allocation: NoiseAllocation | None  # None for the record-ldp variant
    ldp_stds: dict[int, float] = field(default_factory=dict)  # record-ldp: upload noise std per client
    sigma_up: float = 0.0
    sigma_down: float = 0.0


class NadpStrategy(CancelStrategy):
    """NADP-FL: pairwise counteracting noise for the uplink, residual noise for the downlink."""

    wire_dtype = np.float64

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        if 0.0 < cfg.nadp_lambda < 1.0:
            raise ConfigError(f"run-config 'nadp-lambda' = {cfg.nadp_lambda} must be 0 (derive from nadp-tau) "
                              "or >= 1 (a smaller factor would undercut sigma_up)")
        self.variant = cfg.nadp_variant
        #: Eq. 3 noise multiplier sigma / Delta of each phase (paper's composition over 2T queries).
        self.z_eq3 = gaussian_sigma(1.0, cfg.epsilon, cfg.delta, 2.0 * cfg.num_rounds)
        #: record-ldp: Lemma 3 multiplier sqrt(2 q T ln(1/delta)) / eps.
        self.z_ldp = gaussian_sigma(1.0, cfg.epsilon, cfg.delta, cfg.sample_rate * cfg.num_rounds)
        self._state: dict[int, RoundState] = {}
        # Accountant state: per client, sum over its rounds of 1/z^2 (Gaussian RDP composes additively,
        # so T Gaussian releases with multipliers z_t are one Gaussian with z = (sum z_t^-2)^-1/2).
        self._inv_z2_up: dict[int, float] = {}
        self._inv_z2_up_marginal: dict[int, float] = {}
        self._inv_z2_down: dict[int, float] = {}
        # Paper composition: sum over rounds of (Delta/sigma)^2 per phase.
        self._paper_up = 0.0
        self._paper_down = 0.0
        self._warned_steps = False

    # ----------------------------------------------------------- calibration
    def record_sensitivity(self, size: int) -> float:
        """Per-record L2 sensitivity of a local model trained on ``size`` examples (public)."""
        c = self.cfg
        return local_sgd_sensitivity(c.clip, size, lr=c.lr, epochs=c.local_epochs, batch_size=c.batch_size)

    def compensation(self, sizes: Mapping[int, int], min_degree: int | None = None) -> float:
        """``lambda``: run-config ``nadp-lambda`` if > 0, else Eq. 8 for ``nadp-tau`` over the sampled clients.

        On a sparse graph (``min_degree`` < k - 1) a client's pair noise is spread over
        its neighbours only, so Eq. 8 is applied to the smallest neighbourhood
        (k_eff = min degree + 1): the bound then assumes the colluders are a tau
        fraction of every neighbourhood, which holds for a random graph drawn
        independently of who colludes, not for a graph picked by a colluding server.
        """
        if self.cfg.nadp_lambda > 0:
            return self.cfg.nadp_lambda
        ratio = max(sizes.values()) / min(sizes.values())
        k = len(sizes) if min_degree is None else min(len(sizes), min_degree + 1)
        try:
            return compensation_factor(self.cfg.nadp_tau, k=k, size_ratio=ratio)
        except ValueError as err:
            # (1 - tau) k <= 1: no honest partner is left to hide behind, no lambda can help.
            log(WARNING, "nadp: %s; using lambda = 1 (no collusion protection this round)", err)
            return 1.0

    def plan_round(self, server_round: int, keys: KeyRound) -> RoundState:
        """Calibrate and allocate the round's noise from the participants' reported sizes."""
        missing = [n for n in keys.participants if n not in keys.num_examples]
        if missing:
            raise RoundFailed(f"round {server_round}: nodes {missing} did not report num-examples with their key; "
                              "nadp needs every participant's |D_i|")
        sizes = {n: keys.num_examples[n] for n in keys.participants}
        if not self._warned_steps and (self.cfg.local_epochs > 1 or self.cfg.batch_size < max(sizes.values())):
            self._warned_steps = True
            log(WARNING, "nadp: local-epochs=%d, batch-size=%d give several local SGD steps; the record sensitivity "
                "is then 2C*lr*(1/b + steps - 1) (a record also influences later steps through the weights), far "
                "above Lemma 1's 2C*lr/|D_i|. Use local-epochs=1 and batch-size >= |D_i| (one full-batch step, as "
                "in the paper's experiments) for a useful model.", self.cfg.local_epochs, self.cfg.batch_size)
        weights = normalize_weights(sizes)
        sens = {n: self.record_sensitivity(s) for n, s in sizes.items()}
        if self.variant == "record-ldp":
            # Lemma 3: each client meets (eps, delta) alone over ~qT releases with its own sensitivity.
            stds = {n: self.z_ldp * sens[n] for n in sizes}
            return RoundState(keys, sizes, weights, sens, 1.0, None, stds)
        sig = calibrate_from_sensitivities(self.cfg.epsilon, self.cfg.delta, self.cfg.num_rounds, sens, sizes)
        sparse = any(len(nb) != len(sizes) - 1 for nb in keys.neighbours.values())
        alloc = upload_noise_scales(sizes, sig.sigma_up, sig.sigma_down, graph=keys.neighbours if sparse else None)
        min_degree = min(len(nb) for nb in keys.neighbours.values()) if sparse else None
        return RoundState(keys, sizes, weights, sens, self.compensation(sizes, min_degree), alloc,
                          sigma_up=sig.sigma_up, sigma_down=sig.sigma_down)

    def plan_config(self, st: RoundState) -> ConfigRecord:
        """The public plan every participant gets (identical for all, so all pairs agree)."""
        ids = st.keys.participants
        rec = ConfigRecord({
            "nadp-variant": self.variant,
            "nadp-ids": [str(n) for n in ids],
            "nadp-sizes": [int(st.sizes[n]) for n in ids],
            "nadp-sigma-up": float(st.sigma_up),
            "nadp-sigma-down": float(st.sigma_down),
            "nadp-lambda": float(st.lam),
            # 0: every two participants pair (Alg. 2); n: the random n-out graph of the round's graph-seed.
            "nadp-n-out": self.cfg.n_out if st.allocation is not None and st.allocation.pair_table is not None else 0,
        })
        if st.ldp_stds:
            rec["nadp-ldp-stds"] = [float(st.ldp_stds[n]) for n in ids]
        return rec

    # ------------------------------------------------------------ Flower API
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Sample, run the key phase, calibrate/allocate, send model + plan + peer keys."""
        self._round_report = {}
        nodes = self.sample_nodes(grid, server_round)
        keys = run_key_phase(self, grid, server_round, nodes)
        st = self.plan_round(server_round, keys)
        self._state = {server_round: st}
        base = dict(self.train_config(server_round))
        plan = dict(self.plan_config(st))

        def content(node: int) -> RecordDict:
            cfg = ConfigRecord({**base, **plan, **dict(keys.peer_config(node))})
            return RecordDict({"arrays": arrays, "config": cfg})

        return self.make_messages(keys.participants, content)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """``sum_{i in S} p_i upload_i / P_S`` over the survivors S (float64), with dropout reporting."""
        st = self._state.get(server_round)
        if st is None:
            raise RoundFailed(f"round {server_round}: no nadp plan (configure_train did not run)")
        good, errors = split_replies(replies)
        forget_unresponsive(self, st.keys.participants, good)
        for e in errors:
            log(WARNING, "round %d: %s", server_round, e.splitlines()[0])
        part = set(st.keys.participants)
        by_node = {r.metadata.src_node_id: r for r in good if r.metadata.src_node_id in part}
        if not by_node:
            raise RoundFailed(f"round {server_round}: no nadp participant uploaded ({len(errors)} errors)")
        survivors = sorted(by_node)
        uploads = {n: from_record(by_node[n].content["arrays"]) for n in survivors}
        like = uploads[survivors[0]]
        flat = {n: flatten(u) for n, u in uploads.items()}
        dims = {v.shape for v in flat.values()}
        if len(dims) != 1:
            raise RoundFailed(f"round {server_round}: uploads have different shapes {sorted(dims)}")
        dim = next(iter(dims))[0]

        acc = np.zeros(dim, dtype=np.float64)
        for n in survivors:  # ascending id order: reproducible float64 sum
            acc += st.weights[n] * flat[n]
        dropped = sorted(part - set(survivors))
        weight_sum = math.fsum(st.weights[n] for n in survivors)
        if dropped:
            acc /= weight_sum  # renormalise over the survivors
        self._account(server_round, st, survivors, dim)
        self._report_round(st, good, survivors, dropped, dim)
        return to_record(unflatten(acc, like), self.wire_dtype), self.mean_metrics(list(by_node.values()))

    # ------------------------------------------------------------- reporting
    def _noise_after(self, st: RoundState, survivors: list[int]) -> tuple[float, float]:
        """(per-coordinate std of all noise in the aggregate, of the uncancelled pair part)."""
        if st.allocation is None:  # record-ldp: independent noise, nothing to cancel
            w = sum(st.weights[n] for n in survivors)
            var = math.fsum((st.weights[n] * st.ldp_stds[n]) ** 2 for n in survivors)
            return math.sqrt(var) / w, 0.0
        if len(survivors) == len(st.allocation.client_ids):
            return st.allocation.aggregate_std, 0.0
        dr = dropout_residual(st.allocation, survivors, st.lam, renormalize=True)
        return dr.total_std, dr.uncancelled_std

    def _report_round(self, st: RoundState, good: list[Message], survivors: list[int], dropped: list[int],
                      dim: int) -> None:
        total_std, unc_std = self._noise_after(st, survivors)
        figures: dict[str, float] = {
            "aggregate_noise_std": total_std,
            "uncancelled_noise_std": unc_std,
            # expected L2 norm of the uncancelled pair noise in the aggregate (0 without dropout)
            "uncancelled_noise_norm": unc_std * math.sqrt(dim),
            "clients_dropped": float(len(dropped)),
            "nadp_lambda": st.lam,
        }
        if st.allocation is not None:
            figures["sigma_up"] = st.sigma_up
            figures["sigma_down"] = st.sigma_down
            figures["min_uplink_std"] = min(st.allocation.uplink_std(n, st.lam) for n in st.allocation.client_ids)
        if dropped:
            log(WARNING, "nadp: %d of %d participants did not upload; their pair noise with the %d survivors "
                "stays in the model (per-coordinate std %.3g)", len(dropped), len(st.keys.participants),
                len(survivors), unc_std)
        if self.cfg.cancellation_check and st.allocation is not None:
            res = probe_residual([r for r in good if r.metadata.src_node_id in set(survivors)])
            if res is not None:
                figures["cancellation_residual"] = res
        self.report(**figures)

    def _account(self, server_round: int, st: RoundState, survivors: list[int], dim: int) -> None:
        """Add this round's releases to the per-client RDP sums and to the paper's composition."""
        w_s = math.fsum(st.weights[n] for n in survivors)
        total_std, _ = self._noise_after(st, survivors)
        # Downlink: a record of survivor i moves the (renormalised) aggregate by <= p_i Delta_i / P_S.
        d_down = max(st.weights[n] * st.sensitivity[n] for n in survivors) / w_s
        z_down = total_std / d_down
        if st.allocation is None:
            z_up = {n: st.ldp_stds[n] / st.sensitivity[n] for n in survivors}
            z_marg = z_up
            self._paper_up += self.cfg.sample_rate * max(z ** -2 for z in z_up.values())  # Lemma 3: qT queries
        else:
            # The server sees a subset of the uploads when clients drop out: the full joint view is a
            # conservative (more informative) stand-in for it.
            joint = st.allocation.joint_uplink_std(st.lam)
            z_up = {n: joint[n] / st.sensitivity[n] for n in survivors}
            z_marg = {n: st.allocation.uplink_std(n, st.lam) / st.sensitivity[n] for n in survivors}
            self._paper_up += (max(st.sensitivity.values()) / st.sigma_up) ** 2
            self._paper_down += (d_down / total_std) ** 2
        for n in survivors:
            self._inv_z2_up[n] = self._inv_z2_up.get(n, 0.0) + 1.0 / z_up[n] ** 2
            self._inv_z2_up_marginal[n] = self._inv_z2_up_marginal.get(n, 0.0) + 1.0 / z_marg[n] ** 2
            self._inv_z2_down[n] = self._inv_z2_down.get(n, 0.0) + 1.0 / z_down ** 2

    def _accountant_epsilon(self, inv_z2: dict[int, float]) -> float:
        """Worst client's epsilon for its composed Gaussian releases (no sampling amplification)."""
        if not inv_z2:
            return 0.0
        worst = max(inv_z2.values())
        if worst <= 0.0:
            return 0.0
        if not math.isfinite(worst):
            return math.inf
        return rdp_epsilon(AccountantSpec(1.0 / math.sqrt(worst), 1.0, 1), self.cfg.delta)

    def privacy_report(self, server_round: int) -> dict[str, float]:
        """Accountant epsilons (uplink joint view, downlink, max) + the paper's figures via :meth:`report`."""
        up = self._accountant_epsilon(self._inv_z2_up)
        down = self._accountant_epsilon(self._inv_z2_down)
        log_term = 2.0 * math.log(1.0 / self.cfg.delta)
        paper_up = math.sqrt(log_term * self._paper_up)
        paper_down = math.sqrt(log_term * self._paper_down)
        self.report(
            epsilon_uplink_marginal=self._accountant_epsilon(self._inv_z2_up_marginal),
            epsilon_uplink_paper=paper_up,
            epsilon_downlink_paper=paper_down,
            epsilon_paper=math.sqrt(log_term * (self._paper_up + self._paper_down)),
        )
        return {"epsilon": max(up, down), "epsilon_uplink": up, "epsilon_downlink": down}

    def describe(self) -> dict[str, float | str]:
        """Key parameters (summary.json)."""
        c = self.cfg
        out: dict[str, float | str] = {
            "variant": self.variant,
            "noise_multiplier_eq3": self.z_eq3 if self.variant == "nadp" else self.z_ldp,
            "lambda": c.nadp_lambda if c.nadp_lambda > 0 else f"Eq. 8 (tau={c.nadp_tau})",
            "local_epochs": float(c.local_epochs),
            "batch_size": float(c.batch_size),
            "clipping": "per-example",
        }
        return out
