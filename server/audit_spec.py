"""What an audit is: its options (:class:`AuditSpec`), its result (:class:`AuditReport`) and the method's adapter.

The claim audited is the run's own: the strategy's privacy ledger after the run's first round at ``epsilon``
(``epsilon_uplink`` for the ``upload`` view, ``epsilon_downlink`` for ``model``, or the account the adapter names
for the view, :meth:`server.audit_adapter.AuditAdapter.claim_account`, e.g. niss's uploads with no colluding
neighbour; ``rounds`` and ``settings`` make the run's schedule and options); ``inf`` where the method claims no
guarantee in that direction.  The bound uses
``delta = 0`` where the ledger certifies the claim as pure epsilon-DP (:func:`server.audit_release.claim_of`).
What the audit knows of a method comes from its card's audit adapter (:attr:`protocols.methods.MethodSpec.audit`,
:class:`server.audit_adapter.AuditAdapter`): its canaries, planted faults, federation, extra run config, and how
many colluding peers its claim tolerates.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from protocols.config import ConfigError
from protocols.methods import FULL_BATCH, NO_COLLUDER, MethodSpec, method_names, method_spec

if TYPE_CHECKING:  # the accountants (scipy, dp-accounting) load with the audit itself, not with its options
    from protocols.privacy.audit import AuditBound

__all__ = ["ADJACENCY_TEXT", "CANARIES", "CANARY_SCALE", "CLAIMS", "DIRECTIONS", "AuditReport", "AuditSpec", "audit_adapter",
           "auditable_methods", "default_canary", "default_direction", "faults", "federation", "methods_where"]

DIRECTIONS: tuple[str, ...] = ("upload", "model")
#: ``gradient``: white-box gradient canaries (label flips, every method); ``adaptive``: canaries that move a
#: data-dependent noise scale, one per client (:mod:`server.audit_canaries`).
CANARIES: tuple[str, ...] = ("gradient", "adaptive")
#: How the canaries make neighbouring datasets, per adjacency (run-config ``adjacency``).
ADJACENCY_TEXT: dict[str, str] = {"zero-out": "zero-out record (a canary present or its input zeroed)",
                                  "replace-one": "replace-one record (a canary's label flipped)"}
#: The ledger accounts a claim is read from (:meth:`server.audit_adapter.AuditAdapter.claim_account`), by name.
CLAIMS: dict[str, str] = {"uplink": "uploads", "downlink": "published model",
                          NO_COLLUDER: "uploads (no colluding neighbour)"}
#: Input scale of a canary in units of clip: its gradient norm at W = 0 is ``scale clip / sqrt 2`` > clip.
CANARY_SCALE = 10.0


def audit_adapter(method: str) -> Any:
    """The audit adapter ``method``'s card declares (:attr:`MethodSpec.audit`), loaded and instantiated.

    Raises:
        ConfigError: ``method`` is unknown, or its card declares no adapter (not auditable).
    """
    try:
        target = method_spec(method).audit
    except ValueError as err:
        raise ConfigError(f"audit: {err}") from None
    if target is None:
        raise ConfigError(f"audit: method {method!r} is not auditable (its card declares no audit adapter, "
                          f"MethodSpec.audit); auditable: {', '.join(auditable_methods())}")
    adapter = MethodSpec.load(target)
    return adapter() if isinstance(adapter, type) else adapter


def auditable_methods() -> tuple[str, ...]:
    """Every registered method with an audit adapter, in registration order."""
    return tuple(m for m in method_names() if method_spec(m).audit is not None)


def methods_where(test: Any) -> tuple[str, ...]:
    """The auditable methods whose adapter passes ``test(adapter)`` (named in refusals)."""
    return tuple(m for m in auditable_methods() if test(audit_adapter(m)))


def faults() -> tuple[str, ...]:
    """Every fault some auditable method plants (``cancelfl audit --fault``), first-seen order."""
    return tuple(dict.fromkeys(f for m in auditable_methods() for f in audit_adapter(m).faults))


def federation(method: str, direction: str = "upload", canary: str | None = None, given_secret: bool = False,
               fault: str | None = None) -> dict[str, int]:
    """Default ``trials``, ``clients`` and ``per_client`` of an audit of ``method`` (its adapter's choice).

    ``canary`` None: the one ``fault`` is audited with (:func:`default_canary`).  A ``fault`` with a self-test row
    that sets its trials (:class:`server.audit_faults.SelfTest`) is audited with those, the count
    ``cancelfl-bench audit`` checks it is caught with.
    """
    adapter = audit_adapter(method)
    canary = canary if canary is not None else default_canary(method, fault)
    secret = given_secret or (direction == "model" and adapter.secret_view)
    out = adapter.federation(direction, canary, given_secret=True) if secret else adapter.federation(direction, canary)
    own = next((t.trials for t in adapter.self_tests if t.fault == fault and t.trials), None) if fault else None
    return {**out, "trials": own} if own else out


def default_canary(method: str, fault: str | None = None) -> str:
    """The canary a method is audited with by default: ``fault``'s (adapter's ``fault_canaries``), else its first."""
    adapter = audit_adapter(method)
    return adapter.fault_canaries.get(fault, adapter.canaries[0]) if fault is not None else adapter.canaries[0]


def default_direction(method: str, fault: str | None = None) -> str:
    """The view a method is audited in by default: ``fault``'s self-test view (adapter's ``fault_view``), else upload.

    E.g. cdp's ``halve-noise`` (its server's noise) is audited on the published model: its uploads claim nothing.
    """
    return audit_adapter(method).fault_view(fault) if fault is not None else "upload"


@dataclass(frozen=True)
class AuditSpec:
    """One audit: method, view, claimed budget, trials and the federation the releases run on."""

    method: str
    direction: str = "upload"
    epsilon: float = 4.0
    trials: int = 300_000  # canary records over all releases (a quarter fit the test, the rest bound epsilon)
    canary: str | None = None  # None: the fault's canary or the adapter's first (default_canary)
    colluders: int = 0  # upload view: peers that hand the server their pair material
    fault: str | None = None
    clients: int = 4
    per_client: int = 500  # canaries of one client per release
    delta: float = 1e-5
    alpha: float = 0.05
    clip: float = 1.0
    lr: float = 1.0
    adjacency: str | None = None  # None: zero-out (the run-config default), replace-one for adaptive canaries
    rounds: int = 1  # the run's num-rounds (its schedule and calibration); the audit releases its first round
    settings: tuple[tuple[str, Any], ...] = ()  # further run-config keys of the run (e.g. a method option)
    given_secret: bool = False  # model view read with the release's secret (MP family: its R), every canary counted

    def validate(self) -> None:
        """Refuse a spec the audit cannot run, naming the option (:class:`ConfigError`)."""
        adapter = self.adapter
        if self.direction not in DIRECTIONS:
            raise ConfigError(f"audit: direction {self.direction!r}; choose one of {', '.join(DIRECTIONS)}")
        if self.canary_kind not in CANARIES:
            raise ConfigError(f"audit: canary {self.canary!r}; choose one of {', '.join(CANARIES)}")
        if self.adjacency_used not in ADJACENCY_TEXT:
            raise ConfigError(f"audit: adjacency {self.adjacency!r}; choose one of {', '.join(ADJACENCY_TEXT)}")
        if self.canary_kind == "adaptive" and self.adjacency_used != "replace-one":
            raise ConfigError("audit: adaptive canaries are label flips: adjacency must be replace-one")
        if self.canary_kind not in adapter.canaries:
            with_it = methods_where(lambda a: self.canary_kind in a.canaries)
            raise ConfigError(f"audit: canary {self.canary_kind!r} is not one method {self.method!r} is audited with "
                              f"({', '.join(adapter.canaries)}); audited with it: {', '.join(with_it)}")
        if self.fault is not None and self.fault not in adapter.faults:
            if self.fault not in faults():
                raise ConfigError(f"audit: fault {self.fault!r}; choose one of {', '.join(faults())}")
            planted = methods_where(lambda a: self.fault in a.faults)
            raise ConfigError(f"audit: fault {self.fault!r} is not planted in method {self.method!r}; planted in: "
                              f"{', '.join(planted)}")
        if self.clients < 2 or self.per_client < 2:
            raise ConfigError("audit: clients and per-client canaries must be >= 2")
        if not 0 <= self.colluders <= self.clients - 2:
            raise ConfigError(f"audit: colluders must be in 0..clients-2 (clients={self.clients})")
        if self.colluders and (self.direction != "upload" or not adapter.colluders):
            raise ConfigError("audit: colluders apply to the upload view of a method whose peers can hand the server "
                              f"their pair material ({', '.join(methods_where(lambda a: a.colluders))})")
        if self.given_secret and (self.direction != "model" or not adapter.secret_view):
            raise ConfigError("audit: given-secret applies to the model view of a method whose release has a secret "
                              f"the claim's argument conditions on ({', '.join(methods_where(lambda a: a.secret_view))})")
        if self.rounds < 1:
            raise ConfigError("audit: rounds must be >= 1")
        if self.trials < 4 * self.audited_per_release():
            raise ConfigError(f"audit: trials must be >= {4 * self.audited_per_release()} (4 releases)")

    @property
    def adapter(self) -> Any:
        """The method's audit adapter (:func:`audit_adapter`; ConfigError if it has none)."""
        return audit_adapter(self.method)

    @property
    def adjacency_used(self) -> str:
        """The neighbouring datasets the canaries make and the claim is computed for."""
        if self.adjacency is not None:
            return self.adjacency
        return "replace-one" if self.canary_kind == "adaptive" else "zero-out"

    @property
    def reads_secret(self) -> bool:
        """The model view is read with the release's secret: asked for, or the method's model view (``secret_view``)."""
        return self.given_secret or (self.direction == "model" and self.adapter.secret_view)

    @property
    def canary_kind(self) -> str:
        """The canary used: ``canary``, or the method's default for the fault (:func:`default_canary`)."""
        return self.canary if self.canary is not None else default_canary(self.method, self.fault)

    def audited_per_release(self) -> int:
        """Canaries of one release the audit reads: the victim's (per-client faults), the non-colluders', or all."""
        if self.canary_kind == "adaptive":
            return 1 if self.direction == "model" else self.clients
        if self.fault is not None and self.adapter.faults[self.fault].per_client:
            return self.per_client
        return (self.clients - self.colluders) * self.per_client

    def run_config(self) -> dict:
        """The run config of every release: one full-batch clipped step, linear model, ``rounds`` in the schedule.

        Precedence: these keys, then the adapter's, then ``settings``, then the planted fault's.
        """
        cfg = {"method": self.method, "epsilon": self.epsilon, "delta": self.delta, "num-rounds": self.rounds,
               "num-clients": self.clients, "sample-rate": 1.0, "min-clients": self.clients,
               "local-epochs": 1, "batch-size": FULL_BATCH, "lr": self.lr, "clip": self.clip, "hidden": "",
               "model-ema": 0.0, "input-centering": False, "privacy-unit": "record", "graph": "complete",
               "divergence-factor": 0.0, "adjacency": self.adjacency_used}
        cfg.update(self.adapter.run_config(self))
        cfg.update(dict(self.settings))
        if self.fault is not None:
            cfg.update(self.adapter.faults[self.fault].run_config)
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
    tolerated_colluders: int = 0  # colluding peers the claim still covers (the adapter's reading of the run config)
    covered: bool = True  # the claim covers this view (colluders within tolerance; a secret the claim conditions on)
    nominal: bool = False  # the method states its claim as nominal (no guarantee): exceeding it is no violation
    cpu_seconds: float = math.nan  # process time of the releases and the test (wall ``seconds`` includes waiting)
    claim: str = "uplink"  # the ledger account the claim is read from (:data:`CLAIMS`)

    @property
    def claim_view(self) -> str:
        """What the claim covers, in words (:data:`CLAIMS`)."""
        return CLAIMS.get(self.claim, self.claim)

    @property
    def epsilon_lb(self) -> float:
        """The audited lower bound (probability >= 1 - alpha)."""
        return self.bound.epsilon_lb

    @property
    def exceeds_claim(self) -> bool:
        """The audit proves more privacy loss than the claimed figure."""
        return self.bound.epsilon_lb > self.claimed_epsilon

    @property
    def violation(self) -> bool:
        """The audit proves more privacy loss than guaranteed in a view the claim covers (:attr:`covered`, not nominal)."""
        return self.exceeds_claim and self.covered and not self.nominal

    def as_dict(self) -> dict:
        """JSON types."""
        d = asdict(self)
        d["bound"] = self.bound.as_dict()
        d["epsilon_lb"] = self.epsilon_lb
        d["violation"] = self.violation
        d["exceeds_claim"] = self.exceeds_claim
        d["claim_view"] = self.claim_view
        return d

    def line(self) -> str:
        """One human-readable line."""
        b = self.bound
        claim = "none" if math.isinf(self.claimed_epsilon) else f"{self.claimed_epsilon:.3f}"
        extra = f" colluders={self.colluders} (claim covers {self.tolerated_colluders})" if self.colluders else ""
        extra += f" fault={self.fault}" if self.fault else ""
        return (f"{self.method:5s} {self.direction:6s} {self.canary:8s}{extra}: claimed {claim} ({self.claim_view}), "
                f"epsilon_lb {b.epsilon_lb:.3f} (95% interval [{b.epsilon_lb:.3f}, {b.epsilon_ub:.3f}], point "
                f"{b.epsilon_point:.3f}; TPR {b.true_positives}/{b.trials}, FPR {b.false_positives}/{b.trials}) "
                f"{self.trials} trials in {self.releases} releases, {self.seconds:.1f} s "
                f"(cpu {self.cpu_seconds:.1f} s)"
                + ("" if not self.exceeds_claim else "  VIOLATION" if self.violation
                   else "  (above the claim, outside its threat model)" if not self.covered
                   else "  (above the nominal claim)"))
