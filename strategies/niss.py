"""Server stages of NISS (Yang et al., IEEE IoT-J 2022): DP noise from shares whose negations cancel on the server.

The round protocol, equations and the joint view of the uploads: ``docs/methods/niss.md``; messages:
:mod:`protocols.wire.niss`.  The stages of :mod:`strategies.stages`: keys (the server as the paper's tracker draws
the neighbour lists), plan (each client splits its noise into one AES-256-GCM-sealed share per neighbour, asked
for with the previous round's train message (:mod:`strategies.niss_shares`) or, for the clients that did not
answer it, in a ``query.shares`` phase; clients that fail are removed and the phase re-run, at most
:data:`MAX_SHARE_ATTEMPTS` times), train (the server relays the ciphertexts with the global model and asks for
the next round's shares), recover (a missing client's shares and the self-masks,
:mod:`strategies.recovery`), aggregate (the plain sum, renormalised to the survivors), account (the shortfall,
:func:`strategies.recovery.charge_shortfall`).

Calibration: ``sigma_k = z Delta f_k`` (:func:`protocols.niss.client_sigma`, weights
:func:`protocols.niss.aggregation_weights`), raised by the round's ``noise_scale`` from
:func:`protocols.floor.niss_floor` so the server's best linear view of a client keeps ``(z Delta f_k)^2``,
also given the material of the worst ``floor(niss-rho x d_k)`` of its ``d_k`` neighbours colluding
(:mod:`protocols.niss_joint`): the uplink claim.  The ledger's :data:`protocols.methods.NO_COLLUDER` account: the
view with no colluding neighbour (:meth:`protocols.floor.NissFloor.open_multipliers`).  Downlink multiplier
:func:`protocols.niss_joint.receiver_downlink_multiplier` (against any receiver, a participant knowing its own shares
and those it received included; the paper's :func:`protocols.niss.downlink_multiplier` counts every share);
``tau = 0`` gives no guarantee.  Reported:
``theorem2_variance`` (Theorem 2) and, with ``cancellation-check``, the measured residuals.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from protocols import niss as niss_math
from protocols.arrays import flatten, unflatten
from protocols.config import RunConfig
from protocols.methods import NO_COLLUDER
from protocols.niss import ShareBundle, client_multiplier, client_tau
from protocols.niss_joint import receiver_downlink_multiplier, recovered_multiplier, revealed_kept
from protocols.privacy import (
    GaussianEvent,
    PerUnitAccountant,
    PrivacyLedger,
    analytic_gaussian_epsilon,
    record_training_movement,
)
from protocols.privacy.signal import NoiseEstimate, gaussian_norm
from protocols.wire.arrays import from_record
from protocols.wire.niss import (
    AHEAD_RECORD,
    AuthFailures,
    Diagnostic,
    NissMetrics,
    RelayedInbox,
)
from protocols.wire.recovery import NissPairMaterial
from strategies.base import CancelStrategy, RoundFailed, RoundState
from strategies.key_phase import KeyPhase
from strategies.niss_shares import MAX_SHARE_ATTEMPTS, Ahead, SharePhase, sizes_of
from strategies.records import to_record
from strategies.recovery import PairwiseRecovery, charge_shortfall, corrected_residual, probe_direction


@dataclass
class NissRound(RoundState):
    """The round after the share phase (``keys``: its key round): the weights ``p_k``, each participant's inbox."""

    #: node -> ``p_k`` (:func:`protocols.niss.aggregation_weights` of the round's view; they sum to 1).
    weights: dict[int, float]
    #: receiver -> (sender ids, sealed payloads), in sender order.
    inbox: dict[int, tuple[list[int], list[bytes]]]
    #: The distortion std the clients derive for this round (:func:`protocols.niss.client_tau` of the sizes sent).
    tau: float = 0.0
    #: The factor on every sigma_k that the joint view of the uploads needs (:func:`protocols.floor.niss_floor`).
    noise_scale: float = 1.0
    #: node -> the uplink multiplier of its view with no colluding neighbour (:meth:`NissFloor.open_multipliers`).
    open_multipliers: dict[int, float] = field(default_factory=dict)
    #: Noise left after recovery, set by the aggregate stage for the account stage: (least uplink multiplier of a
    #: survivor, downlink multiplier of the survivors' shares, least with no colluder); None without recovery.
    noise_left: tuple[float, float, float] | None = None


def _rejections(by_node: dict[int, Message]) -> list[str]:
    """Every relayed payload a participant reported it could not open (``"sender -> receiver: why"``)."""
    lines = []
    for node, r in sorted(by_node.items()):
        if "config" not in r.content:
            continue
        try:
            lines += AuthFailures.from_config(r.content["config"]).describe(node)
        except ValueError as err:
            lines.append(f"? -> {node}: unreadable rejection report ({err})")
    return lines


def pair_contribution(m: NissPairMaterial, node: int, peer: int, size: int, tau: float) -> np.ndarray:
    """What survivor ``node``'s upload holds because of dropped ``peer``, from the material it revealed.

    Its own shares sent to ``peer`` (unless it kept them) plus the distorted negated shares received from
    ``peer`` (``tau``: the survivor's distortion std, used with its revealed distortion seed).
    """
    out = np.zeros(size)
    if m.out_seed is not None:
        out += niss_math.bundle_shares(ShareBundle(node, peer, m.out_count, m.out_std, m.out_seed), size).sum(axis=0)
    if m.in_kept:  # the peer's upload is held: its shares stay in the aggregate
        return out
    if m.in_vector is not None:
        return out + m.in_vector
    assert m.in_seed is not None
    shares = niss_math.bundle_shares(ShareBundle(peer, node, m.in_count, m.in_std, m.in_seed), size)
    if m.in_dseed is None:
        return out - shares.sum(axis=0)
    return out + niss_math.distorted_contribution(-shares, tau, m.in_dseed)


class NissStrategy(SharePhase, PairwiseRecovery, CancelStrategy):
    """Server side of NISS: tracker (neighbour lists), ciphertext relay, plain sum of uploads."""

    wire_dtype = np.float64
    #: The budget guard (:mod:`strategies.run.budget`) may raise every sigma_k by ``noise_scale`` (>= 1).
    scales_noise = True
    noise_scale = 1.0

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.tau = client_tau(cfg)
        self.keys = KeyPhase(cfg)
        self.check_largest_round()
        #: The last aggregated round's client reports (sigma_k, tau_k, shares): describe() and noise_estimate().
        self._figures: list[NissMetrics] = []
        #: the next round's share request as this round's train messages carry it (None: not asked ahead).
        self._ahead: Ahead | None = None
        #: the usable nodes of the round's sampling (the next round's key round is built over the same).
        self._nodes: list[int] = []
        # Per client: uplink (headline, niss-rho's colluders), uplink with no colluder, downlink; none with tau = 0.
        self.privacy = PrivacyLedger(cfg.delta, uplink=PerUnitAccountant() if self.tau > 0 else None,
                                     downlink=PerUnitAccountant() if self.tau > 0 else None, headline="uplink",
                                     extra={NO_COLLUDER: PerUnitAccountant()} if self.tau > 0 else None)

    @property
    def z(self) -> float:
        """The multiplier every ``sigma_k`` is calibrated for: the public schedule's most releases (clients: the same)."""
        return client_multiplier(self.cfg, self.keys.releases())

    # ------------------------------------------------------------------ stages
    def plan(self, grid: Grid, st: RoundState) -> NissRound:
        """Plan stage: the share phase over the key stage's round; the inboxes the train messages relay.

        Raises:
            RoundFailed: the share phase did not complete (:data:`MAX_SHARE_ATTEMPTS`).
        """
        assert st.keys is not None
        kr, replies = self._share_phase(grid, st.keys)
        # Relay: the server only moves opaque ciphertexts from sender to receiver.
        inbox: dict[int, tuple[list[int], list[bytes]]] = {n: ([], []) for n in kr.participants}
        for sender in kr.participants:
            for receiver, blob in zip(replies[sender].to_ids, replies[sender].payloads, strict=True):
                inbox[receiver][0].append(sender)
                inbox[receiver][1].append(blob)
        self.report(participants=len(kr.participants), dropped=len(kr.dropped))
        self.announce_masking(kr.neighbours)
        tau = client_tau(self.cfg, sizes_of(kr))
        floor = self._floor(kr, open_view=True)
        scale = floor.scale * self.noise_scale
        self.report(joint_view_scale=floor.scale)
        self._ahead = self._plan_ahead(st.round)
        return NissRound(st.round, list(kr.participants), self._weights(kr), inbox, tau, scale,
                         open_multipliers=floor.open_multipliers(self.z, self.noise_scale), keys=kr)

    def update_of(self, state: NissRound, node: int, flat: np.ndarray) -> np.ndarray:
        """A NISS upload is ``p_k w_k + noise``: its distance from ``p_k`` times the global model."""
        p = state.weights[node]
        return super().update_of(state, node, flat / p) * p

    def screen(self, state: NissRound, by_node: dict[int, Message]) -> dict[int, Message]:
        """Common checks, plus: a client that rejected relayed payloads uploaded nothing.

        It is left out of this round without a strike (dropout recovery handles it); each sender it names
        gets a strike and keeps its upload this round (its shares to the reporter are recovered).
        """
        ahead = self._ahead if self._ahead is not None and self._ahead.keys.round == state.round + 1 else None
        for node, reply in by_node.items():  # the next round's shares (the record leaves the reply either way)
            if ahead is not None:
                ahead.take(node, reply, self.share_bytes(node, ahead.keys))
            elif AHEAD_RECORD in reply.content:
                del reply.content[AHEAD_RECORD]
        reports: dict[int, AuthFailures] = {}
        for node, reply in by_node.items():
            try:
                report = AuthFailures.from_config(reply.content["config"]) if "config" in reply.content else None
            except ValueError:
                report = None  # unreadable: the common checks exclude the reply (no upload)
            if report:
                reports[node] = report
        accepted = super().screen(state, {n: r for n, r in by_node.items() if n not in reports})
        blamed: dict[int, list[int]] = {}
        for node, report in sorted(reports.items()):
            self.excluded[node] = "uploaded nothing: " + "; ".join(report.describe(node))
            for sender in report.senders:
                if sender in state.participants and sender != node:
                    blamed.setdefault(sender, []).append(node)
        for sender, receivers in sorted(blamed.items()):
            self.strikes.strike(state.round, sender, f"share payload(s) rejected by neighbour(s) {receivers}")
        return accepted

    def train_content(self, state: NissRound, node: int, arrays: ArrayRecord) -> RecordDict:
        """The global model and the ciphertexts addressed to ``node``."""
        senders, blobs = state.inbox[node]
        inbox = RelayedInbox(state.round, state.weights[node], tuple(senders), tuple(blobs), state.keys.probe_seed)
        content = RecordDict({"arrays": arrays, "config": ConfigRecord(inbox.to_config())})
        ahead = self._ahead
        if ahead is not None and node in ahead.keys.participants:  # the next round's share request
            content[AHEAD_RECORD] = self._share_request(ahead.keys, node, ahead.weights, ahead.scale)
        return content

    def aggregate(self, state: NissRound) -> ArrayRecord:
        """Aggregate stage: the sum of the uploads, renormalised to the survivors.

        Raises:
            RoundFailed: a relayed payload was rejected, or a missing client's shares were not recovered.
        """
        by_node, errors = state.replies, state.errors
        rejected = _rejections(by_node)
        if rejected:
            raise RoundFailed(f"round {state.round}: relayed NISS share payload(s) rejected by the recipient "
                              f"(tampered, replayed, misrouted or missing); the round is dropped so that no "
                              f"uncancelled noise enters the model: {'; '.join(rejected)}")
        survivors = sorted(n for n, r in by_node.items() if "arrays" in r.content)
        missing = sorted(set(state.participants) - set(survivors))
        rec = self.recovered(state)
        if missing and (rec is None or set(rec.dropped) != set(missing)):
            raise RoundFailed(f"round {state.round}: client(s) {missing} dropped out after the NISS share exchange "
                              f"and their shares were not recovered, so the round is dropped "
                              f"({len(errors)} error replies)")
        ordered = [by_node[n] for n in survivors]
        uploads = [from_record(r.content["arrays"]) for r in ordered]
        agg = {k: np.sum([u[k] for u in uploads], axis=0, dtype=np.float64) for k in uploads[0]}
        if rec is not None and rec.masks:  # double masking: the rebuilt self-masks come off the sum first
            flat = flatten(agg)
            agg.update(unflatten(flat - self.mask_sum(state, flat.size), agg))
        t0 = time.process_time()
        corrections = self._remove_orphaned_shares(state, agg, ordered)
        if self.recovered(state) is not None:
            self.report(recovery_server_s=time.process_time() - t0)
        figures = [NissMetrics.from_metrics(r.content["metrics"]) for r in ordered]
        taus = np.array([f.tau for f in figures])
        sigmas = np.array([f.sigma for f in figures])
        variance = niss_math.theorem2_variance(sigmas, taus)
        self._figures = figures
        # Per coordinate, in model units (strategies.run.report): an upload p_k w_k carries own noise sigma_k, i.e.
        # sigma_k / p_k on the model scale (mean over the clients); the aggregate keeps Theorem 2's variance.
        p = np.array([state.weights[n] for n in survivors])
        self.report(theorem2_variance=variance, upload_noise_std=float(np.mean(sigmas / p)),
                    model_noise_std=float(np.sqrt(variance)),
                    shares_per_client=float(np.mean([f.shares for f in figures])))
        clean = [Diagnostic.from_content(r.content) for r in ordered]
        if self.cfg.cancellation_check and (probe := corrected_residual(ordered, corrections)) is not None:
            self.report(cancellation_residual=probe)
        if all(c is not None for c in clean):  # the nodes' operators allowed the noiseless-update diagnostic
            received = np.array([f.received_var or 0.0 for f in figures])
            self._diagnostics(agg, [from_record(c.update) for c in clean], received * taus**2)
        if missing:  # the survivors' weights sum to less than 1: renormalise (model and noise alike)
            kept = math.fsum(state.weights[n] for n in survivors)
            for k in agg:
                agg[k] /= kept
        self.report_recovery(state, missing)
        return to_record(agg, self.wire_dtype)

    def account_revealed(self, state: NissRound) -> None:
        """A failed recovery's revealed shares, charged to the uploads as if every survivor had revealed them.

        As each answering client's ledger priced it (:func:`protocols.niss_joint.revealed_kept`).
        """
        keep = set(state.failed_recovery.survivors)
        sigmas = {n: NissMetrics.from_metrics(r.content["metrics"]).sigma for n, r in state.replies.items()
                  if n in keep and "metrics" in r.content}
        if not sigmas:
            return
        graph = state.keys.neighbours
        kept = revealed_kept(sigmas, graph)
        charged = {n: s / state.noise_scale for n, s in sigmas.items()}
        z_real = recovered_multiplier(self.z, sigmas, charged, graph, kept, state.tau, rho=self.cfg.niss_rho,
                                      degrees=state.keys.roster_degrees())
        z_open = max(recovered_multiplier(self.z, sigmas, charged, graph, kept, state.tau), z_real)
        state.noise_left = (z_real, 0.0, z_open)
        self.account(state, published=False)

    # -------------------------------------------------------------- recovery
    def pair_neighbours(self, state: NissRound) -> dict[int, list[int]]:
        """The share graph of the round (who exchanged shares with whom)."""
        return state.keys.neighbours

    def _remove_orphaned_shares(self, state: NissRound, agg: dict[str, np.ndarray],
                                ordered: list[Message]) -> list[float] | None:
        """Subtract what each survivor's upload holds because of a dropped neighbour; note the noise left.

        Per (survivor i, dropped k) the revealed :class:`~protocols.wire.recovery.NissPairMaterial`: i's
        own shares sent to k (nothing left to cancel them) and the distorted negated shares i received from
        k.  ``state.noise_left`` (for the account stage): the least uplink multiplier the survivors' joint view
        leaves one of them (:func:`protocols.niss_joint.survivor_factors`), the downlink multiplier of the shares
        exchanged among survivors.
        Returns the corrections' projections on the cancellation check's direction.

        Raises:
            RoundFailed: a survivor revealed malformed material.
        """
        rec = self.recovered(state)
        if rec is None or not (rec.gone_any or rec.material):  # e.g. a self-mask unmasking: nothing removed
            return []
        flat = flatten(agg)
        size = flat.size
        probe = probe_direction(state.keys.probe_seed, size) if self.cfg.cancellation_check else None
        figures = {r.metadata.src_node_id: NissMetrics.from_metrics(r.content["metrics"]) for r in ordered}
        sigma2 = {n: f.sigma**2 for n, f in figures.items()}
        kept = dict(sigma2)
        lost_among = 0.0
        out = []
        for node, blobs in sorted(rec.material.items()):
            corr = np.zeros(size)
            for peer, blob in sorted(blobs.items()):
                try:
                    m = NissPairMaterial.from_bytes(blob, size)
                except ValueError as err:
                    raise RoundFailed(f"round {state.round}: node {node} revealed malformed NISS material: {err}") from err
                corr += pair_contribution(m, node, peer, size, figures[node].tau)
                if m.out_seed is not None:  # None: the survivor kept its own shares (they stay, as DP noise)
                    kept[node] -= m.out_count * m.out_std**2
                    lost_among += m.out_count * m.out_std**2
                # The shares received from the dropped peer are its own noise, never part of the survivors' sum.
            flat -= corr
            if probe is not None:
                out.append(float(np.dot(corr, probe)))
        agg.update(unflatten(flat, agg))
        # The survivors' joint view (protocols.niss_joint): each keeps z * sqrt(f'_k) of its charged sigma_k.
        charged = {n: f.sigma / state.noise_scale for n, f in figures.items()}
        sigmas = {n: f.sigma for n, f in figures.items()}
        z_real = recovered_multiplier(self.z, sigmas, charged, state.keys.neighbours, kept, state.tau,
                                      rho=self.cfg.niss_rho, degrees=state.keys.roster_degrees())
        # colluders only take noise away
        z_open = max(recovered_multiplier(self.z, sigmas, charged, state.keys.neighbours, kept, state.tau), z_real)
        real = 0.0
        if self.privacy.downlink is not None:
            # Multiplier = std left / the worst record's sensitivity max_k sigma_k / (scale z) (niss.downlink_multiplier).
            # Against a receiving participant: the shares' residuals it knows are taken off.
            among = max(math.fsum(sigma2.values()) - lost_among, 0.0)
            real = state.noise_scale * receiver_downlink_multiplier(
                state.tau, {n: math.sqrt(v) for n, v in sigma2.items()}, self.z, state.keys.neighbours, among)
        state.noise_left = (z_real, real, z_open)
        self.report(uplink_noise_multiplier_after_recovery=z_real)
        return rec.probe_corrections(out)

    def _diagnostics(self, agg: dict[str, np.ndarray], clean: list[dict[str, np.ndarray]],
                     exact_var: np.ndarray) -> None:
        """DIAGNOSTIC (cancellation-check, nodes allowing it): measured aggregate noise against the noiseless sum."""
        keys = list(agg)
        noiseless = np.concatenate([np.sum([c[k] for c in clean], axis=0).ravel() for k in keys])
        total = np.concatenate([agg[k].ravel() for k in keys])
        resid = total - noiseless
        values = {
            "measured_noise_variance": float(np.mean(resid**2)),
            "exact_noise_variance": float(np.sum(exact_var)),
            "aggregate_error_rel": float(np.linalg.norm(resid) / max(np.linalg.norm(noiseless), 1e-300)),
        }
        self.report(**values)

    # ---------------------------------------------------------------- reporting
    def _planned_sigmas(self, sizes: Mapping[int, int]) -> list[float]:
        """The ``sigma_k`` the participants with ``sizes`` (node -> ``|D_k|``) compute (:func:`protocols.niss.client_sigma`)."""
        weights = niss_math.aggregation_weights(self.cfg, list(sizes), sizes)
        return [niss_math.client_sigma(self.cfg, weights[n], size, self.keys.releases()) for n, size in sizes.items()]

    def _typical_sizes(self) -> dict[int, int]:
        """A full round of clients of :meth:`_typical_size` records (estimates before any round)."""
        return dict.fromkeys(range(self.cfg.clients_per_round), self._typical_size())

    def _typical_size(self) -> int:
        """Records per client for the estimates before any round: the largest partition (runner), else 1."""
        return max(int(self.max_examples or 1), 1)

    def describe(self) -> dict[str, float | str]:
        """Key parameters (summary.json): from the last round's client reports when there is one, else planned."""
        m = self.cfg.clients_per_round
        tau_needed = niss_math.tau_for_collusion(self.cfg.niss_rho)
        figures = self._figures
        tau = self.tau
        if figures:
            sigma = float(np.mean([f.sigma for f in figures]))
            shares: float = float(np.mean([f.shares for f in figures]))
            tau = float(np.mean([f.tau for f in figures]))
        else:
            sigma = self._planned_sigmas(self._typical_sizes())[0]
            degree = m - 1 if self.cfg.graph == "complete" else min(2 * self.cfg.n_out, m - 1)
            shares = niss_math.SHARES_PER_NEIGHBOUR * degree
        return {
            "privacy_unit": self.cfg.privacy_unit,
            "noise_multiplier": self.z,
            "sigma_k": sigma,
            "shares_per_client": shares,
            "tau": tau,
            "rho": self.cfg.niss_rho,
            "tau_required_theorem3": tau_needed,
            "collusion_protected": "yes" if tau >= tau_needed - 1e-12 else "no",
            "share_encoding": self.cfg.niss_share_encoding,
            "epsilon_round_analytic": analytic_gaussian_epsilon(self.z, self.cfg.delta),
            "theorem2_variance_full_round": m * sigma**2 * tau**2,
        }

    def noise_estimate(self, num_params: int) -> NoiseEstimate:
        """The sum keeps noise std ``tau sqrt(sum_k sigma_k^2)`` per entry; the signal is bounded by the clipping.

        Record level: the mean of the local updates moves at most ``lr clip steps`` (each per-example-clipped step
        moves <= lr clip); client level: the weighted clipped updates sum to <= clip.
        """
        c = self.cfg
        figures = self._figures
        sigmas = [f.sigma for f in figures] if figures else self._planned_sigmas(self._typical_sizes())
        tau = float(np.mean([f.tau for f in figures])) if figures else self.tau
        std = tau * math.sqrt(math.fsum(s * s for s in sigmas))
        if c.privacy_unit == "client":
            signal = c.clip
        else:
            signal = record_training_movement(c, self._typical_size())
        return NoiseEstimate(gaussian_norm(std, num_params), signal, c.num_rounds)

    def _downlink_multiplier(self, state: NissRound) -> float:
        """The published sum's multiplier for the round's worst-off record against any receiver.

        A participant knowing its own shares and those it received included
        (:func:`protocols.niss_joint.receiver_downlink_multiplier`).  From the round's weights and the sizes reported
        with the keys (which only record level needs).
        """
        sigmas = {n: niss_math.client_sigma(self.cfg, state.weights[n], state.keys.num_examples.get(n, 1))
                  for n in state.participants}
        return state.noise_scale * receiver_downlink_multiplier(state.tau, sigmas, self.z, state.keys.neighbours)

    def charge_release(self, state: NissRound) -> None:
        """The planned round, per participant: each upload a Gaussian release of multiplier z, the sum ``tau sqrt(sum sigma^2)``.

        No amplification by sampling in either direction: the sample is public (the run's roster schedule).
        """
        if self.privacy.uplink is not None:  # the joint view keeps at least z times the guard's scale
            self.privacy.uplink.compose(GaussianEvent(self.z * self.noise_scale), units=state.participants)
        if (alone := self.privacy.extra.get(NO_COLLUDER)) is not None:
            by_z: dict[float, list[int]] = {}
            for n, z_open in self._open_multipliers(state).items():
                by_z.setdefault(z_open, []).append(n)
            for z_open, units in by_z.items():
                alone.compose(GaussianEvent(z_open), units=units)
        if self.privacy.downlink is not None:
            self.privacy.downlink.compose(GaussianEvent(self._downlink_multiplier(state)), units=state.participants)

    def _open_multipliers(self, state: NissRound) -> dict[int, float]:
        """Participant -> its planned uplink multiplier with no colluding neighbour, never below the claim's."""
        claim = self.z * self.noise_scale
        return {n: max(state.open_multipliers.get(n, claim), claim) for n in state.participants}

    def account(self, state: NissRound, *, published: bool = True) -> None:
        """Account stage: after a recovery, the shortfall of the noise really left against the planned release.

        ``published``: the round's model was published (else the uploads alone are charged).
        """
        if state.noise_left is None:
            return
        z_real, real, z_open = state.noise_left
        if self.privacy.uplink is not None:
            charge_shortfall(self.privacy.uplink, self.z * self.noise_scale, z_real, units=state.participants)
        if (alone := self.privacy.extra.get(NO_COLLUDER)) is not None:
            for n, planned in self._open_multipliers(state).items():
                charge_shortfall(alone, planned, z_open, units=[n])
        if published and self.privacy.downlink is not None:
            charge_shortfall(self.privacy.downlink, self._downlink_multiplier(state), real, units=state.participants)


__all__ = ["NissStrategy", "MAX_SHARE_ATTEMPTS"]

