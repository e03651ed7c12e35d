"""The one registry of methods: every other list of method names reads from here.

A :class:`MethodSpec` names, as ``"module:attribute"`` strings (imported lazily, so a process
loads only the method it runs), the server-side strategy class and the client-side train
handler and extra message phases (``query.<action>`` handlers) of a method.  The run-config
validation (:mod:`protocols.config`), the strategy factory (``strategies.registry``), the
ClientApp dispatch (``client.methods``), the benchmarks and the tests all iterate over
:data:`METHODS`; ``tests/test_layout.py`` checks that every entry resolves.

The strings point *up* the package order (server -> strategies -> client -> protocols), which is
why they are strings: this module imports nothing of the project.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class MethodSpec:
    """Where a method's server and client code live, and what kind of method it is."""

    name: str
    strategy: str  # "strategies.<module>:<StrategyClass>"
    train: str  # "client.methods.<module>:<handler>"
    queries: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # action -> handler
    family: str = "baseline"  # baseline | pairwise | mpddp | ladp | ddpsa
    paper: str = ""


_KEYS = "client.pairwise_phase:handle_keys"


def _spec(name: str, strategy: str, train: str, *, queries: dict[str, str] | None = None, family: str = "baseline",
          paper: str = "") -> MethodSpec:
    return MethodSpec(name, strategy, train, MappingProxyType(dict(queries or {})), family, paper)


#: Every method, in the order the README and the benchmarks list them.
METHODS: MappingProxyType = MappingProxyType({s.name: s for s in (
    _spec("fedavg", "strategies.baselines:FedAvgStrategy", "client.methods.baselines:train_fedavg"),
    _spec("ldp", "strategies.baselines:LocalDPStrategy", "client.methods.baselines:train_ldp"),
    _spec("cdp", "strategies.baselines:CentralDPStrategy", "client.methods.baselines:train_cdp"),
    _spec("nadp", "strategies.nadp:NadpStrategy", "client.methods.nadp:train", queries={"keys": _KEYS},
          family="pairwise", paper="NADP-FL"),
    _spec("niss", "strategies.niss:NissStrategy", "client.methods.niss:train",
          queries={"keys": _KEYS, "shares": "client.methods.niss:handle_shares"}, family="pairwise", paper="NISS"),
    _spec("mpddp", "strategies.mpddp:MpddpStrategy", "client.methods.mpddp:train", queries={"keys": _KEYS},
          family="mpddp", paper="MP_Server + DDP_Client"),
    _spec("mpdp-naive", "strategies.mpddp:MpdpNaiveStrategy", "client.methods.mpddp:train", family="mpddp",
          paper="MP_Server + DDP_Client (ablation)"),
    _spec("mpcdp", "strategies.mpddp:MpcdpStrategy", "client.methods.mpddp:train", family="mpddp",
          paper="MP_Server + DDP_Client (ablation)"),
    _spec("ladp", "strategies.ladp:LadpStrategy", "client.methods.ladp:train", family="ladp", paper="LaDP-FL"),
    _spec("ddpsa", "strategies.ddpsa:DdpsaStrategy", "client.methods.ddpsa:train", family="ddpsa", paper="DDP-SA"),
)})

METHOD_NAMES: tuple[str, ...] = tuple(METHODS)


def method_spec(name: str) -> MethodSpec:
    """The spec of ``name`` (ValueError listing the known methods)."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHOD_NAMES)}") from None


def query_actions() -> set[str]:
    """Every extra phase name any method uses (registered once on the ClientApp)."""
    return {a for spec in METHODS.values() for a in spec.queries}
