"""The one registry of methods: every other list of method names reads from here.

A :class:`MethodSpec` names, as ``"module:attribute"`` strings (imported lazily, so a process
loads only the method it runs), the server-side strategy class and the client-side train
handler and extra message phases (``query.<action>`` handlers) of a method.  The run-config
validation (:mod:`protocols.config`), the strategy factory (``strategies.registry``), the
ClientApp dispatch (``client.methods``), the benchmarks and the tests all iterate over
:data:`METHODS`; ``tests/test_layout.py`` checks that every entry resolves.

The strings point *up* the package order (server -> strategies -> client -> protocols), which is
why they are strings: this module imports nothing of the project.

Each spec also holds the method's *regime* (:attr:`MethodSpec.regime`: the run-config values its
paper trains with, e.g. one full-batch clipped step per round for nadp) and its *privacy semantics*
(:attr:`MethodSpec.privacy`: the unit a guarantee protects and the adversary assumed in each
direction).  :class:`protocols.config.RunConfig` applies the regime to every key whose run-config
value is ``"auto"`` (the ``[tool.flwr.app.config]`` default of :data:`AUTO_KEYS`); a value the user
sets always wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

#: The run-config value that means "the method's regime decides" (:func:`regime`).
AUTO = "auto"
#: Run-config keys whose ``[tool.flwr.app.config]`` default is :data:`AUTO`: every key a regime may set.
AUTO_KEYS: tuple[str, ...] = ("num-clients", "num-rounds", "local-epochs", "batch-size", "lr", "hidden", "clip",
                               "mpddp-server-lr", "server-optimizer", "graph", "model-ema", "input-centering")
#: The federation every method runs on by default, by dataset size (``num-clients = "auto"``): about 600
#: training records per client (McMahan et al.'s MNIST setting), 10 clients on the small datasets.  One value
#: for every method, so a comparison is always on the same federation.  Why not 10 everywhere: NADP-FL's
#: advantage over local DP is the sqrt(K) of noise cancellation (its Table 1: +4 points at K = 10, +40 at
#: K = 100 on MNIST, epsilon 1); 10 clients would hide what the product is for.
FEDERATION: MappingProxyType = MappingProxyType({"small": MappingProxyType({"num-clients": 10}),
                                                 "large": MappingProxyType({"num-clients": 100})})
#: Privacy units: ``record`` (one training example, the unit of every paper's neighbouring datasets) or
#: ``client`` (all of a client's data, DP-FedAvg).  Run-config ``privacy-unit``; the default is ``record``.
PRIVACY_UNITS: tuple[str, ...] = ("record", "client")
#: Methods whose ``graph`` = "auto" becomes the sparse n-out graph from :data:`SPARSE_FROM` clients per round on
#: (their per-client pair-noise cost is O(neighbours); measured: nadp on the complete graph at 100 clients spends
#: 2x its local training generating 99 pair streams).  mpddp keeps the complete graph: Theorem 11 needs n ~ 0.8 K.
SPARSE_BY_DEFAULT: tuple[str, ...] = ("nadp", "niss")
SPARSE_FROM = 32
#: Method families whose server steps with the round's released gradient (FedSGD), and the run-config key of
#: that step's learning rate: run-config ``server-optimizer`` (:mod:`protocols.server_optimizers`) applies to them
#: only.  A learning rate the user sets with ``server-optimizer`` left "auto" keeps its paper meaning (plain SGD).
SERVER_STEP_FAMILIES: MappingProxyType = MappingProxyType({"mpddp": "mpddp-server-lr", "ddpsa": "lr"})


def auto_graph(method: str, clients_per_round: int) -> str:
    """The neighbour graph of ``graph = "auto"``: n-out for nadp/niss from 32 clients per round, else complete."""
    return "n-out" if method in SPARSE_BY_DEFAULT and clients_per_round >= SPARSE_FROM else "complete"
#: Datasets of tens of thousands of records (``"large"`` regimes); the others are ``"small"``.
LARGE_DATASETS: tuple[str, ...] = ("mnist", "fashion-mnist")
#: ``batch-size`` of a full-batch regime: larger than any client's partition, so one step sees all its records.
FULL_BATCH = 1_000_000


@dataclass(frozen=True)
class Guarantee:
    """What a method's epsilon protects: the unit, and the adversary assumed in each direction.

    ``uplink`` is the view of the uploads (the server, or an eavesdropper on the links); ``downlink``
    the published global models (anyone who gets them).  ``None`` = no guarantee in that direction
    (the run reports epsilon null there, never a number).
    """

    unit: str  # "record" (one training example) | "client" (all of a client's data) | "none"
    uplink: str | None
    downlink: str | None

    def as_dict(self) -> dict[str, str | None]:
        """For metrics.jsonl and summary.json."""
        return {"unit": self.unit, "uplink_adversary": self.uplink, "downlink_adversary": self.downlink}


@dataclass(frozen=True)
class MethodSpec:
    """Where a method's server and client code live, what kind of method it is, its regime and guarantee."""

    name: str
    strategy: str  # "strategies.<module>:<StrategyClass>"
    train: str  # "client.methods.<module>:<handler>"
    queries: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # action -> handler
    family: str = "baseline"  # baseline | pairwise | mpddp | ladp | ddpsa
    paper: str = ""
    #: Run-config values of the method's regime: ``{"small": {...}, "large": {...}}`` by dataset size
    #: (``"large"`` entries override ``"small"`` ones on :data:`LARGE_DATASETS`).
    regime: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    privacy: Guarantee = Guarantee("none", None, None)
    #: Privacy units the method implements (run-config ``privacy-unit``); empty = no DP (fedavg).
    units: tuple[str, ...] = ("record",)

    def guarantee(self, unit: str) -> Guarantee:
        """What ``epsilon`` protects when the run asks for privacy unit ``unit`` (``none`` for fedavg)."""
        if not self.units:
            return self.privacy
        if unit not in self.units:
            raise ValueError(f"method {self.name!r} protects a {' or a '.join(self.units)}, not a {unit!r} "
                             f"(run-config 'privacy-unit')")
        return Guarantee(unit, self.privacy.uplink, self.privacy.downlink)


_KEYS = "client.pairwise_phase:handle_keys"
_RECOVER = "client.recovery:handle_recover"  # dropout recovery of the pairwise noise (strategies.recovery)


def _spec(name: str, strategy: str, train: str, *, queries: dict[str, str] | None = None, family: str = "baseline",
          paper: str = "", regime: dict[str, dict[str, Any]] | None = None,
          privacy: Guarantee = Guarantee("none", None, None), units: tuple[str, ...] = ("record",)) -> MethodSpec:
    regime = {size: MappingProxyType(dict(v)) for size, v in (regime or {}).items()}
    return MethodSpec(name, strategy, train, MappingProxyType(dict(queries or {})), family, paper,
                      MappingProxyType(regime), privacy, units)


# ------------------------------------------------------------------ adversaries (one wording each)
_SERVER = "the server and eavesdroppers (honest-but-curious server)"
#: nadp's epsilon_uplink is the joint view of all uploads without colluding clients: with one of 3 peers colluding
#: (within nadp-tau 0.5) the exact Gaussian view of a one-round run at epsilon 4 is epsilon 4.65, not the 3.95
#: reported (``cancelfl audit --colluders``); lambda (Eq. 8) only keeps each upload's marginal noise against them.
_SERVER_NO_COLLUSION = ("the server and eavesdroppers, no colluding client (nadp-tau's lambda protects each upload "
                        "seen alone against a tau share of colluding peers, not the joint view)")
_SERVER_NISS = "the server and eavesdroppers, colluding with at most a niss-rho share of a client's neighbours"
_SERVER_SECAGG = "the server and all but one intermediate server (DDP-SA secure aggregation)"
_MODEL = "anyone who gets the published global models"
_MODEL_TRUSTED = "anyone who gets the published global models (the server is trusted with the uploads)"

# ------------------------------------------------------------------ regimes (measured: README "Default runs")
#: ``model-ema`` of the record-step regimes: publish an average of the global models (post-processing, no privacy
#: cost).  Their DP noise adds up in the last model like a random walk while the signal saturates early: on digits
#: at epsilon 1 it is worth 1-5 points (nadp 0.79 -> 0.83).  Not for the MP family (a slowly rising curve: the
#: average lags, mpcdp on MNIST 0.61 -> 0.48) nor ddpsa (two rounds: the average would be mostly round 1's).
MODEL_EMA = 0.8
#: ``input-centering`` of the record-step regimes: each image minus its own mean pixel (a per-record transform, no
#: privacy cost; images only).  A few noisy full-batch steps of a linear model are slowed by the inputs' common
#: brightness direction; without it nadp on digits was 0.79-0.81 over 3 runs, with it 0.82-0.87 (fedavg's own
#: regime does not need it: 0.914 without, 0.906 with).
#: NADP-FL's regime, the record-level step every full-batch method shares: one full-batch step of per-example-clipped
#: gradients per round, so a record moves a client's model by at most Lemma 1's 2 C lr / n_k.  nadp, niss and cdp
#: leave the central noise (z 2 C lr / N) in the model and train with it as is; 60 rounds on MNIST-size data reach
#: 0.90 instead of 0.89 at 30.  One regime per method: a privacy-unit="client" run gets it too unless the user sets
#: the keys (client-level DP cannot train at epsilon 1 with 10-100 clients in any regime we measured).
_RECORD_STEP = {"small": {"hidden": "", "local-epochs": 1, "batch-size": FULL_BATCH, "lr": 4.0, "clip": 1.0,
                          "num-rounds": 30, "model-ema": MODEL_EMA, "input-centering": True},
                "large": {"num-rounds": 60}}
#: ldp at record level: the same step, fewer rounds.  Every client's noise stays in the mean (std z sqrt(K) 2 C lr / N)
#: and z grows like sqrt(T) under exact RDP composition, so the run's noise grows like T while later rounds' clipped
#: gradients shrink.  Measured with a numpy replica of this training (6-8 repeats, digits): last model 0.39 at T=5,
#: 0.41 at T=10, 0.34 at T=20, 0.31 at T=30; model-ema 0.8: 0.35, 0.41, 0.41, 0.39.  Clip 0.1-2 (lr scaled) changes
#: nothing (every per-example gradient is clipped); lr 1 or 16 is worse than 4.
_LDP = {"small": {**_RECORD_STEP["small"], "num-rounds": 10}, "large": {"num-rounds": 20}}
#: FedAvg's regime is the run-config defaults; on MNIST-size data fewer, shorter rounds keep a run to minutes.
_FEDAVG = {"large": {"num-rounds": 10, "local-epochs": 1}}
#: MP_Server + DDP_Client at record level: FedSGD on the squared loss (local-epochs/batch-size/lr unused), each
#: example's perturbed gradient clipped to 1 on W-hat.  The server steps with Adam (post-processing of the recovered
#: gradient, :mod:`protocols.server_optimizers`): the squared-loss MLP is badly conditioned for the paper's plain xi
#: step, whose right size differed by dataset (3 on digits, 1.5 on MNIST, and 3 overshot on breast-cancer: 0.43-0.57).
#: Measured (mpcdp, epsilon 1, 30 rounds): breast-cancer xi 3: 0.57, Adam 0.01: 0.95 (mpddp 0.89); MNIST xi 1.5: 0.57,
#: Adam 0.003: 0.55-0.66, 0.01: 0.44; digits noise-free xi 3: 0.39, Adam 0.01: 0.72.  MNIST-size data trains on for
#: 60 rounds (mpcdp 0.71 at Adam 0.002 and 0.003).
_MP = {"small": {"hidden": "16", "num-rounds": 30, "clip": 1.0, "server-optimizer": "adam", "mpddp-server-lr": 0.01},
       "large": {"mpddp-server-lr": 0.003, "num-rounds": 60}}
#: LaDP-FL, record level: one full-batch step of per-example-clipped gradients per round (sensitivity 2 clip lr / N_i,
#: replacing Theorem 2's 2 lr E clip).  Local DP (no cancellation): each round's noise is ~sqrt(K) times nadp's, and
#: under exact Gaussian composition the run's signal-to-noise hardly depends on T, so ~20 rounds (digits 0.40-0.48).
_LADP = {"small": {**_RECORD_STEP["small"], "lr": 2.0, "num-rounds": 20}}
#: DDP-SA: FedSGD with per-sample L1 clipping and per-client Laplace noise (2 clip / eps_t, pure eps, basic
#: composition).  Signal-to-noise per coordinate ~ N_i eps_t / d (L1 geometry), so the whole budget goes into two
#: rounds with a large server step (round 1 from the initial model is a class-mean classifier): the run's
#: signal-to-noise goes as eps / sqrt(T) under basic composition, and as eps / sqrt(2 ln(1/delta)) (~5x below one
#: round) under advanced composition at any T.  Measured at epsilon 1: digits 0.10-0.23 (chance 0.1).
_DDPSA = {"small": {"hidden": "", "lr": 100.0, "clip": 1.0, "num-rounds": 2}}


#: Every method, in the order the README and the benchmarks list them.
METHODS: MappingProxyType = MappingProxyType({s.name: s for s in (
    _spec("fedavg", "strategies.baselines:FedAvgStrategy", "client.methods.baselines:train_fedavg", regime=_FEDAVG,
          units=()),
    _spec("ldp", "strategies.baselines:LocalDPStrategy", "client.methods.baselines:train_ldp",
          regime=_LDP, privacy=Guarantee("record", _SERVER, _MODEL), units=PRIVACY_UNITS),
    _spec("cdp", "strategies.baselines:CentralDPStrategy", "client.methods.baselines:train_cdp",
          regime=_RECORD_STEP, privacy=Guarantee("record", None, _MODEL_TRUSTED), units=PRIVACY_UNITS),
    _spec("nadp", "strategies.nadp:NadpStrategy", "client.methods.nadp:train",
          queries={"keys": _KEYS, "recover": _RECOVER},
          family="pairwise", paper="NADP-FL", regime=_RECORD_STEP, privacy=Guarantee("record", _SERVER_NO_COLLUSION, _MODEL)),
    _spec("niss", "strategies.niss:NissStrategy", "client.methods.niss:train",
          queries={"keys": _KEYS, "shares": "client.methods.niss:handle_shares", "recover": _RECOVER},
          family="pairwise", paper="NISS",
          regime=_RECORD_STEP, privacy=Guarantee("record", _SERVER_NISS, _MODEL), units=PRIVACY_UNITS),
    # The MP family's uplink epsilon is nominal only (Psi/Phi go up un-noised; the server knows R): no guarantee.
    _spec("mpddp", "strategies.mpddp:MpddpStrategy", "client.methods.mpddp:train",
          queries={"keys": _KEYS, "recover": _RECOVER}, family="mpddp", paper="MP_Server + DDP_Client",
          regime=_MP, privacy=Guarantee("record", None, _MODEL)),
    _spec("mpdp-naive", "strategies.mpddp:MpdpNaiveStrategy", "client.methods.mpddp:train", family="mpddp",
          paper="MP_Server + DDP_Client (ablation)", regime=_MP, privacy=Guarantee("record", None, _MODEL)),
    _spec("mpcdp", "strategies.mpddp:MpcdpStrategy", "client.methods.mpddp:train", family="mpddp",
          paper="MP_Server + DDP_Client (ablation)", regime=_MP, privacy=Guarantee("record", None, _MODEL_TRUSTED)),
    _spec("ladp", "strategies.ladp:LadpStrategy", "client.methods.ladp:train", family="ladp", paper="LaDP-FL",
          regime=_LADP, privacy=Guarantee("record", _SERVER, _MODEL)),
    _spec("ddpsa", "strategies.ddpsa:DdpsaStrategy", "client.methods.ddpsa:train", family="ddpsa", paper="DDP-SA",
          regime=_DDPSA, privacy=Guarantee("record", _SERVER_SECAGG, _MODEL)),
)})

METHOD_NAMES: tuple[str, ...] = tuple(METHODS)

#: Named variants of a method: name -> (registered method, the run-config keys it sets).  Run by the
#: benchmarks and ``cancelfl compare`` next to the methods (not registered: a variant is a method's setting).
VARIANTS: MappingProxyType = MappingProxyType({
    # The NADP paper's LDP-FL comparator (Lemma 3): NADP's training and record-level sensitivity, independent
    # client noise, no cancellation.
    "nadp-record-ldp": ("nadp", MappingProxyType({"nadp-variant": "record-ldp"})),
    # nadp on a sparser pairing graph (~8 neighbours instead of ~16): half the pairwise streams per client.
    "nadp-4out": ("nadp", MappingProxyType({"graph": "n-out", "n-out": 4})),
})


def method_or_variant(name: str) -> tuple[str, dict]:
    """(registered method, run-config the variant sets) of a method or variant name (ValueError if neither)."""
    if name in VARIANTS:
        method, extra = VARIANTS[name]
        return method, dict(extra)
    if name in METHODS:
        return name, {}
    raise ValueError(f"unknown method {name!r}; known: {', '.join((*METHOD_NAMES, *VARIANTS))}")


def method_spec(name: str) -> MethodSpec:
    """The spec of ``name`` (ValueError listing the known methods)."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHOD_NAMES)}") from None


def query_actions() -> set[str]:
    """Every extra phase name any method uses (registered once on the ClientApp)."""
    return {a for spec in METHODS.values() for a in spec.queries}


def dataset_size_class(dataset: str) -> str:
    """``"large"`` for :data:`LARGE_DATASETS` and Hugging Face datasets (``hub:...``), else ``"small"``."""
    return "large" if dataset in LARGE_DATASETS or dataset.startswith("hub:") else "small"


def regime(method: str, dataset: str) -> dict[str, Any]:
    """The run-config values ``method`` trains with on ``dataset``: :data:`FEDERATION`, then the method's regime."""
    spec = method_spec(method)
    out = dict(FEDERATION[dataset_size_class(dataset)])
    out.update(spec.regime.get("small", {}))
    if dataset_size_class(dataset) == "large":
        out.update(spec.regime.get("large", {}))
    return out
