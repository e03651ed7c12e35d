"""The client's privacy floor, Flower-free: the noise a client owes itself, computed from its own configuration.

A client never takes a noise parameter from the server: it computes its noise from its own run config and public
values it can check (its dataset size, the participants' sizes, the round's graph), and refuses a round
(:class:`FloorViolation`, naming the parameter) whose server-sent values would give it less protection.  A node
may also hold a :class:`FloorPolicy` in its node config: limits on the run config (``max-epsilon-per-run``,
``max-delta``, ``max-clip``) and a lifetime budget kept by :mod:`client.ledger`.

This module is the pure part: the policy, the violation and each method's floor (:func:`ldp_noise_std`,
:func:`nadp_floor`, :func:`niss_floor`, :func:`mpddp_floor`, :func:`mpdp_naive_sigma`; ddpsa's in
:mod:`protocols.ddpsa_floor`), which the strategies use too, so both ends compute the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from protocols.config import RunConfig
from protocols.node_config import POLICY_KEYS as _POLICY_KEYS
from protocols.privacy import calibrate_noise_multiplier, noise_multiplier, record_sensitivity

if TYPE_CHECKING:
    from protocols.nadp import NadpSigmas, NoiseAllocation

# Each method's formulas are imported inside its floor: a ClientApp child loads only its own method's.

__all__ = [
    "ETA_SHARE",
    "FloorPolicy",
    "FloorViolation",
    "NOISE_SCALE",
    "NadpFloor",
    "RTOL",
    "at_least",
    "at_most",
    "calibration_releases",
    "ldp_noise_multiplier",
    "ldp_noise_std",
    "mpddp_complete",
    "mpddp_floor",
    "mpdp_naive_sigma",
    "nadp_compensation",
    "nadp_floor",
    "NissFloor",
    "niss_floor",
    "noise_scale_of",
]

#: Relative slack of a comparison between the server's value and the client's own (float round-off only).
RTOL = 1e-9
#: mpddp: fraction of the per-round privacy-loss variance theta spent on the non-cancelling eta.
ETA_SHARE = 0.9


class FloorViolation(ValueError):
    """The server asked for less protection than the client's floor: the round is refused, nothing is uploaded."""

    def __init__(self, parameter: str, offered: object, floor: object, why: str = "") -> None:
        self.parameter, self.offered, self.floor = parameter, offered, floor
        text = f"privacy floor: refusing the round: {parameter} = {offered!r} but this client's floor is {floor!r}"
        super().__init__(text + (f" ({why})" if why else ""))


def at_least(parameter: str, offered: float, floor: float, why: str = "") -> None:
    """Refuse unless ``offered >= floor`` (up to :data:`RTOL`): e.g. a noise std the server announces."""
    if not (math.isfinite(offered) and offered >= floor * (1.0 - RTOL)):
        raise FloorViolation(parameter, offered, floor, why or "less noise than this client's own calibration")


#: Config key of the factor (>= 1) on every noise std of a round that a server raises to keep the run within its
#: target epsilon (:mod:`strategies.run.budget`); absent = 1.
NOISE_SCALE = "noise-scale"


def noise_scale_of(config: Mapping[str, Any]) -> float:
    """The round's noise scale a message's config carries (1 when absent): a client adds more noise, never less.

    Raises:
        FloorViolation: a scale below 1 or not a finite number.
    """
    raw = config.get(NOISE_SCALE, 1.0)
    try:
        scale = float(raw)
    except (TypeError, ValueError):
        scale = math.nan
    at_least(NOISE_SCALE, scale, 1.0, "less noise than this client's own calibration")
    return scale


def at_most(parameter: str, offered: float, ceiling: float, why: str = "") -> None:
    """Refuse unless ``offered <= ceiling`` (up to :data:`RTOL`): e.g. a per-round epsilon."""
    if not (math.isfinite(offered) and offered <= ceiling * (1.0 + RTOL)):
        raise FloorViolation(parameter, offered, ceiling, why or "more privacy loss than this client allows")


# ----------------------------------------------------------------------------------------- node policy
@dataclass(frozen=True)
class FloorPolicy:
    """A node's own limits (node config; every key optional).

    Attributes:
        max_epsilon_per_run: largest run-config ``epsilon`` the node trains under, and the most one run may spend
            in its privacy unit by the node's ledger, recovery top-ups included (None = any).
        max_delta: largest run-config ``delta`` (None = any).
        max_clip: largest run-config ``clip`` (None = any).
        lifetime_epsilon: what the node may spend over all runs, per direction and privacy unit,
            at ``lifetime_delta`` (None = unlimited; spending is recorded either way).
        lifetime_delta: the delta the ledger's epsilon is read at.
    """

    max_epsilon_per_run: float | None = None
    max_delta: float | None = None
    max_clip: float | None = None
    lifetime_epsilon: float | None = None
    lifetime_delta: float = 1e-5

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"node config '{_POLICY_KEYS[f.name]}' = {value!r} must be a finite number > 0")
        if not self.lifetime_delta < 1:
            raise ValueError(f"node config 'lifetime-delta' = {self.lifetime_delta!r} must be < 1")

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> FloorPolicy:
        """Read the policy keys of a node config (other keys are ignored here: :mod:`protocols.node_config`)."""
        values: dict[str, float] = {}
        for name, key in _POLICY_KEYS.items():
            if key in node_config:
                try:
                    values[name] = float(node_config[key])
                except (TypeError, ValueError) as err:
                    raise ValueError(f"node config '{key}' = {node_config[key]!r} must be a number") from err
        return cls(**values)

    @property
    def wants_guarantee(self) -> bool:
        """Whether the node asks for a bounded privacy loss at all (refuses methods without one)."""
        return self.max_epsilon_per_run is not None or self.lifetime_epsilon is not None

    def check_identity(self, *, derived: bool) -> None:
        """Refuse to authenticate peers with simulation identities (``derived``) when the node asks for a guarantee.

        Simulation identities (:func:`protocols.identity.derived_identity`) follow from the run config's seed: a
        server signs its own X25519 keys as any peer, derives every pair seed, relay key and self-mask share key of
        the node, and strips all its pair noise, while the ledger charges the epsilon the pair noise was meant to give.
        """
        if self.wants_guarantee and derived:
            raise FloorViolation("identity-key", "a simulation identity derived from the run seed",
                                 "this node's own identity and roster",
                                 "whoever knows the run config can sign keys as any peer and strip this node's pair "
                                 "noise; set node config 'identity-key' and 'roster' (`cancelfl keys`), as this node's "
                                 "'max-epsilon-per-run' / 'lifetime-epsilon' asks for a guarantee")

    def check_run(self, cfg: RunConfig, *, protected: bool) -> None:
        """Refuse a run config beyond the node's limits; ``protected`` = the method noises the upload itself."""
        if self.wants_guarantee and not protected:
            raise FloorViolation("method", cfg.method, "a method with client-side noise",
                                 "this node requires a bounded privacy loss against the server (node config "
                                 "'max-epsilon-per-run' / 'lifetime-epsilon'); this method uploads without noise")
        if self.max_epsilon_per_run is not None:
            at_most("epsilon", cfg.epsilon, self.max_epsilon_per_run, "node config 'max-epsilon-per-run'")
        if self.max_delta is not None:
            at_most("delta", cfg.delta, self.max_delta, "node config 'max-delta'")
        if self.max_clip is not None:
            at_most("clip", cfg.clip, self.max_clip, "node config 'max-clip'")


def check_round(rnd: int, cfg: RunConfig, used: Sequence[int]) -> None:
    """A train round must lie in ``1..num-rounds`` and be new in this run (the noise is calibrated for T releases)."""
    if not 1 <= rnd <= cfg.num_rounds:
        raise FloorViolation("round", rnd, f"1..{cfg.num_rounds}",
                             "the noise is calibrated for run-config 'num-rounds' releases")
    if rnd in used:
        raise FloorViolation("round", rnd, "a round not trained before in this run",
                             "a repeated round would release this client's data again")
    if len(used) >= cfg.num_rounds:
        raise FloorViolation("num-rounds", len(used) + 1, cfg.num_rounds,
                             "this client already made every release the run's budget covers")


# ----------------------------------------------------------------------------------------- methods
def calibration_releases(cfg: RunConfig, releases: int | None) -> int:
    """The releases a run's noise is calibrated for: ``releases`` (the public schedule's bound) or ``num-rounds``.

    Raises:
        FloorViolation: ``releases`` outside ``1..num-rounds`` (a schedule cannot sample a client more often
            than there are rounds).
    """
    if releases is None:
        return cfg.num_rounds
    if not 1 <= releases <= cfg.num_rounds:
        raise FloorViolation("releases", releases, f"1..{cfg.num_rounds}",
                             "the public schedule samples a client at most once per round")
    return int(releases)


def ldp_noise_multiplier(cfg: RunConfig) -> float:
    """``ldp``: noise multiplier z for (epsilon, delta) over ``num-rounds`` unsampled releases (exact RDP)."""
    return calibrate_noise_multiplier(cfg.epsilon, cfg.delta, 1.0, cfg.num_rounds)


def ldp_noise_std(cfg: RunConfig, dataset_size: int | None = None) -> float:
    """``ldp``: the Gaussian std a client adds to its upload, ``z`` x the upload's sensitivity.

    ``privacy-unit = "client"``: the clipped update, sensitivity ``clip``.  ``"record"``: the model trained by
    per-example-clipped SGD on ``dataset_size`` records, sensitivity :func:`record_sensitivity` (``2 C lr / n_k``
    for one full-batch step: the NADP paper's LDP-FL comparator, Lemma 3, but with the exact RDP multiplier
    instead of Lemma 2's closed form).
    """
    z = ldp_noise_multiplier(cfg)
    if cfg.privacy_unit == "client":
        return z * cfg.clip
    if dataset_size is None:
        raise ValueError("record-level ldp: the noise std depends on the client's dataset size")
    return z * record_sensitivity(cfg, dataset_size)


def nadp_compensation(cfg: RunConfig, sizes: Mapping[int, int], graph: Mapping[int, Sequence[int]] | None = None,
                      degrees: Mapping[int, int] | None = None) -> float:
    """``lambda``: ``nadp-lambda`` if > 0, else Eq. 8 for ``nadp-tau`` over each participant's neighbourhood.

    :func:`protocols.nadp_allocation.neighbourhood_compensation` on ``graph`` (None: complete), the colluders counted
    in ``degrees`` (node -> roster neighbours of the round; default: ``graph``'s).  ValueError: no lambda can help.
    """
    from protocols.nadp_allocation import neighbourhood_compensation
    return cfg.nadp_lambda if cfg.nadp_lambda > 0 else neighbourhood_compensation(cfg.nadp_tau, sizes, graph, degrees)


@dataclass(frozen=True)
class NadpRoundNoise:
    """A NADP round's noise, derived alike by the server and every client (public sizes and graph).

    Sensitivities (Lemma 1), sigmas (Eq. 3 / RDP), the pair allocation, lambda (Eq. 8).

    ``ldp_stds``: the record-ldp variant's per-client std (then ``sigmas`` and ``allocation`` are None).
    ``lam_problem``: why Eq. 8 has no solution this round (lambda is then 1: no honest partner is left).
    ``dropout_factor``: the factor (>= 1) on both sigmas for run-config ``dropout-rate``
    (:func:`protocols.dropouts.nadp_dropout_factor`; 1 for record-ldp).
    """

    sensitivities: Mapping[int, float]
    sigmas: NadpSigmas | None
    allocation: NoiseAllocation | None
    lam: float
    ldp_stds: Mapping[int, float] | None = None
    lam_problem: str | None = None
    dropout_factor: float = 1.0


def nadp_round_noise(cfg: RunConfig, sizes: Mapping[int, int], graph: Mapping[int, Sequence[int]] | None,
                     scale: float = 1.0, releases: int | None = None, degrees: Mapping[int, int] | None = None
                     ) -> NadpRoundNoise:
    """The round's noise for the participants ``sizes`` (node -> |D_i|) on the pairing ``graph`` (None: complete).

    Record-ldp variant (Lemma 3): each client alone meets (epsilon, delta) over the run with its own sensitivity.
    On a sparse graph Eq. 8 is applied to the smallest neighbourhood (k_eff = min degree + 1).
    ``scale`` (>= 1, the plan's ``noise_scale``): every std times it, as the server plans when the run's budget
    left needs more noise (:mod:`strategies.run.budget`): the allocation is computed for the sensitivities times
    ``scale``, while ``sensitivities`` stay the real ones, so the accounts charge the noise really added.
    ``releases``: the releases the noise is calibrated for, the most rounds any client is sampled in under the
    public schedule (:func:`client.pairwise_phase.roster_releases`); None: ``num-rounds``.
    Dropouts (run-config ``dropout-rate`` r): both sigmas times :func:`protocols.dropouts.nadp_dropout_factor`
    ``1/sqrt(P_min)``, so that the survivors of up to ``m`` dropouts (``P[Bin(k, r) > m] <= 1e-3``) keep the
    plan's multiplier in the renormalised aggregate (the recovered pairs gone, only the survivors' residuals stay).

    Raises:
        FloorViolation: ``scale`` < 1 (less noise than the run's calibration), or ``releases`` outside
            ``1..num-rounds``.
    """
    from protocols.dropouts import nadp_dropout_factor
    from protocols.nadp import rdp_multiplier, round_plan
    if not (math.isfinite(scale) and scale >= 1.0):
        raise FloorViolation("nadp-noise-scale", scale, 1.0, "less noise than this client's own calibration")
    t = calibration_releases(cfg, releases)
    sens = {n: record_sensitivity(cfg, s) for n, s in sizes.items()}  # Lemma 1
    if cfg.nadp_variant == "record-ldp":
        z_ldp = rdp_multiplier(cfg.epsilon, cfg.delta, t)
        return NadpRoundNoise(sens, None, None, 1.0, {n: z_ldp * s * scale for n, s in sens.items()})
    drop = nadp_dropout_factor(sizes, cfg.dropout_rate)
    sig, alloc = round_plan(sizes, {n: v * scale * drop for n, v in sens.items()}, cfg.epsilon, cfg.delta, t,
                            graph=graph)
    try:  # degrees: node -> roster neighbours of the round (nadp_compensation)
        return NadpRoundNoise(sens, sig, alloc, nadp_compensation(cfg, sizes, graph, degrees), dropout_factor=drop)
    except ValueError as err:  # (1 - tau) k <= 1: no honest partner is left to hide behind
        return NadpRoundNoise(sens, sig, alloc, 1.0, lam_problem=str(err), dropout_factor=drop)


@dataclass(frozen=True)
class NadpFloor:
    """A NADP participant's own view of the round: Eq. 3 sigmas, allocation, lambda, its sensitivity."""

    sigmas: NadpSigmas | None
    allocation: NoiseAllocation | None
    lam: float
    sensitivity: float
    ldp_std: float | None = None


def nadp_floor(cfg: RunConfig, sizes: Mapping[int, int], me: int, graph: Mapping[int, Sequence[int]] | None,
               scale: float = 1.0, releases: int | None = None, degrees: Mapping[int, int] | None = None) -> NadpFloor:
    """Participant ``me``'s share of :func:`nadp_round_noise` (the server's plan must announce at least this)."""
    r = nadp_round_noise(cfg, sizes, graph, scale, releases, degrees)
    return NadpFloor(r.sigmas, r.allocation, r.lam, r.sensitivities[me], None if r.ldp_stds is None else r.ldp_stds[me])


@dataclass(frozen=True)
class NissFloor:
    """A NISS round's joint-view calibration, derived alike by the server's plan and every client.

    ``scale``: the factor on every ``sigma_k`` (:func:`protocols.niss_joint.joint_scale` times the dropout factor;
    1 when ``tau = 0``, where no scale helps and the run's uplink carries no guarantee); ``factors``: node -> ``f_k``
    at scale 1, each client's view given the worst ``niss-rho`` share of its neighbours colluding (the claim);
    ``open_factors``: the same with no colluding neighbour (:meth:`open_multipliers`; empty unless
    :func:`niss_floor`'s ``open_view``).
    """

    scale: float
    factors: Mapping[int, float]
    open_factors: Mapping[int, float] = field(default_factory=dict)

    def open_multipliers(self, z: float, extra_scale: float = 1.0) -> dict[int, float]:
        """Node -> the noise multiplier of its view without colluding neighbours, at ``scale`` times ``extra_scale``.

        :func:`protocols.niss_joint.view_multipliers` of :attr:`open_factors` (``z``: the multiplier every
        ``sigma_k`` is calibrated for; ``extra_scale``: the budget guard's raise).  At least ``z extra_scale``
        (the claim's multiplier) up to round-off; equal to it for the worst-off client when ``niss-rho`` covers
        no colluder (``floor(rho d_k) = 0``), its ``f_k <= 1`` and the dropout factor is 1.  A node without an
        open factor is left out (its caller charges the claim's multiplier).
        """
        from protocols.niss_joint import view_multipliers
        return view_multipliers(self.open_factors, z, self.scale * extra_scale)


def niss_floor(cfg: RunConfig, sizes: Mapping[int, int], graph: Mapping[int, Sequence[int]], tau: float,
               offered: float | None = None, releases: int | None = None, *, open_view: bool = False,
               degrees: Mapping[int, int] | None = None) -> NissFloor:
    """``niss``: the noise scale the round's joint view needs; refuses an ``offered`` scale below it.

    The scale is :func:`protocols.niss_joint.joint_scale` of the factors given up to ``floor(niss-rho x d_k)``
    colluding neighbours of each client (:func:`protocols.niss_joint.joint_factors`), or the model's need against a
    receiving participant where larger (:func:`protocols.niss_joint.receiver_downlink_scale`), times
    :func:`protocols.dropouts.niss_dropout_factor` (run-config ``dropout-rate``: the survivors of up to the
    binomial tail's dropouts keep the downlink multiplier).

    ``sizes``: the participants' public dataset sizes (node -> ``|D_k|``; ignored at client level), ``graph``:
    the round's pairing graph over them (the roster graph among the present nodes), ``tau``: the round's
    distortion.  ``sigma_k`` = :func:`protocols.niss.client_sigma` of the public weight and size.

    ``releases``: the releases every ``sigma_k`` is calibrated for (:func:`calibration_releases`: the public
    schedule's most participations of any client, None: ``num-rounds``; the scale does not depend on it).
    ``degrees``: node -> its neighbours in the roster's graph of the round (default: in ``graph``): the colluders
    the claim covers are counted from them, so a server that leaves honest neighbours out cannot shrink the
    coalition a client is protected against (up to all the present neighbours).
    ``open_view``: also the factors with no colluding neighbour (:attr:`NissFloor.open_factors`, from the same
    sigmas, graph and tau; the server's second upload figure; a client, whose ledger charges the claim, skips them).

    Raises:
        FloorViolation: ``offered`` (the share request's ``niss-noise-scale``) below the scale, or ``releases``
            outside ``1..num-rounds``.
    """
    from protocols.dropouts import niss_dropout_factor
    from protocols.niss import aggregation_weights, client_sigma
    from protocols.niss_joint import joint_factors, joint_scale, receiver_downlink_scale
    weights = aggregation_weights(cfg, list(graph), sizes)
    t = calibration_releases(cfg, releases)
    sigmas = {n: client_sigma(cfg, weights[n], int(sizes.get(n, 1)), t) for n in graph}
    factors = joint_factors(sigmas, graph, tau, rho=cfg.niss_rho, degrees=degrees)
    open_factors = joint_factors(sigmas, graph, tau) if open_view else {}  # the view with no colluding neighbour
    if tau == 0:
        return NissFloor(1.0, factors, open_factors)
    need = max(joint_scale(factors), receiver_downlink_scale(tau, sigmas, graph))  # uploads' joint view; the model
    floor = NissFloor(need * niss_dropout_factor(sigmas, graph, cfg.dropout_rate), factors, open_factors)
    if offered is not None:
        at_least("joint-view noise scale", offered, floor.scale,
                 "the uploads together would leave this client less noise than its accountant charges")
    return floor


def mpddp_complete(cfg: RunConfig, k: int) -> bool:
    """``mpddp`` for ``k`` clients is calibrated for a complete graph (Theorem 10), not an n-out one (Theorem 11)."""
    return cfg.graph != "n-out" or cfg.n_out >= k - 1


def mpddp_floor(cfg: RunConfig, k: int, min_size: int, scale: float = 1.0,
                releases: int | None = None) -> tuple[float, float, float]:
    """``mpddp``: ``(sigma_eta, sigma_delta, theta)`` for ``k`` clients (Theorem 10, or 11 on an n-out graph).

    Record level: the sensitivity is :func:`protocols.mpddp.mp_record_sensitivity` of the smallest
    participant (``min_size`` = the smallest public ``|D_i|`` of the round), the largest record sensitivity
    among the participants: each pair Delta_kv = -Delta_vk needs ONE std at both ends, and with one
    sensitivity for all every participant computes the same scales from the same public sizes (the
    clients whose n_k is larger get more noise than they need: simple, and never less).
    Run-config ``dropout-rate``: both sigmas times :func:`protocols.dropouts.mpddp_dropout_factor`, so that the
    survivors of up to the dropouts it plans for keep the returned theta after the recovery (theta is the plan's,
    what the round is charged).
    ``scale`` (>= 1): both sigmas times it, theta over its square (the server raises a round's noise when the
    run's epsilon budget left needs it; :mod:`strategies.run.budget`).
    ``releases``: the releases the noise is calibrated for (:func:`calibration_releases`; the public schedule's
    most participations of any client, None: ``num-rounds``).
    Raises ValueError where the theorems do not cover the setting (or the survivors of its planned dropouts),
    FloorViolation for ``releases`` outside ``1..num-rounds``.
    """
    from protocols.dropouts import mpddp_dropout_factor
    from protocols.mpddp import (
        calibrate,
        mp_record_sensitivity,
        round_multiplier,
        sigmas_for_theta,
        theta_for_noise_multiplier,
    )
    sens = mp_record_sensitivity(cfg.clip, min_size, adjacency=cfg.adjacency)
    t = calibration_releases(cfg, releases)
    if complete := mpddp_complete(cfg, k):
        theta = theta_for_noise_multiplier(round_multiplier(cfg.epsilon, cfg.delta, t, complete=True))
        se, sd = sigmas_for_theta(theta, k, eta_share=ETA_SHARE, sensitivity=sens)
    else:
        cal = calibrate(cfg.epsilon / t, cfg.delta / t, k, cfg.n_out, eta_share=ETA_SHARE, sensitivity=sens)
        se, sd, theta = cal.sigma_eta, cal.sigma_delta, cal.theta
    s = scale * mpddp_dropout_factor(se, sd, k, cfg.dropout_rate, complete=complete, n_out=cfg.n_out)
    return se * s, sd * s, theta / scale**2


def mpdp_naive_sigma(cfg: RunConfig, size: int) -> float:
    """``mpdp-naive``: Gaussian std ``z S`` on each perturbed gradient entry, S = ``2 clip / size`` (the client's own)."""
    from protocols.mpddp import calibrate_ldp, mp_record_sensitivity
    return calibrate_ldp(noise_multiplier(cfg.epsilon, cfg.delta, cfg.num_rounds),
                         sensitivity=mp_record_sensitivity(cfg.clip, size, adjacency=cfg.adjacency))
