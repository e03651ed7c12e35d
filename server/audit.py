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

Views (``direction``): ``upload`` = what the server holds of the uploads (all of them: pair noise is
correlated across uploads), optionally with ``colluders`` peers handing the server their round's pair material
(:class:`client.recovery.RecoveryStore`, what a colluding client holds); ``model`` = the published aggregate.
The statistic per record is Fisher's linear discriminant of its coordinates across the view's vectors,
fitted on one half of the releases (no trust in the implementation's own noise covariance) and tested on the
other half (:func:`protocols.privacy.audit.audit_scores`).

The claim audited is the run's own: the strategy's privacy ledger after the round (``epsilon_uplink`` /
``epsilon_downlink`` of a one-round run at ``epsilon``), i.e. the one-round mechanism against the epsilon the
accountant gives for it; ``inf`` where the method claims no guarantee in that direction.

Planted faults (``fault``, for the audit's own tests): ``halve-noise`` (the method's Gaussian std halved in the
release code), ``skip-pair-noise`` (one nadp client uploads without its pair noise), ``strip-pair-noise`` (the
server tells every neighbour of one client that it dropped while holding its upload, and removes the revealed
pair noise from it; planted with ``self-mask = false``, since with double masking the clients refuse).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp
from torch import nn

from client.api import attach, client_env
from client.models import get_weights
from client.wire import from_record, to_record
from protocols.config import ConfigError, RunConfig
from protocols.methods import FULL_BATCH, method_spec
from protocols.pairwise import pairwise_noise
from protocols.privacy.audit import AuditBound, audit_scores
from server.local_grid import LocalGrid
from strategies.registry import strategy_class

__all__ = ["AUDITED", "DIRECTIONS", "FAULTS", "AuditReport", "AuditSpec", "run_audit"]

DIRECTIONS: tuple[str, ...] = ("upload", "model")
CANARIES: tuple[str, ...] = ("gradient",)
FAULTS: tuple[str, ...] = ("halve-noise", "skip-pair-noise", "strip-pair-noise")
#: Methods the audit drives, and the adjacency their claim uses.
AUDITED: tuple[str, ...] = ("ldp", "cdp", "nadp")
ADJACENCY = "replace-one record (a canary's label flipped)"
#: Input scale of a canary in units of clip: its gradient norm at W = 0 is ``scale clip / sqrt 2`` > clip.
CANARY_SCALE = 10.0


@dataclass(frozen=True)
class AuditSpec:
    """One audit: method, view, claimed budget, trials and the federation the releases run on."""

    method: str
    direction: str = "upload"
    epsilon: float = 4.0
    trials: int = 300_000  # canary records over all releases (half select the test, half bound epsilon)
    canary: str = "gradient"
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
        if self.canary not in CANARIES:
            raise ConfigError(f"audit: canary {self.canary!r}; choose one of {', '.join(CANARIES)}")
        if self.fault is not None and self.fault not in FAULTS:
            raise ConfigError(f"audit: fault {self.fault!r}; choose one of {', '.join(FAULTS)}")
        if self.fault in ("skip-pair-noise", "strip-pair-noise") and self.method != "nadp":
            raise ConfigError(f"audit: fault {self.fault!r} plants a pair-noise fault: method must be nadp")
        if self.clients < 2 or self.per_client < 2:
            raise ConfigError("audit: clients and per-client canaries must be >= 2")
        if not 0 <= self.colluders <= self.clients - 2:
            raise ConfigError(f"audit: colluders must be in 0..clients-2 (clients={self.clients})")
        if self.colluders and (self.direction != "upload" or method_spec(self.method).family != "pairwise"):
            raise ConfigError("audit: colluders apply to the upload view of a pairwise method (nadp)")
        if self.trials < 4 * self.audited_per_release():
            raise ConfigError(f"audit: trials must be >= {4 * self.audited_per_release()} (4 releases)")

    def audited_per_release(self) -> int:
        """Canaries of one release the audit reads: the victim's (per-client faults), the non-colluders', or all."""
        if self.fault in ("skip-pair-noise", "strip-pair-noise"):
            return self.per_client
        return (self.clients - self.colluders) * self.per_client

    def run_config(self) -> dict:
        """The run config of every release: one round, one full-batch clipped step, linear model."""
        return {"method": self.method, "epsilon": self.epsilon, "delta": self.delta, "num-rounds": 1,
                "num-clients": self.clients, "sample-rate": 1.0, "min-clients": self.clients,
                "local-epochs": 1, "batch-size": FULL_BATCH, "lr": self.lr, "clip": self.clip, "hidden": "",
                "model-ema": 0.0, "input-centering": False, "privacy-unit": "record", "graph": "complete",
                "divergence-factor": 0.0,
                # The recovery fault is the server stripping pair noise as it could without double masking: with
                # self-masks the clients refuse to reveal it (tests/test_masking.py drives that lie).
                **({"self-mask": False} if self.fault == "strip-pair-noise" else {})}


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


# ------------------------------------------------------------------------------------------- the canaries
class CanaryModel(nn.Module):
    """Bias-free linear classifier with 2 outputs: logits ``W x`` (state-dict key ``weight``, shape (2, d))."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2, bias=False)
        with torch.no_grad():
            self.linear.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.linear(x)


@dataclass
class _Canaries:
    """The records of one release: client c holds inputs ``scale e_k`` for k in its block, labels in {0, 1}."""

    clients: int
    per_client: int
    scale: float
    labels: np.ndarray = field(init=False)  # (clients * per_client,) in {0, 1}

    def __post_init__(self) -> None:
        self.dim = self.clients * self.per_client
        self.draw(np.random.default_rng())

    def draw(self, rng: np.random.Generator) -> None:
        """Fresh labels for the next release (the canaries' secret values)."""
        self.labels = rng.integers(0, 2, size=self.dim)

    def data(self, client: int) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) of ``client``."""
        block = slice(client * self.per_client, (client + 1) * self.per_client)
        x = np.zeros((self.per_client, self.dim), dtype=np.float32)
        x[np.arange(self.per_client), np.arange(block.start, block.stop)] = self.scale
        return x, self.labels[block].astype(np.int64)

    def owner(self) -> np.ndarray:
        """The client holding each canary."""
        return np.repeat(np.arange(self.clients), self.per_client)


def _client_app(canaries: _Canaries) -> ClientApp:
    """The stock handlers of the method on the canary model and this release's canaries."""
    def load(context: Context) -> tuple[nn.Module, np.ndarray, np.ndarray]:
        x, y = canaries.data(int(context.node_config["partition-id"]))
        return CanaryModel(canaries.dim), x, y

    return attach(ClientApp(), load)


def _direction_scores(weight: np.ndarray) -> np.ndarray:
    """Per input coordinate k: the released weights projected on ``v_k`` (larger = label 0 more likely)."""
    w = np.asarray(weight, dtype=np.float64).reshape(2, -1)
    return (w[0] - w[1]) / math.sqrt(2.0)


# ------------------------------------------------------------------------------------------- planted faults
@contextlib.contextmanager
def planted(fault: str | None, victim: Callable[[], int | None]) -> Iterator[None]:
    """Patch the release code with ``fault`` for the duration (module attributes the handlers look up).

    ``victim()``: the node id of the client a per-client fault hits (the first participant of the release).
    """
    if fault is None or fault == "strip-pair-noise":  # the server-side fault is run by the audit itself
        yield
        return
    patches: list[tuple[object, str, object]] = []
    if fault == "halve-noise":
        import client.methods.nadp as nadp_client
        import protocols.prg as prg

        def halved(orig):
            return lambda seed, size, std=1.0, *a, **k: orig(seed, size, std / 2, *a, **k)

        # ldp and cdp import protocols.prg.gaussian when they release; nadp holds its own reference.
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
    try:
        yield
    finally:
        for mod, name, value in reversed(patches):
            setattr(mod, name, value)


# ------------------------------------------------------------------------------------------- one release
@dataclass
class _Release:
    """One release's view vectors per canary coordinate: ``views`` (views, dim), plus claims."""

    views: np.ndarray
    labels: np.ndarray  # +1 / -1 per canary
    audited: np.ndarray  # bool per canary: part of the audit (its owner is a victim)
    owner: np.ndarray
    claims: dict[str, float]


def _release(spec: AuditSpec, cfg: RunConfig, canaries: _Canaries, rng: np.random.Generator) -> _Release:
    """Run one round of the method on fresh canaries; return the adversary's view."""
    canaries.draw(rng)
    grid = LocalGrid(_client_app(canaries), spec.clients, spec.run_config(), identities=False)
    strategy = strategy_class(spec.method)(cfg)
    strategy.max_examples = spec.per_client
    model = CanaryModel(canaries.dim)
    arrays = to_record(get_weights(model), strategy.wire_dtype)
    victim = {"node": None}
    with planted(spec.fault, lambda: victim["node"]):
        msgs = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
        victim["node"] = min(m.metadata.dst_node_id for m in msgs)
        replies = list(grid.send_and_receive(msgs))
        errors = [r.error.reason for r in replies if r.has_error()]
        if errors:
            raise RuntimeError(f"audit release failed on the client: {errors[0]}")
        uploads = {r.metadata.src_node_id: from_record(r.content["arrays"])["linear.weight"] for r in replies}
        aggregate, _ = strategy.aggregate_train(1, replies)
    if aggregate is None:
        raise RuntimeError("audit release: the strategy published no model")
    part = {nid: i for i, nid in enumerate(grid.node_ids)}  # node -> partition (LocalGrid's order)
    claims = strategy.privacy.report()
    owner = canaries.owner()
    audited = np.ones(canaries.dim, dtype=bool)
    if spec.fault in ("skip-pair-noise", "strip-pair-noise"):
        audited = owner == part[victim["node"]]  # a per-client fault: the audit of that client's records
    if spec.direction == "model":
        views = _direction_scores(from_record(aggregate)["linear.weight"])[None, :]
    else:
        uploads = {n: np.array(u, dtype=np.float64) for n, u in uploads.items()}
        _unmask(strategy, uploads)  # the server removes every self-mask it rebuilt (double masking)
        if spec.fault == "strip-pair-noise":
            target = victim["node"]
            _strip(strategy, grid, target, [n for n in uploads if n != target], uploads, replies)
        elif spec.colluders:
            colluders = sorted(uploads)[-spec.colluders:]
            for target in sorted(set(uploads) - set(colluders)):
                _strip_with(strategy, target, {c: _material(grid, canaries, c, target) for c in colluders}, uploads)
            audited = ~np.isin(owner, [part[c] for c in colluders])
        views = np.stack([_direction_scores(uploads[n]) for n in sorted(uploads, key=part.get)])
    signs = np.where(canaries.labels == 0, 1, -1)  # label 0: W[0] grows along v_k
    return _Release(views, signs, audited, owner, claims)


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
    st = strategy._state
    by_node = {r.metadata.src_node_id: r for r in replies if r.metadata.src_node_id in survivors}
    strategy.uploaded = set(survivors)  # the lie: target's upload "never arrived"
    strategy.recover(st, [target], by_node)
    rec = strategy.recovered(st)
    seeds = {j: m[target] for j, m in rec.material.items() if target in m and not rec.is_kept(j, target)}
    _strip_with(strategy, target, seeds, uploads)


# ------------------------------------------------------------------------------------------- the audit
def _fisher_scores(views: np.ndarray, labels: np.ndarray, owner: np.ndarray, fit: np.ndarray) -> np.ndarray:
    """Fisher discriminant per owner, fitted on the trials ``fit``; scores of every trial.

    ``views``: (trials, v) coordinates of each canary in each view vector.  Within-class covariance pooled
    over owners and labels (ridge 1e-12 x trace for views without noise).
    """
    scores = np.empty(len(labels))
    for o in np.unique(owner):
        rows = owner == o
        f = fit & rows
        mu_p = views[f & (labels > 0)].mean(0)
        mu_n = views[f & (labels < 0)].mean(0)
        centred = np.where((labels[f] > 0)[:, None], views[f] - mu_p, views[f] - mu_n)
        cov = centred.T @ centred / max(len(centred) - 2, 1)
        cov += np.eye(len(cov)) * (1e-12 * np.trace(cov) + 1e-300)
        w = np.linalg.solve(cov, mu_p - mu_n)
        scores[rows] = (views[rows] - (mu_p + mu_n) / 2) @ w
    return scores


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


def _run_audit(spec: AuditSpec, seed: int | None, progress: Callable[[str], None] | None) -> AuditReport:
    cfg = RunConfig.from_mapping(spec.run_config())
    rng = np.random.default_rng(seed)
    canaries = _Canaries(spec.clients, spec.per_client, CANARY_SCALE * spec.clip)
    releases = math.ceil(spec.trials / spec.audited_per_release())
    t0 = time.perf_counter()
    views, labels, owners, groups, keep = [], [], [], [], []
    claims: dict[str, float] = {}
    for i in range(releases):
        rel = _release(spec, cfg, canaries, rng)
        views.append(rel.views.T)
        labels.append(rel.labels)
        owners.append(rel.owner)
        groups.append(np.full(canaries.dim, i))
        keep.append(rel.audited)
        claims = rel.claims
        if progress is not None and (i + 1) % max(releases // 10, 1) == 0:
            progress(f"{i + 1}/{releases} releases, {time.perf_counter() - t0:.0f} s")
    keep_all = np.concatenate(keep)
    v = np.concatenate(views)[keep_all]
    lab = np.concatenate(labels)[keep_all]
    own = np.concatenate(owners)[keep_all]
    grp = np.concatenate(groups)[keep_all]
    scores = _fisher_scores(v, lab, own, grp % 2 == 0)
    bound = audit_scores(scores, lab, grp, spec.delta, spec.alpha)
    key = "epsilon_uplink" if spec.direction == "upload" else "epsilon_downlink"
    claimed = float(claims.get(key, math.inf))
    notes = [f"claim: the run's {key} after one round at epsilon={spec.epsilon} (one-round mechanism)"]
    return AuditReport(spec.method, spec.direction, spec.canary, spec.colluders, spec.fault, claimed, spec.delta,
                       ADJACENCY, bound, int(keep_all.sum()), releases, time.perf_counter() - t0, notes)


# ------------------------------------------------------------------------------------------- cancelfl audit
def add_arguments(p) -> None:
    """Options of ``cancelfl audit``."""
    p.add_argument("--method", required=True, help=f"method to audit ({', '.join(AUDITED)})")
    p.add_argument("--direction", choices=DIRECTIONS, default="upload",
                   help="upload: what the server holds of the uploads; model: the published aggregate")
    p.add_argument("--epsilon", type=float, default=4.0, help="the run's epsilon (one round: the audited claim)")
    p.add_argument("--trials", type=int, default=AuditSpec.trials, help="canary records over all releases")
    p.add_argument("--canary", choices=CANARIES, default="gradient", help="gradient: white-box gradient canaries")
    p.add_argument("--colluders", type=int, default=0, help="upload view: peers handing the server their pair material")
    p.add_argument("--fault", choices=FAULTS, default=None, help="plant a fault in the release code (audit self-test)")
    p.add_argument("--clients", type=int, default=AuditSpec.clients)
    p.add_argument("--per-client", type=int, default=AuditSpec.per_client, help="canaries per client and release")
    p.add_argument("--json", default="", help="also write the report as JSON to this file")


def main(args) -> int:
    """``cancelfl audit``: 0 = no violation, 1 = the audit proves more privacy loss than claimed, 2 = refused."""
    import json
    import sys
    from pathlib import Path

    spec = AuditSpec(args.method, args.direction, args.epsilon, args.trials, args.canary, args.colluders, args.fault,
                     args.clients, args.per_client)
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
