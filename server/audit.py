"""Privacy audit: an empirical lower bound on epsilon from the method's real release code (``cancelfl audit``).

Every release is a one-round run of the method on the in-process grid (:class:`server.local_grid.LocalGrid`):
the registered strategy (:mod:`strategies.registry`) samples, runs its phases (key exchange, shares), sends
the train messages, and the stock handlers of the method (:func:`client.api.attach`: the same train and query
handlers a run uses, with the client's privacy floor and ledger) train and noise the uploads, which the
strategy aggregates.  The audit only chooses the model and the data:

* **white-box gradient canaries** (default): a bias-free linear model ``W`` (2 x d) starting at 0, and per
  client ``m`` records ``x = 10 clip e_k`` in its own block of input coordinates ``k``.  At ``W = 0`` record
  k's per-example gradient points along ``v_k = (e_{1,k} - e_{0,k}) / sqrt 2`` (sign set by its label) with
  norm above ``clip``, so its clipped gradient is exactly ``+-clip v_k``: the strongest record (the whole
  clipping budget) in a direction no other record touches.  Flipping one label is a replace-one neighbour,
  and it moves the full-batch step by ``2 clip lr / n_k`` along ``v_k``: the record sensitivity every
  record-level method calibrates to (``record_sensitivity``).  Labels are drawn at random per record and
  release; every record is one trial, read from its own coordinates (orthogonal canaries in an isotropic
  noise are independent trials; the noise of every method is drawn independently per coordinate).
* **MP family** (mpddp, mpdp-naive, mpcdp): the same records on a one-hidden-layer MLP
  (:func:`server.audit_canaries.canary_mlp`) trained by FedSGD with the paper's xi step; a record's
  coordinates are its column of the first layer.  The round's secret R scales the noise of every canary of
  a release alike, so the threshold and the bound count one canary per release (the rest fit the test).
  Upload view: each upload recovered alone with the round's R (what the server can compute).
* **adaptive canaries** (ladp's default, :class:`server.audit_canaries._AdaptiveCanaries`): the label also
  moves the layer's KL estimate across ladp's whole ``[B / max-boost, B]`` range, and the statistic reads
  the noise scale as well as the shift: a data-dependent noise scale is caught.

* **niss**: the gradient canaries on the linear model; the real share phase (keys, sealed noise shares relayed by
  the strategy) and the uploads ``p_k w_k + own shares + sum_i s_i r_i``.
* **ddpsa**: the gradient canaries on the linear model (its L1 clipping: a record's clipped gradient is
  ``+-clip / 2`` on each of its two coordinates, the whole L1 budget); ``m`` local intermediate servers
  (TLS, the derived simulation roster) are started once per audit and every release pushes real shares to them.
  Its claim is pure epsilon-DP: the bound is computed with ``delta = 0`` (``AuditSpec.claim_delta``).

Views (``direction``): ``upload`` = what the server holds of the uploads (all of them: pair noise is
correlated across uploads), optionally with ``colluders`` peers handing the server their round's pair material
(:class:`client.recovery.RecoveryStore`, what a colluding client holds; nadp); for ddpsa the sum the
parameter server reconstructs (the shares are secret-shared over the intermediate servers), the same vector as
its model view; ``model`` = the published aggregate.
The statistic per record is Fisher's linear discriminant of its coordinates across the view's vectors,
fitted on one half of the releases (no trust in the implementation's own noise covariance) and tested on the
other half (:func:`protocols.privacy.audit.audit_scores`).

The claim audited is the run's own: the strategy's privacy ledger after the round (``epsilon_uplink`` /
``epsilon_downlink`` of a one-round run at ``epsilon``), i.e. the one-round mechanism against the epsilon the
accountant gives for it; ``inf`` where the method claims no guarantee in that direction.

Planted faults (``fault``, for the audit's own tests): ``halve-noise`` (the method's Gaussian std halved in the
release code; ddpsa: its Laplace scale), ``private-kl`` (ladp's P_j computed from the client's trained local model, as the paper's
Algorithm 3 does, instead of the server's public estimate), ``skip-pair-noise`` (one nadp client uploads
without its pair noise), ``strip-pair-noise`` (the server tells every neighbour of one client that it dropped
while holding its upload, and removes the revealed pair noise from it; planted with ``self-mask = false``,
since with double masking the clients refuse).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from flwr.app import ConfigRecord, Message

from client.api import client_env
from client.models import get_weights
from client.wire import from_record, to_record
from protocols.config import ConfigError, RunConfig
from protocols.methods import FULL_BATCH
from protocols.pairwise import pairwise_noise
from protocols.privacy.audit import AuditBound, audit_scores, fisher_scores
from server.audit_canaries import MLP_HIDDEN, CanaryModel, _AdaptiveCanaries, _Canaries, _client_app
from server.local_grid import LocalGrid
from strategies.registry import strategy_class
from strategies.stages import close_round

__all__ = ["AUDITED", "DIRECTIONS", "FAULTS", "MP_FAMILY", "AuditReport", "AuditSpec", "federation", "run_audit"]

DIRECTIONS: tuple[str, ...] = ("upload", "model")
#: ``gradient``: white-box gradient canaries (label flips, every method); ``adaptive``: canaries that move a
#: data-dependent noise scale (ladp's KL estimate), one per client.
CANARIES: tuple[str, ...] = ("gradient", "adaptive")
FAULTS: tuple[str, ...] = ("halve-noise", "skip-pair-noise", "strip-pair-noise", "private-kl")
#: The MP family: model perturbation by the server, per-example clipping on W-hat, recovery (an MLP is audited).
MP_FAMILY: tuple[str, ...] = ("mpddp", "mpdp-naive", "mpcdp")
#: Methods the ``halve-noise`` fault is planted in.
HALVE_NOISE: tuple[str, ...] = ("ldp", "cdp", "nadp", "niss", "ladp", "mpdp-naive", "mpcdp", "ddpsa")
#: Methods whose claim is pure epsilon-DP (delta = 0): the bound is computed with delta = 0.
PURE_DP: tuple[str, ...] = ("ddpsa",)
#: Methods the audit drives, and the adjacency their claim uses.
AUDITED: tuple[str, ...] = ("ldp", "cdp", "nadp", "niss", "ladp", *MP_FAMILY, "ddpsa")
ADJACENCY = "replace-one record (a canary's label flipped)"
#: Input scale of a canary in units of clip: its gradient norm at W = 0 is ``scale clip / sqrt 2`` > clip.
CANARY_SCALE = 10.0


def federation(method: str, direction: str = "upload", canary: str | None = None) -> dict[str, int]:
    """Default ``trials``, ``clients`` and ``per_client`` of an audit: about a minute on 2 shared cores.

    Gradient canaries give ``clients x per_client`` trials per release; adaptive canaries one per client
    (``upload``) or one per release (``model``); the MP family's bound counts one canary per release.
    """
    kind = canary if canary is not None else default_canary(method)
    if kind == "adaptive":
        return {"trials": 3_200, "clients": 16, "per_client": 2} if direction == "upload" else \
            {"trials": 400, "clients": 2, "per_client": 2}
    if method in MP_FAMILY:
        return {"trials": 12_000, "clients": 3, "per_client": 10}
    if method == "niss":  # its heavier-tailed noise (distorted shares) needs more trials for the same power
        return {"trials": 600_000, "clients": AuditSpec.clients, "per_client": AuditSpec.per_client}
    return {"trials": AuditSpec.trials, "clients": AuditSpec.clients, "per_client": AuditSpec.per_client}


def default_canary(method: str) -> str:
    """The canary a method is audited with by default: ``adaptive`` for ladp (its noise scale is data-dependent)."""
    return "adaptive" if method == "ladp" else "gradient"


@dataclass(frozen=True)
class AuditSpec:
    """One audit: method, view, claimed budget, trials and the federation the releases run on."""

    method: str
    direction: str = "upload"
    epsilon: float = 4.0
    trials: int = 300_000  # canary records over all releases (half select the test, half bound epsilon)
    canary: str | None = None  # None: default_canary(method)
    colluders: int = 0  # upload view: peers that hand the server their pair material
    fault: str | None = None
    clients: int = 4
    per_client: int = 500  # canaries of one client per release
    delta: float = 1e-5
    alpha: float = 0.05
    clip: float = 1.0
    lr: float = 1.0

    def validate(self) -> None:
        """Refuse a spec the audit cannot run, naming the option (:class:`ConfigError`)."""
        if self.method not in AUDITED:
            raise ConfigError(f"audit: method {self.method!r} is not audited yet; audited: {', '.join(AUDITED)}")
        if self.direction not in DIRECTIONS:
            raise ConfigError(f"audit: direction {self.direction!r}; choose one of {', '.join(DIRECTIONS)}")
        if self.canary_kind not in CANARIES:
            raise ConfigError(f"audit: canary {self.canary!r}; choose one of {', '.join(CANARIES)}")
        if self.canary_kind == "adaptive" and self.method != "ladp":
            raise ConfigError("audit: canary 'adaptive' exercises ladp's data-dependent noise scale: method must be ladp")
        if self.fault is not None and self.fault not in FAULTS:
            raise ConfigError(f"audit: fault {self.fault!r}; choose one of {', '.join(FAULTS)}")
        if self.fault in ("skip-pair-noise", "strip-pair-noise") and self.method != "nadp":
            raise ConfigError(f"audit: fault {self.fault!r} plants a pair-noise fault: method must be nadp")
        if self.fault == "private-kl" and self.method != "ladp":
            raise ConfigError("audit: fault 'private-kl' plants a data-dependent noise scale: method must be ladp")
        if self.fault == "halve-noise" and self.method not in HALVE_NOISE:
            raise ConfigError(f"audit: fault 'halve-noise' is not planted for method {self.method!r}")
        if self.clients < 2 or self.per_client < 2:
            raise ConfigError("audit: clients and per-client canaries must be >= 2")
        if not 0 <= self.colluders <= self.clients - 2:
            raise ConfigError(f"audit: colluders must be in 0..clients-2 (clients={self.clients})")
        if self.colluders and (self.direction != "upload" or self.method != "nadp"):
            raise ConfigError("audit: colluders apply to the upload view of a pairwise method (nadp)")
        if self.trials < 4 * self.audited_per_release():
            raise ConfigError(f"audit: trials must be >= {4 * self.audited_per_release()} (4 releases)")

    @property
    def claim_delta(self) -> float:
        """The delta of the audited claim: 0 for ddpsa (pure epsilon-DP, Laplace noise), else ``delta``."""
        return 0.0 if self.method in PURE_DP else self.delta

    @property
    def canary_kind(self) -> str:
        """The canary used: ``canary``, or the method's default."""
        return self.canary if self.canary is not None else default_canary(self.method)

    def audited_per_release(self) -> int:
        """Canaries of one release the audit reads: the victim's (per-client faults), the non-colluders', or all."""
        if self.canary_kind == "adaptive":
            return 1 if self.direction == "model" else self.clients
        if self.fault in ("skip-pair-noise", "strip-pair-noise"):
            return self.per_client
        return (self.clients - self.colluders) * self.per_client

    def run_config(self) -> dict:
        """The run config of every release: one round, one full-batch clipped step, linear model."""
        cfg = {"method": self.method, "epsilon": self.epsilon, "delta": self.delta, "num-rounds": 1,
               "num-clients": self.clients, "sample-rate": 1.0, "min-clients": self.clients,
               "local-epochs": 1, "batch-size": FULL_BATCH, "lr": self.lr, "clip": self.clip, "hidden": "",
               "model-ema": 0.0, "input-centering": False, "privacy-unit": "record", "graph": "complete",
               "divergence-factor": 0.0}
        if self.method in MP_FAMILY:  # FedSGD on the canary MLP; the paper's xi step (SGD) so the model is linear
            # self-mask off: the server removes the self-mask of every upload it holds, so its view is the same
            # without it, and the recovery below reads the uploads as they stand.
            cfg.update({"hidden": str(MLP_HIDDEN), "server-optimizer": "sgd", "mpddp-server-lr": self.lr,
                        "mpddp-side-dtype": "float64", "self-mask": False})
        if self.method == "ddpsa":  # the server's plain SGD step (lr) with the reconstructed sum: a linear release
            cfg["server-optimizer"] = "sgd"
        if self.fault == "strip-pair-noise":  # the server strips pair noise as it could without double masking:
            cfg["self-mask"] = False  # with self-masks the clients refuse (tests/test_masking.py drives that lie)
        return cfg


@dataclass
class AuditReport:
    """Claimed vs audited epsilon of one method and view."""

    method: str
    direction: str
    canary: str
    colluders: int
    fault: str | None
    claimed_epsilon: float  # the run's own figure for this view (inf: no guarantee claimed)
    delta: float
    adjacency: str
    bound: AuditBound
    trials: int  # canary records in the releases
    releases: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def epsilon_lb(self) -> float:
        """The audited lower bound (probability >= 1 - alpha)."""
        return self.bound.epsilon_lb

    @property
    def violation(self) -> bool:
        """The audit proves more privacy loss than claimed."""
        return self.bound.epsilon_lb > self.claimed_epsilon

    def as_dict(self) -> dict:
        """JSON types."""
        d = asdict(self)
        d["bound"] = self.bound.as_dict()
        d["epsilon_lb"] = self.epsilon_lb
        d["violation"] = self.violation
        return d

    def line(self) -> str:
        """One human-readable line."""
        b = self.bound
        claim = "none" if math.isinf(self.claimed_epsilon) else f"{self.claimed_epsilon:.3f}"
        extra = f" colluders={self.colluders}" if self.colluders else ""
        extra += f" fault={self.fault}" if self.fault else ""
        return (f"{self.method:5s} {self.direction:6s} {self.canary:8s}{extra}: claimed {claim}, "
                f"epsilon_lb {b.epsilon_lb:.3f} (95% interval [{b.epsilon_lb:.3f}, {b.epsilon_ub:.3f}], point "
                f"{b.epsilon_point:.3f}; TPR {b.true_positives}/{b.trials}, FPR {b.false_positives}/{b.trials}) "
                f"{self.trials} trials in {self.releases} releases, {self.seconds:.1f} s"
                + ("  VIOLATION" if self.violation else ""))


# ------------------------------------------------------------------------------------------- planted faults
@contextlib.contextmanager
def planted(fault: str | None, victim: Callable[[], int | None], method: str = "") -> Iterator[None]:
    """Patch the release code of ``method`` with ``fault`` for the duration (module attributes the handlers look up).

    ``victim()``: the node id of the client a per-client fault hits (the first participant of the release).
    """
    if fault is None or fault == "strip-pair-noise":  # the server-side fault is run by the audit itself
        yield
        return
    patches: list[tuple[object, str, object]] = []
    if fault == "halve-noise" and method == "ddpsa":
        import client.methods.ddpsa as ddpsa_client

        # The Laplace scale of the local noise or of the distributed share (a Gamma difference) halved; the PRG's
        # normals stay as they are (the Gamma sampler draws from them).
        for name in ("laplace_noise", "distributed_laplace_share"):
            orig_noise = getattr(ddpsa_client, name)
            patches.append((ddpsa_client, name, orig_noise))
            setattr(ddpsa_client, name, (lambda f: lambda size, scale, *a, **k: f(size, scale / 2, *a, **k))(orig_noise))
    elif fault == "halve-noise":
        import client.methods.nadp as nadp_client
        import protocols.prg as prg

        def halved(orig):
            return lambda seed, size, std=1.0, *a, **k: orig(seed, size, std / 2, *a, **k)

        # ldp, cdp and niss (its shares and distortions) call protocols.prg.gaussian when they release; nadp holds
        # its own reference.
        for mod in (prg, nadp_client):
            patches.append((mod, "gaussian", mod.gaussian))
            mod.gaussian = halved(mod.gaussian)
        orig_pairs = nadp_client.pairwise_noise
        patches.append((nadp_client, "pairwise_noise", orig_pairs))
        nadp_client.pairwise_noise = lambda *a, scale=1.0, **k: orig_pairs(  # type: ignore[assignment]
            *a, scale={j: s / 2 for j, s in scale.items()} if isinstance(scale, dict) else scale / 2, **k)
    elif fault == "skip-pair-noise":
        import client.methods.nadp as nadp_client

        orig = nadp_client.pairwise_noise
        patches.append((nadp_client, "pairwise_noise", orig))

        def skipping(own_id, seeds, size, **kw):
            return np.zeros(size) if own_id == victim() else orig(own_id, seeds, size, **kw)

        nadp_client.pairwise_noise = skipping  # type: ignore[assignment]
    elif fault == "private-kl":
        import client.methods.ladp as ladp_client
        from protocols.ladp import softmax_kl

        patches.append((ladp_client, "privacy_estimates", ladp_client.privacy_estimates))
        ladp_client.privacy_estimates = lambda msg, local_w, global_w: {  # type: ignore[assignment]
            name: softmax_kl(local_w[name], global_w[name]) for name in local_w}
    try:
        yield
    finally:
        for mod, name, value in reversed(patches):
            setattr(mod, name, value)


# ------------------------------------------------------------------------------------------- one release
@dataclass
class _Release:
    """One release's features per trial (canary): ``features`` (trials, f), plus claims."""

    features: np.ndarray
    labels: np.ndarray  # +1 / -1 per trial
    audited: np.ndarray  # bool per trial: part of the audit (its owner is a victim)
    owner: np.ndarray
    claims: dict[str, float]


def _release(spec: AuditSpec, cfg: RunConfig, canaries: _Canaries | _AdaptiveCanaries,
             rng: np.random.Generator, raw: dict | None = None) -> _Release:
    """Run one round of the method on fresh canaries; return the adversary's view.

    ``raw``: the run config the nodes get (default ``spec.run_config()``; ddpsa: with its intermediate servers).
    """
    canaries.draw(rng, spec.direction)
    grid = LocalGrid(_client_app(canaries), spec.clients, spec.run_config() if raw is None else raw, identities=False)
    strategy = strategy_class(spec.method)(cfg)
    strategy.max_examples = canaries.per_client
    arrays = to_record(get_weights(canaries.model()), strategy.wire_dtype)
    victim = {"node": None}
    with planted(spec.fault, lambda: victim["node"], spec.method):
        msgs = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
        victim["node"] = min(m.metadata.dst_node_id for m in msgs)
        replies = list(grid.send_and_receive(msgs))
        errors = [r.error.reason for r in replies if r.has_error()]
        if errors:
            raise RuntimeError(f"audit release failed on the client: {errors[0]}")
        aggregate, _ = close_round(strategy, grid, strategy._state, replies)
    if aggregate is None:
        raise RuntimeError("audit release: the strategy published no model")
    part = {nid: i for i, nid in enumerate(grid.node_ids)}  # node -> partition (LocalGrid's order)
    claims = strategy.privacy.report()
    owner = canaries.owner()
    audited = np.ones(len(owner), dtype=bool)
    if spec.fault in ("skip-pair-noise", "strip-pair-noise"):
        audited = owner == part[victim["node"]]  # a per-client fault: the audit of that client's records
    if spec.direction == "model" or spec.method == "ddpsa":  # ddpsa: the server reconstructs only the sum
        features = canaries.features([from_record(aggregate)])
    elif spec.method in MP_FAMILY:
        features = canaries.features(_mp_recovered(strategy, replies, part))
    elif isinstance(canaries, _AdaptiveCanaries):  # one trial per client: its own upload
        by_part = {part[r.metadata.src_node_id]: from_record(r.content["arrays"]) for r in replies}
        features = np.concatenate([canaries.features([by_part[c]]) for c in range(spec.clients)])
    else:
        uploads = {r.metadata.src_node_id: np.array(from_record(r.content["arrays"])["linear.weight"], dtype=np.float64)
                   for r in replies}
        _unmask(strategy, uploads)  # the server removes every self-mask it rebuilt (double masking)
        if spec.fault == "strip-pair-noise":
            target = victim["node"]
            _strip(strategy, grid, target, [n for n in uploads if n != target], uploads, replies)
        elif spec.colluders:
            colluders = sorted(uploads)[-spec.colluders:]
            for target in sorted(set(uploads) - set(colluders)):
                _strip_with(strategy, target, {c: _material(grid, canaries, c, target) for c in colluders}, uploads)
            audited = ~np.isin(owner, [part[c] for c in colluders])
        features = canaries.features([{"linear.weight": uploads[n]} for n in sorted(uploads, key=part.get)])
    return _Release(features, canaries.signs(), audited, owner, claims)


def _mp_recovered(strategy, replies: list[Message], part: dict[int, int]) -> list[dict[str, np.ndarray]]:
    """The MP family's upload view: every upload recovered alone with the round's secret R (the server holds both).

    Eq. (22) on one client's gradient, Psi and Phi gives that client's true-space gradient plus ``R o`` its
    noise (mpddp: eta and its uncancelled Delta's); returned as state-dict arrays, in partition order.
    """
    from client.messages.mpddp import mean_upload
    from protocols.mpddp import recover

    st = strategy._state
    out = []
    for r in sorted(replies, key=lambda r: part[r.metadata.src_node_id]):
        up = mean_upload([(r.metadata.src_node_id, r.content["arrays"])], len(st.layers))
        out.append({f"layers.{i}.weight": w.numpy() for i, (w, _) in enumerate(recover(up, st.secret))})
    return out


def _unmask(strategy, uploads: dict[int, np.ndarray]) -> None:
    """Subtract the self-masks the strategy rebuilt this round from ``uploads`` (in place): the server's view."""
    if getattr(strategy, "remove_masks", None) is None or strategy._state is None:
        return
    flat = {n: u.ravel() for n, u in uploads.items()}
    strategy.remove_masks(strategy._state, flat)
    for n, u in flat.items():
        uploads[n] = u.reshape(uploads[n].shape)


def _material(grid: LocalGrid, canaries: _Canaries, colluder: int, target: int) -> bytes:
    """The round's pair seed a colluding client holds with ``target`` (its :class:`RecoveryStore`)."""
    from client.recovery import RecoveryStore

    ctx = grid.contexts[colluder]
    x, y = canaries.data(int(ctx.node_config["partition-id"]))
    store = RecoveryStore.load(client_env(ctx, CanaryModel(canaries.dim), x, y))
    if store is None or target not in store.material:
        raise RuntimeError(f"colluder {colluder} holds no pair material with {target}")
    return store.material[target]


def _strip_with(strategy, target: int, seeds: dict[int, bytes], uploads: dict[int, np.ndarray]) -> None:
    """Remove from ``target``'s upload its pair noise with the peers whose seeds the server holds (in place).

    Peer j's own term for the pair is ``lam * pairwise_noise(j, {target: seed}, scale=std_j,target)`` in the
    aggregate (exactly what the strategy's dropout recovery subtracts); the target's term is its negative,
    scaled by ``1 / p_target`` in the upload.
    """
    st = strategy._state
    alloc, lam, p = st.allocation, st.plan.lam, st.weights[target]
    shape = uploads[target].shape
    flat = uploads[target].ravel()
    for j, seed in seeds.items():
        std = alloc.counteracting_stds(j)[target]
        flat += lam * pairwise_noise(j, {target: seed}, flat.size, scale={target: std}) / p
    uploads[target] = flat.reshape(shape)


def _strip(strategy, grid: LocalGrid, target: int, survivors: list[int], uploads: dict[int, np.ndarray],
           replies: list[Message]) -> None:
    """The planted server fault: the real recovery phase run for ``target`` although its upload is held."""
    st = dataclasses.replace(strategy._state, recovery=None)  # the round again, as the lying server tells it
    st.replies = {r.metadata.src_node_id: r for r in replies if r.metadata.src_node_id in survivors}
    st.uploaded, st.dropped = set(survivors), [target]  # the lie: target's upload "never arrived"
    strategy.recover(grid, st)
    rec = strategy.recovered(st)
    seeds = {j: m[target] for j, m in rec.material.items() if target in m and not rec.is_kept(j, target)}
    _strip_with(strategy, target, seeds, uploads)


# ------------------------------------------------------------------------------------------- the audit
def run_audit(spec: AuditSpec, *, seed: int | None = None, progress: Callable[[str], None] | None = None
              ) -> AuditReport:
    """Run ``spec``: releases until ``trials`` canaries, then the test; ``seed`` fixes the canary labels only."""
    spec.validate()
    with _quiet():
        return _run_audit(spec, seed, progress)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """One torch thread (the releases are small; threads only contend) and Flower's per-node warnings off."""
    import logging

    flwr_log = logging.getLogger("flwr")
    level, threads = flwr_log.level, torch.get_num_threads()
    flwr_log.setLevel(logging.ERROR)  # every release's nodes use the derived simulation identities (no roster)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        flwr_log.setLevel(level)
        torch.set_num_threads(threads)


def _canaries(spec: AuditSpec) -> _Canaries | _AdaptiveCanaries:
    if spec.canary_kind == "adaptive":
        return _AdaptiveCanaries(spec.clients, CANARY_SCALE * spec.clip)
    return _Canaries(spec.clients, spec.per_client, CANARY_SCALE * spec.clip, mlp=spec.method in MP_FAMILY)


@contextlib.contextmanager
def _run_config(spec: AuditSpec) -> Iterator[dict]:
    """The releases' run config; for ddpsa with local intermediate servers (started here, stopped on exit).

    The nodes use the derived simulation identities of the run seed, the roster the servers trust.
    """
    raw = spec.run_config()
    if spec.method != "ddpsa":
        yield raw
        return
    from protocols.identity import DerivedRoster
    from server.intermediate.launcher import start_intermediate_servers

    cfg = RunConfig.from_mapping(raw)
    # Every release is a run of its own (a fresh run id): the servers may evict a finished one at once.
    with start_intermediate_servers(cfg.ddpsa_num_servers, DerivedRoster(cfg.seed, cfg.num_clients),
                                    extra_args=["--run-idle-s", "0"]) as cluster:
        yield {**raw, **cluster.run_config()}


def _run_audit(spec: AuditSpec, seed: int | None, progress: Callable[[str], None] | None) -> AuditReport:
    with _run_config(spec) as raw:
        return _audit_releases(spec, raw, seed, progress)


def _audit_releases(spec: AuditSpec, raw: dict, seed: int | None, progress: Callable[[str], None] | None
                    ) -> AuditReport:
    cfg = RunConfig.from_mapping(raw)
    rng = np.random.default_rng(seed)
    canaries = _canaries(spec)
    releases = math.ceil(spec.trials / spec.audited_per_release())
    t0 = time.perf_counter()
    feats, labels, owners, groups, keep = [], [], [], [], []
    claims: dict[str, float] = {}
    for i in range(releases):
        rel = _release(spec, cfg, canaries, rng, raw)
        feats.append(rel.features)
        labels.append(rel.labels)
        owners.append(rel.owner)
        groups.append(np.full(len(rel.labels), i))
        keep.append(rel.audited)
        claims = rel.claims
        if progress is not None and (i + 1) % max(releases // 10, 1) == 0:
            progress(f"{i + 1}/{releases} releases, {time.perf_counter() - t0:.0f} s")
    keep_all = np.concatenate(keep)
    v = np.concatenate(feats)[keep_all]
    lab = np.concatenate(labels)[keep_all]
    own = np.concatenate(owners)[keep_all]
    grp = np.concatenate(groups)[keep_all]
    scores = fisher_scores(v, lab, own, grp % 2 == 0)
    if spec.method in MP_FAMILY:  # one secret R per release scales every canary's noise: one trial per release
        first = np.r_[True, grp[1:] != grp[:-1]]  # the threshold is chosen for the same count (the fit used all)
        scores, lab, grp = scores[first], lab[first], grp[first]
    bound = audit_scores(scores, lab, grp, spec.claim_delta, spec.alpha)
    key = "epsilon_uplink" if spec.direction == "upload" else "epsilon_downlink"
    claimed = float(claims.get(key, math.inf))
    notes = [f"claim: the run's {key} after one round at epsilon={spec.epsilon} (one-round mechanism)"]
    if spec.method == "niss" and spec.direction == "upload":
        notes.append("niss: epsilon_uplink is accounted with each upload's own noise sigma_k; the server's best linear "
                     "combination of all uploads keeps less (sigma_k^2 (2 + tau^2 + 2/m) / (1 + 2/(m tau^2)) for a "
                     "complete graph of m + 1 clients: 0.795 sigma_k^2 at 4 clients), so the claim is below the "
                     "joint view's Gaussian-equivalent epsilon")
    if spec.method in PURE_DP:
        notes.append("claim: pure epsilon-DP (Laplace); the bound uses delta = 0")
    if spec.canary_kind == "adaptive":
        notes.append("canary: adaptive (a label flip that also moves ladp's KL estimate; statistic: shift and noise scale)")
    if spec.method in MP_FAMILY:
        notes.append("MP family: the release's secret R scales the noise of all its canaries, so the threshold and the "
                     "bound count one canary per release (the others fit the test)")
    return AuditReport(spec.method, spec.direction, spec.canary_kind, spec.colluders, spec.fault, claimed, spec.claim_delta,
                       ADJACENCY, bound, int(keep_all.sum()), releases, time.perf_counter() - t0, notes)


# ------------------------------------------------------------------------------------------- cancelfl audit
def add_arguments(p) -> None:
    """Options of ``cancelfl audit``."""
    p.add_argument("--method", required=True, help=f"method to audit ({', '.join(AUDITED)})")
    p.add_argument("--direction", choices=DIRECTIONS, default="upload",
                   help="upload: what the server holds of the uploads; model: the published aggregate")
    p.add_argument("--epsilon", type=float, default=4.0, help="the run's epsilon (one round: the audited claim)")
    p.add_argument("--trials", type=int, default=None, help="canary records over all releases (default: per method)")
    p.add_argument("--canary", choices=CANARIES, default=None,
                   help="gradient: white-box gradient canaries; adaptive: ladp's data-dependent noise scale (its default)")
    p.add_argument("--colluders", type=int, default=0, help="upload view: peers handing the server their pair material")
    p.add_argument("--fault", choices=FAULTS, default=None, help="plant a fault in the release code (audit self-test)")
    p.add_argument("--clients", type=int, default=None, help="clients per release (default: per method)")
    p.add_argument("--per-client", type=int, default=None, help="canaries per client and release (default: per method)")
    p.add_argument("--json", default="", help="also write the report as JSON to this file")


def main(args) -> int:
    """``cancelfl audit``: 0 = no violation, 1 = the audit proves more privacy loss than claimed, 2 = refused."""
    import json
    import sys
    from pathlib import Path

    fed = federation(args.method, args.direction, args.canary)
    spec = AuditSpec(args.method, args.direction, args.epsilon, args.trials or fed["trials"], args.canary, args.colluders,
                     args.fault, args.clients or fed["clients"], args.per_client or fed["per_client"])
    try:
        spec.validate()
    except ConfigError as err:
        print(f"cancelfl audit: {err}", file=sys.stderr)
        return 2
    report = run_audit(spec, progress=lambda s: print(f"cancelfl audit: {s}", file=sys.stderr))
    print(report.line())
    for note in report.notes:
        print(f"  {note}; adjacency: {report.adjacency}")
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    return 1 if report.violation else 0
