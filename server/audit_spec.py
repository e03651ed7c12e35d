"""What an audit is: its options (:class:`AuditSpec`), its result (:class:`AuditReport`) and the per-method defaults.

The claim audited is the run's own: the strategy's privacy ledger after one round at ``epsilon``
(``epsilon_uplink`` for the ``upload`` view, ``epsilon_downlink`` for ``model``); ``inf`` where the method claims
no guarantee in that direction.  ddpsa claims pure epsilon-DP: its bound is computed with ``delta = 0``
(:attr:`AuditSpec.claim_delta`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from protocols.config import ConfigError
from protocols.methods import FULL_BATCH
from protocols.privacy.audit import AuditBound
from server.audit_canaries import MLP_HIDDEN

__all__ = ["ADJACENCY_TEXT", "AUDITED", "CANARIES", "CANARY_SCALE", "DIRECTIONS", "FAULTS", "HALVE_NOISE", "MP_FAMILY",
           "PURE_DP", "AuditReport", "AuditSpec", "default_canary", "federation"]

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
#: How the canaries make neighbouring datasets, per adjacency (run-config ``adjacency``).
ADJACENCY_TEXT: dict[str, str] = {"zero-out": "zero-out record (a canary present or its input zeroed)",
                                  "replace-one": "replace-one record (a canary's label flipped)"}
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
    adjacency: str | None = None  # None: zero-out (the run-config default), replace-one for adaptive canaries

    def validate(self) -> None:
        """Refuse a spec the audit cannot run, naming the option (:class:`ConfigError`)."""
        if self.method not in AUDITED:
            raise ConfigError(f"audit: method {self.method!r} is not audited yet; audited: {', '.join(AUDITED)}")
        if self.direction not in DIRECTIONS:
            raise ConfigError(f"audit: direction {self.direction!r}; choose one of {', '.join(DIRECTIONS)}")
        if self.canary_kind not in CANARIES:
            raise ConfigError(f"audit: canary {self.canary!r}; choose one of {', '.join(CANARIES)}")
        if self.adjacency_used not in ADJACENCY_TEXT:
            raise ConfigError(f"audit: adjacency {self.adjacency!r}; choose one of {', '.join(ADJACENCY_TEXT)}")
        if self.canary_kind == "adaptive" and self.adjacency_used != "replace-one":
            raise ConfigError("audit: adaptive canaries are label flips: adjacency must be replace-one")
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
    def adjacency_used(self) -> str:
        """The neighbouring datasets the canaries make and the claim is computed for."""
        if self.adjacency is not None:
            return self.adjacency
        return "replace-one" if self.canary_kind == "adaptive" else "zero-out"

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
               "divergence-factor": 0.0, "adjacency": self.adjacency_used}
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
