"""What the registry knows of a method: :class:`MethodSpec` and its :class:`Guarantee`, and the shared constants."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from protocols.options import MethodOptions

#: The run-config value that means "the method's regime decides" (:func:`protocols.methods.regime`).
AUTO = "auto"
#: Run-config keys whose ``[tool.flwr.app.config]`` default is :data:`AUTO`: every key a regime may set.
AUTO_KEYS: tuple[str, ...] = ("num-clients", "num-rounds", "local-epochs", "batch-size", "lr", "hidden", "clip",
                               "mpddp-server-lr", "server-optimizer", "graph", "model-ema", "input-centering")
#: The federation every method runs on by default, by dataset size (``num-clients = "auto"``): about 600 training
#: records per client on MNIST-size data, 10 clients on the small datasets; one value for every method, so a
#: comparison is always on the same federation.
FEDERATION: MappingProxyType = MappingProxyType({"small": MappingProxyType({"num-clients": 10}),
                                                 "large": MappingProxyType({"num-clients": 100})})
#: Privacy units: ``record`` (one training example) or ``client`` (all of a client's data, DP-FedAvg).
PRIVACY_UNITS: tuple[str, ...] = ("record", "client")
#: Datasets of tens of thousands of records (``"large"`` regimes); the others are ``"small"``.
LARGE_DATASETS: tuple[str, ...] = ("mnist", "fashion-mnist")
#: Built-in datasets of feature vectors, not images: no ``model = "cnn"``, no ``input-centering``.
TABULAR_DATASETS: tuple[str, ...] = ("breast-cancer",)
#: ``batch-size`` of a full-batch regime: larger than any client's partition, so one step sees all its records.
FULL_BATCH = 1_000_000
#: The ledger account (``PrivacyLedger.extra``) of the uploads' view with no colluding peer
#: (:attr:`Guarantee.uplink_no_colluder`); its figure is ``epsilon_uplink_no_colluder``.
NO_COLLUDER = "uplink_no_colluder"


@dataclass(frozen=True)
class Guarantee:
    """What a method's epsilon protects: the unit, and the adversary assumed in each direction.

    ``uplink`` is the view of the uploads (the server, or an eavesdropper on the links); ``downlink``
    the published global models.  ``None`` = no guarantee in that direction (epsilon null, never a number).
    ``uplink_no_colluder``: where ``uplink`` assumes colluding peers, the adversary of the uploads' second figure
    with none of them (its ledger account :data:`NO_COLLUDER`, reported as ``epsilon_uplink_no_colluder``).
    """

    unit: str  # "record" (one training example) | "client" (all of a client's data) | "none"
    uplink: str | None
    downlink: str | None
    uplink_no_colluder: str | None = None

    def as_dict(self) -> dict[str, str | None]:
        """For metrics.jsonl and summary.json."""
        return {"unit": self.unit, "uplink_adversary": self.uplink, "downlink_adversary": self.downlink,
                "uplink_no_colluder_adversary": self.uplink_no_colluder}


def _frozen(mapping: dict | MappingProxyType | None) -> MappingProxyType:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class MethodSpec:
    """One method: where its server and client code live, its options, regime and guarantee.

    ``strategy``, ``train``, the ``queries`` handlers and ``audit`` are objects or ``"module:attribute"`` strings
    (imported on first use, so a process loads only the method it runs); :meth:`load` resolves either.

    Attributes:
        name: the run-config ``method`` value.
        strategy: the server side, a :class:`strategies.base.CancelStrategy` subclass.
        train: the client's train handler ``fn(msg, env) -> Message``.
        queries: extra message phases, ``action -> handler`` (phase ``query.<action>``).
        family: baseline | pairwise | mpddp | ladp | ddpsa (the methods that share code and benchmarks).
        paper: the paper it implements ("" for the baselines).
        options: the classes of its own run-config keys (:class:`protocols.options.MethodOptions`).
        regime: run-config values it trains with, ``{"small": {...}, "large": {...}}`` by dataset size, applied
            to keys left ``"auto"`` (``"large"`` entries override ``"small"`` ones on :data:`LARGE_DATASETS`).
        fixed: run-config keys it does not read, with the value its training amounts to (one full-batch gradient
            per round: ``local-epochs`` 1, ``batch-size`` :data:`FULL_BATCH`): the regime records them for keys left
            ``"auto"``, and a run that sets another value is warned at start that the method ignores it
            (:func:`protocols.methods.ignored_settings`).
        privacy: what its epsilon protects.
        units: privacy units it implements (run-config ``privacy-unit``); empty = no DP.
        min_per_round: fewest clients a round can aggregate (2 where protection works between the clients).
        server_step_lr: where its server steps with the round's released gradient (FedSGD), the run-config key of
            that step's learning rate (run-config ``server-optimizer`` applies to such methods only); ``None`` = the
            server averages models.
        sparse_graph: ``graph = "auto"`` is the sparse n-out graph from :data:`protocols.methods.SPARSE_FROM`
            clients per round on (per-client pair-noise cost O(neighbours)); ``False`` = the complete graph.
        floor_exempt: dataset size classes (``"small"``, ``"large"``) on which ``cancelfl-bench defaults`` does not
            hold it to the accuracy floor (:data:`benchmarks.defaults.FLOOR`).
        local_services: run-config -> how many intermediate servers ``cancelfl`` must start for a run (DDP-SA's).
        size_check: ``fn(cfg, sizes)`` raising :class:`protocols.options.ConfigError` for settings no round can run
            with the clients' record counts (``sizes``); called at start where the data is local (every engine's
            :func:`protocols.start_checks.start_checks`); ``None`` = none.
        start_notes: ``fn(cfg) -> list[str]``, sentences every engine warns at start (settings of the method that
            weaken or void what its epsilon says, named with their keys); ``None`` = none.
        audit: its privacy-audit adapter (a :class:`server.audit_adapter.AuditAdapter` subclass or instance, usually
            ``"server.audits.<method>:<Adapter>"``): which release it drives, its canaries and planted faults;
            ``None`` = ``cancelfl audit`` refuses it as not auditable.
        recovery_charge: what a dropout recovery strips from one of its rounds, priced on the client before it
            answers (``fn(env, spec, kept, request) -> (uplink, downlink)`` events composed on top of the round's
            charge; :mod:`client.recovery_ledger`); ``None`` = its recovery reveals nothing its ledger has not charged.
        round_time_goal: its round's wall time at most this multiple of the reference arm's in the same run,
            in-process and under Flower's simulation (``cancelfl-bench roundtime``); ``None`` = no goal.
        deployment_round_time_goal: the same across processes (``--engine deployment`` or ``compose``).
        dropout_plan: the method's own run-config key for the share of a round's participants its noise plans to
            lose, where it is not ``dropout-rate`` (benchmarks that drop clients set it to their rate); None = none.
        reference: the arm the benchmarks measure the others against (time and bytes ratios, accuracy gaps, the
            warm-up run); exactly one registered method sets it (:func:`protocols.methods.reference_method`).
    """

    name: str
    strategy: str | type
    train: str | Callable
    queries: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    family: str = "baseline"
    paper: str = ""
    options: tuple[type[MethodOptions], ...] = ()
    regime: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    fixed: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    privacy: Guarantee = Guarantee("none", None, None)
    units: tuple[str, ...] = ("record",)
    min_per_round: int = 1
    server_step_lr: str | None = None
    sparse_graph: bool = False
    floor_exempt: tuple[str, ...] = ()
    local_services: Callable[[Any], int] | None = None
    size_check: str | Callable | None = None
    start_notes: str | Callable | None = None
    audit: str | Any | None = None
    recovery_charge: str | Callable | None = None
    round_time_goal: float | None = None
    deployment_round_time_goal: float | None = None
    dropout_plan: str | None = None
    reference: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "queries", _frozen(self.queries))
        object.__setattr__(self, "regime", MappingProxyType({k: _frozen(v) for k, v in self.regime.items()}))
        object.__setattr__(self, "fixed", _frozen(self.fixed))
        object.__setattr__(self, "options", tuple(self.options))
        object.__setattr__(self, "floor_exempt", tuple(self.floor_exempt))

    def guarantee(self, unit: str) -> Guarantee:
        """What ``epsilon`` protects when the run asks for privacy unit ``unit`` (ValueError if not implemented)."""
        if not self.units:
            return self.privacy
        if unit not in self.units:
            own = " or ".join(f'"{u}"' for u in self.units)
            raise ValueError(f"method {self.name!r} protects a {' or a '.join(self.units)}, not a {unit!r}: set "
                             f"run-config 'privacy-unit' = {own} or choose a method that protects a {unit!r}")
        return dataclasses.replace(self.privacy, unit=unit)

    @staticmethod
    def load(target: str | Any) -> Any:
        """``target`` itself, or the attribute a ``"module:attribute"`` string names."""
        if not isinstance(target, str):
            return target
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)
