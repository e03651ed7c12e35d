"""Validated run configuration shared by the ServerApp and the ClientApp.

Flower hands both apps the run config as a flat ``{kebab-case-key: value}``
mapping (defaults from ``[tool.flwr.app.config]`` in ``pyproject.toml``,
overridden by ``--run-config``).  :class:`RunConfig` turns it into typed
fields and refuses bad values at start with a message that names the key and
the allowed values, so a typo never silently trains the wrong thing.

This module is Flower-free on purpose: the launcher, benchmarks and tests build
configs without a running Flower app.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from protocols.methods import (
    AUTO,
    AUTO_KEYS,
    METHOD_NAMES,
    METHODS,
    PRIVACY_UNITS,
    SERVER_STEP_FAMILIES,
    SPARSE_BY_DEFAULT,
    auto_graph,
    method_spec,
    regime,
)
from protocols.server_optimizers import SERVER_OPTIMIZERS

DATASETS = ("digits", "breast-cancer", "mnist", "fashion-mnist")
#: Keys of earlier releases that no longer mean anything: refused (strict mode) with the reason.
REMOVED_KEYS = {"niss-unit-variance": "NISS sends one noise share per neighbour whatever the noise variance"}
MODELS = ("mlp", "cnn")
DEVICES = ("cpu", "cuda", "auto")


def is_import_path(value: str) -> bool:
    """``"package.module:attribute"`` -- a user model or dataset loaded by import path (see README)."""
    module, sep, attr = value.partition(":")
    return bool(sep) and all(p.isidentifier() for p in module.split(".")) and attr.isidentifier()
PARTITIONINGS = ("iid", "dirichlet", "size-skew")
GRAPHS = ("complete", "n-out")
SHARE_ENCODINGS = ("seed", "vector")
COMPOSITIONS = ("basic", "advanced")
ALLOCATIONS = ("uniform", "exponential")
#: ``ddpsa-noise``: one central Laplace split over the participants (:mod:`protocols.ddpsa`), or the paper's per client.
DDPSA_NOISE_MODES = ("distributed", "local")
NADP_VARIANTS = ("nadp", "record-ldp")
SIDE_DTYPES = ("float64", "float32")


class ConfigError(ValueError):
    """A run-config value is missing, of the wrong type or out of range."""


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"run-config '{key}' = {value!r} is not allowed; choose one of: {', '.join(allowed)}")


def _positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not ok or not math.isfinite(value):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"run-config '{key}' = {value!r} must be a finite number {bound}")


@dataclass(frozen=True)
class RunConfig:
    """Every run-config key, typed.  Field ``foo_bar`` is run-config key ``foo-bar``."""

    # What to run
    method: str = "fedavg"  # the method to run (registry: protocols/methods.py)
    dataset: str = "digits"  # digits, breast-cancer, mnist, fashion-mnist, hub:<name>, or "package.module:load"
    data_dir: str = ""  # folder with <dataset>/ IDX files; "" = search $CANCELFL_DATA_DIR, ./data, ../shared/data
    model: str = "mlp"  # mlp, cnn (image datasets), or "package.module:Net" (your nn.Module class or factory)
    hidden: str = "64"  # MLP hidden widths, comma-separated ("" = linear model)
    train_subset: int = 0  # use only the first N training samples (0 = all)
    test_subset: int = 0  # evaluate on the first N test samples (0 = all)
    # Federation
    num_clients: int = 10  # nodes the server waits for (= num-partitions)
    sample_rate: float = 1.0  # fraction q of clients sampled per round
    num_rounds: int = 20  # federated rounds; the noise is calibrated for exactly this many releases
    partitioning: str = "iid"  # how the training split is divided among clients (flwr-datasets partitioners)
    dirichlet_alpha: float = 0.5  # concentration of the dirichlet label split (smaller = more skew)
    seed: int = 42  # partitioning, sampling, initial model, batch order (never DP noise: OS CSPRNG)
    round_timeout: float = 600.0  # seconds a phase waits for replies
    min_clients: int = 2  # fewest connected nodes a round runs with (waits node-timeout s, then fails)
    node_timeout: float = 60.0  # seconds a round waits for nodes to connect (the first round: for all num-clients)
    max_strikes: int = 3  # rounds in a row with an excluded reply after which a node is left out (0 = never)
    model_ema: float = 0.0  # published model = EMA of the global models with this decay (0 = the last one)
    divergence_factor: float = 100.0  # stop the run when test loss > factor x initial loss or non-finite (0 = off)
    # Local training
    local_epochs: int = 2  # local passes over the client data per round
    batch_size: int = 32  # local batch size (larger than a partition = one full-batch step)
    lr: float = 0.1  # local learning rate (ddpsa: its server step)
    input_centering: bool = False  # each image minus its own mean (a per-record transform: no privacy cost)
    device: str = "cpu"  # where clients train: cpu, cuda, auto (cuda if available); noise stays on the CPU CSPRNG
    # Privacy
    epsilon: float = 1.0  # privacy target over the whole run, every method
    delta: float = 1e-5  # delta of the (epsilon, delta) target
    privacy_unit: str = "record"  # what epsilon protects: "record" (one example) or "client" (ldp, cdp only)
    clip: float = 1.0  # L2 bound of a client's model update (or gradient, per method)
    # Method-specific
    graph: str = "complete"  # pairwise-noise neighbour graph
    n_out: int = 4  # neighbours each client picks in an n-out graph
    key_rotation: int = 0  # rounds per X25519 key pair (0 = one pair per node for the run, 1 = fresh every round)
    cancellation_check: bool = False  # clients report a random projection of their pairwise mask (diagnostic)
    fault_drop_rate: float = 0.0  # TESTING AID: in-process grid withholds this fraction of train replies
    self_mask: bool = True  # nadp, niss, mpddp: double masking (a Shamir-shared self-mask on every pairwise upload)
    mask_dropout_rate: float = 0.1  # assumed dropout rate, in [0, 0.5): only feeds the logged P[< t surviving neighbours]
    mask_corruption_rate: float = 0.1  # assumed colluding share of a neighbourhood, in [0, 0.5): sets the self-mask threshold t
    nadp_lambda: float = 0.0  # compensation factor; 0 = derive from nadp-tau
    nadp_tau: float = 0.5  # tolerated collusion rate for lambda (Eq. 8)
    nadp_variant: str = "nadp"  # "record-ldp" = the paper's LDP-FL comparator (same training, no cancellation)
    niss_tau: float = -1.0  # distortion std; < 0 = max(Theorem 3 for niss-rho, 1/sqrt(clients per round))
    niss_rho: float = 0.5  # tolerated colluding fraction (Theorem 3)
    niss_share_encoding: str = "seed"  # a share travels as an encrypted 32-byte seed, or as the vector itself
    mpddp_server_lr: float = 1.0  # xi: server learning rate
    server_optimizer: str = "sgd"  # the FedSGD methods' server step (mpddp family, ddpsa): sgd | adam
    mpddp_side_dtype: str = "float32"  # dtype of Psi/Phi (compute + wire); float64 = exact recovery, 2x the cost
    ladp_norm_threshold: float = 0.0  # R: layers with weight norm >= R get noise
    ladp_kl_cap: float = 1e-6  # B: cap of the KL privacy estimate (KL of whole-layer softmaxes is ~1e-7..1e-4)
    ladp_max_boost: float = 3.0  # the most LaDP's KL-adaptive noise multiplies a layer's floor noise (P >= B / this)
    ddpsa_servers: str = ""  # host:port,... of intermediate servers ("" = start locally)
    ddpsa_ca: str = ""  # PEM CA certificate of the intermediate servers' TLS certificates
    ddpsa_server_key: str = ""  # the parameter server's Ed25519 identity key (PEM): reads partial sums
    ddpsa_num_servers: int = 3  # m: secret shares = intermediate servers
    ddpsa_frac_bits: int = 24  # fixed-point fractional bits of the Z_2^64 encoding
    ddpsa_composition: str = "basic"  # how DDP-SA splits epsilon over rounds (Theorem 2)
    ddpsa_allocation: str = "uniform"  # per-round budget schedule (Eq. 12)
    ddpsa_decay: float = 0.9  # decay of the exponential allocation
    ddpsa_noise: str = "distributed"  # distributed (one central Laplace split over participants) | local (paper)
    ddpsa_collude_frac: float = 0.1  # distributed noise: fraction of participants that may collude or not push
    ddpsa_threshold: int = 0  # servers needed to reconstruct (Shamir); = num-servers: additive; 0 = auto (m - 1, >= 2)
    # Output
    out_dir: str = ""  # "" = a fresh folder runs/<UTC time>-<method> (runs/latest points to the newest)
    resume: bool = False  # continue the run whose checkpoint is in out-dir (`cancelfl run/deploy --resume OUT`)
    #: Not a run-config key: the (key, value) pairs the method's regime set (keys the user left "auto").
    regime_applied: tuple[tuple[str, Any], ...] = dataclasses.field(default=(), compare=False)

    # ------------------------------------------------------------------ parsing
    @staticmethod
    def key_of(field_name: str) -> str:
        """Run-config key for a field name."""
        return field_name.replace("_", "-")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], *, strict: bool = True) -> RunConfig:
        """Build and validate from a Flower run config (kebab-case keys).

        Unknown keys raise in ``strict`` mode (catches typos); otherwise they are ignored (a
        ClientApp of an older release may receive keys a newer ServerApp added).

        Keys of :data:`protocols.methods.AUTO_KEYS` that are ``"auto"`` (their ``[tool.flwr.app.config]``
        default) or absent take the method's regime for the dataset (:func:`protocols.methods.regime`),
        else the field default; what the regime set is kept in :attr:`regime_applied`.  A value the
        user sets is never replaced.
        """
        known = {cls.key_of(f.name): f for f in fields(cls) if f.name != "regime_applied"}
        values: dict[str, Any] = {}
        unset = set(AUTO_KEYS)
        for key, value in raw.items():
            f = known.get(key)
            if f is None:
                if strict and key in REMOVED_KEYS:
                    raise ConfigError(f"run-config '{key}' was removed: {REMOVED_KEYS[key]}")
                if strict:
                    raise ConfigError(
                        f"unknown run-config key '{key}'; known keys: {', '.join(sorted(known))}"
                    )
                continue
            if isinstance(value, str) and value.strip().lower() == AUTO and key != "device":  # device: a literal
                if key not in AUTO_KEYS:
                    raise ConfigError(f"run-config '{key}' cannot be \"{AUTO}\"; only {', '.join(AUTO_KEYS)} can")
                continue
            unset.discard(key)
            values[f.name] = _coerce(key, value, type(getattr(cls(), f.name)))
        method, dataset = values.get("method", cls.method), values.get("dataset", cls.dataset)
        applied: dict[str, Any] = {}
        if method in METHOD_NAMES:  # an unknown method is refused by validate() below
            for key, value in regime(method, dataset).items():
                if key in unset:
                    f = known[key]
                    values[f.name] = applied[key] = _coerce(key, value, type(getattr(cls(), f.name)))
        lr_key = SERVER_STEP_FAMILIES.get(method_spec(method).family) if method in METHOD_NAMES else None
        if "server-optimizer" in applied and lr_key not in unset:  # the user's xi / lr is the paper's SGD step
            values["server_optimizer"] = applied["server-optimizer"] = "sgd"
        if "graph" in unset and "graph" not in applied:
            k = clients_sampled(values.get("sample_rate", cls.sample_rate), values.get("num_clients", cls.num_clients))
            values["graph"] = auto_graph(method, k)
            if method in SPARSE_BY_DEFAULT:  # a decision for these methods: printed with the regime
                applied["graph"] = values["graph"]
        cfg = cls(**values, regime_applied=tuple(sorted(applied.items())))
        cfg.validate()
        return cfg

    def to_mapping(self) -> dict[str, Any]:
        """Inverse of :meth:`from_mapping` (for summaries and ``--run-config``): every key, resolved."""
        return {self.key_of(f.name): getattr(self, f.name) for f in fields(self) if f.name != "regime_applied"}

    def replace(self, **changes: Any) -> RunConfig:
        """Copy with changed fields, validated."""
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the key and the allowed values."""
        _choice("method", self.method, METHOD_NAMES)
        if self.dataset not in DATASETS and not self.dataset.startswith("hub:") and not is_import_path(self.dataset):
            raise ConfigError(
                f"run-config 'dataset' = {self.dataset!r} is not allowed; choose one of: "
                f"{', '.join(DATASETS)}, hub:<name> (a Hugging Face dataset, needs network), or "
                "<package.module>:<function> (your own loader, see README)"
            )
        if not is_import_path(self.model):
            _choice("model", self.model, (*MODELS, "<package.module>:<name>"))
        _choice("device", self.device, DEVICES)
        _choice("partitioning", self.partitioning, PARTITIONINGS)
        _choice("graph", self.graph, GRAPHS)
        _choice("niss-share-encoding", self.niss_share_encoding, SHARE_ENCODINGS)
        _choice("ddpsa-composition", self.ddpsa_composition, COMPOSITIONS)
        _choice("ddpsa-allocation", self.ddpsa_allocation, ALLOCATIONS)
        _choice("ddpsa-noise", self.ddpsa_noise, DDPSA_NOISE_MODES)
        _choice("nadp-variant", self.nadp_variant, NADP_VARIANTS)
        _choice("mpddp-side-dtype", self.mpddp_side_dtype, SIDE_DTYPES)
        _choice("privacy-unit", self.privacy_unit, PRIVACY_UNITS)
        _choice("server-optimizer", self.server_optimizer, SERVER_OPTIMIZERS)
        if self.server_optimizer != "sgd" and method_spec(self.method).family not in SERVER_STEP_FAMILIES:
            stepping = ", ".join(m for m, spec in METHODS.items() if spec.family in SERVER_STEP_FAMILIES)
            raise ConfigError(f"run-config 'server-optimizer' = {self.server_optimizer!r} applies to the methods "
                              f"whose server steps with a released gradient ({stepping}); {self.method!r} averages "
                              "models")
        try:
            method_spec(self.method).guarantee(self.privacy_unit)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        for key in ("num-clients", "num-rounds", "local-epochs", "batch-size", "min-clients"):
            if getattr(self, key.replace("-", "_")) < 1:
                raise ConfigError(f"run-config '{key}' must be an integer >= 1")
        if self.seed < 0:
            raise ConfigError(f"run-config 'seed' = {self.seed} must be an integer >= 0")
        for key in ("train-subset", "test-subset"):
            if getattr(self, key.replace("-", "_")) < 0:
                raise ConfigError(f"run-config '{key}' must be an integer >= 0 (0 = all)")
        if not 0 < self.sample_rate <= 1:
            raise ConfigError(f"run-config 'sample-rate' = {self.sample_rate} must be in (0, 1]")
        need = method_spec(self.method).min_per_round
        if self.clients_per_round < need:
            fix = (f"set 'num-clients' >= {need}" if self.num_clients < need
                   else f"raise 'sample-rate' to at least {need / self.num_clients:.3g}")
            raise ConfigError(f"method {self.method!r} needs at least {need} clients per round (its protection works "
                              f"between the clients of a round): run-config 'num-clients' = {self.num_clients} x "
                              f"'sample-rate' = {self.sample_rate:g} gives {self.clients_per_round}; {fix}")
        if not 0 < self.delta < 1:
            raise ConfigError(f"run-config 'delta' = {self.delta} must be in (0, 1)")
        if self.max_strikes < 0:
            raise ConfigError("run-config 'max-strikes' must be an integer >= 0 (0 = never leave a node out)")
        _positive("divergence-factor", self.divergence_factor, allow_zero=True)
        if not (math.isfinite(self.model_ema) and 0 <= self.model_ema < 1):
            raise ConfigError(f"run-config 'model-ema' = {self.model_ema} must be in [0, 1) (0 = publish the last "
                              "global model)")
        for key in ("lr", "epsilon", "clip", "dirichlet-alpha", "round-timeout", "node-timeout", "mpddp-server-lr",
                    "ladp-kl-cap"):
            _positive(key, float(getattr(self, key.replace("-", "_"))))
        _positive("ladp-norm-threshold", self.ladp_norm_threshold, allow_zero=True)
        if not (math.isfinite(self.ladp_max_boost) and self.ladp_max_boost >= 1):
            raise ConfigError(f"run-config 'ladp-max-boost' = {self.ladp_max_boost} must be a number >= 1 (1 = every "
                              "selected layer gets the floor noise)")
        _positive("nadp-lambda", self.nadp_lambda, allow_zero=True)
        if not 0 <= self.nadp_tau < 1:
            raise ConfigError(f"run-config 'nadp-tau' = {self.nadp_tau} must be in [0, 1)")
        if not 0 <= self.niss_rho <= 1:
            raise ConfigError(f"run-config 'niss-rho' = {self.niss_rho} must be in [0, 1]")
        if not (math.isfinite(self.fault_drop_rate) and 0 <= self.fault_drop_rate < 1):
            raise ConfigError(f"run-config 'fault-drop-rate' = {self.fault_drop_rate} must be in [0, 1) "
                              "(testing aid: the fraction of sampled clients whose upload the in-process grid drops)")
        for key in ("mask-dropout-rate", "mask-corruption-rate"):
            rate = float(getattr(self, key.replace("-", "_")))
            if not (math.isfinite(rate) and 0 <= rate < 0.5):
                raise ConfigError(f"run-config '{key}' = {rate} must be in [0, 0.5) (an assumed rate per neighbourhood)")
        if self.n_out < 1:
            raise ConfigError("run-config 'n-out' must be an integer >= 1")
        if self.key_rotation < 0:
            raise ConfigError("run-config 'key-rotation' must be an integer >= 0 (0 = one key pair per run)")
        if self.ddpsa_num_servers < 2:
            raise ConfigError("run-config 'ddpsa-num-servers' must be >= 2 (secret sharing needs >= 2 shares)")
        if not 8 <= self.ddpsa_frac_bits <= 40:
            raise ConfigError("run-config 'ddpsa-frac-bits' must be in [8, 40]")
        if not 0 < self.ddpsa_decay <= 1:
            raise ConfigError("run-config 'ddpsa-decay' must be in (0, 1]")
        if self.ddpsa_threshold != 0 and not 2 <= self.ddpsa_threshold <= self.ddpsa_num_servers:
            raise ConfigError(f"run-config 'ddpsa-threshold' = {self.ddpsa_threshold} must be 0 (auto) or in "
                              f"[2, ddpsa-num-servers = {self.ddpsa_num_servers}]")
        if not (math.isfinite(self.ddpsa_collude_frac) and 0 <= self.ddpsa_collude_frac < 1):
            raise ConfigError(f"run-config 'ddpsa-collude-frac' = {self.ddpsa_collude_frac} must be in [0, 1) "
                              "(the fraction of a round's participants that may collude with the server)")
        if self.ddpsa_servers.strip() and self.method == "ddpsa" and not self.ddpsa_ca:
            raise ConfigError("run-config 'ddpsa-servers' needs 'ddpsa-ca' (the CA of the servers' TLS certificates)")
        if any(w < 1 for w in self.hidden_sizes):
            raise ConfigError(f"run-config 'hidden' = {self.hidden!r}: every width must be an integer >= 1 "
                              "(hidden=\"\" gives a linear model)")
        if self.resume and not self.out_dir:
            raise ConfigError("run-config 'resume' = true needs 'out-dir': the folder of the run to continue")
        if self.model == "cnn" and self.dataset == "breast-cancer":
            raise ConfigError("run-config 'model' = 'cnn' needs an image dataset; use 'mlp' for breast-cancer")

    # ------------------------------------------------------------------ derived
    @property
    def hidden_sizes(self) -> tuple[int, ...]:
        """MLP hidden layer widths."""
        try:
            return tuple(int(h) for h in self.hidden.split(",") if h.strip())
        except ValueError as err:
            raise ConfigError(f"run-config 'hidden' = {self.hidden!r} must be comma-separated integers") from err

    def key_epoch(self, server_round: int) -> int:
        """Key epoch of a round: clients keep one X25519 key pair per epoch (``key-rotation`` rounds)."""
        return 0 if self.key_rotation == 0 else (server_round - 1) // self.key_rotation

    @property
    def ddpsa_sharing_threshold(self) -> int:
        """Intermediate servers whose partial sums reconstruct a DDP-SA round (``ddpsa-threshold``; 0 = auto).

        Auto: ``m - 1`` (one server may be lost) but at least 2 (one server alone must learn nothing).  Equal to
        ``m``: the paper's additive sharing; smaller: Shamir sharing.  Fewer than this many servers colluding
        learn nothing of an individual upload.
        """
        return sharing_threshold(self.ddpsa_threshold, self.ddpsa_num_servers)

    @property
    def clients_per_round(self) -> int:
        """Number of clients sampled each round (at least 1)."""
        return clients_sampled(self.sample_rate, self.num_clients)


def sharing_threshold(threshold: int, servers: int) -> int:
    """``ddpsa-threshold`` resolved for ``servers`` intermediate servers: itself, or for 0 ``max(2, servers - 1)``."""
    return int(threshold) if threshold else max(2, int(servers) - 1)


def clients_sampled(sample_rate: float, num_clients: int) -> int:
    """Clients sampled per round: ``round(q N)``, at least 1."""
    return max(1, round(sample_rate * num_clients))


def _coerce(key: str, value: Any, target: type) -> Any:
    """Convert a run-config value to the field's type, or raise naming the key."""
    try:
        if target is bool:
            if isinstance(value, str):
                if value.lower() in ("true", "1", "yes"):
                    return True
                if value.lower() in ("false", "0", "no"):
                    return False
                raise ValueError(value)
            return bool(value)
        if target is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if target is float:
            return float(value)
        return str(value)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"run-config '{key}' = {value!r} must be of type {target.__name__}") from err


# ---------------------------------------------------------------------------- --run-config text
_KEY = re.compile(r"[A-Za-z0-9_.-]+")


def parse_run_config(text: str | None) -> dict[str, Any]:
    """Parse Flower's ``--run-config`` text (``k=v k2="s"``, values in TOML) or a ``.toml`` file path.

    Flower's own parser (``flwr.common.config.parse_config_args``) drops what it cannot match
    (``num-rounds=``, a lone word) and reports a duplicate key or an unquoted string only as "invalid
    format"; this one accepts the same syntax and raises :class:`ConfigError` naming the key and the fix.
    """
    if not text or not text.strip():
        return {}
    text = text.strip()
    if text.endswith(".toml") and "=" not in text:
        try:
            with open(text, "rb") as fh:
                return _flatten(tomllib.load(fh))
        except OSError as err:
            raise ConfigError(f"--run-config file {text!r} cannot be read: {err.strerror or err}") from err
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"--run-config file {text!r} is not valid TOML: {err}") from err
    out: dict[str, Any] = {}
    pos = 0
    while pos < len(text):
        if text[pos].isspace():
            pos += 1
            continue
        m = _KEY.match(text, pos)
        if not m or m.end() >= len(text) or text[m.end()] != "=":
            word = text[pos:].split()[0]
            raise ConfigError(f"--run-config: {word!r} is not a key=value pair "
                              "(write e.g. 'num-rounds=5 method=\"nadp\"', pairs separated by spaces)")
        key, pos = m.group(), m.end() + 1
        if pos < len(text) and text[pos] in "\"'":
            end = text.find(text[pos], pos + 1)
            if end < 0:
                raise ConfigError(f"--run-config key '{key}': the quoted string has no closing {text[pos]}")
            raw, pos = text[pos:end + 1], end + 1
            if pos < len(text) and not text[pos].isspace():
                raise ConfigError(f"--run-config key '{key}': put a space after the closing quote of {raw}")
        else:
            end = pos
            while end < len(text) and not text[end].isspace():
                end += 1
            raw, pos = text[pos:end], end
        if not raw:
            raise ConfigError(f"--run-config key '{key}' has no value (write {key}=<value>, strings in quotes)")
        if key in out:
            raise ConfigError(f"--run-config key '{key}' is given twice ({key}={out[key]!r} and {key}={raw})")
        out[key] = _toml_value(key, raw)
    return out


def _toml_value(key: str, raw: str) -> Any:
    """One ``--run-config`` value as TOML (numbers, booleans, quoted strings)."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError as err:
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.:/,+-]*", raw):
            raise ConfigError(f"--run-config key '{key}' = {raw}: strings must be quoted, "
                              f"e.g. {key}=\"{raw}\" (inside the shell's single quotes)") from err
        raise ConfigError(f"--run-config key '{key}' = {raw} is not a number, boolean or quoted string") from err


def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested TOML tables as dotted keys (Flower's convention)."""
    flat: dict[str, Any] = {}
    for k, v in table.items():
        if isinstance(v, Mapping):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat
