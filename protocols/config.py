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
import difflib
import json
import math
import re
import tomllib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields
from typing import Any

from protocols import method_options
from protocols.adjacency import ADJACENCIES
from protocols.config_checks import check_counts
from protocols.config_values import TRUE_WORDS, coerce, field_type
from protocols.methods import (
    AUTO,
    AUTO_KEYS,
    METHODS,
    PRIVACY_UNITS,
    TABULAR_DATASETS,
    auto_graph,
    method_spec,
    options_classes,
    regime,
    sparse_by_default,
)
from protocols.options import ConfigError, MethodOptions
from protocols.options import choice as _choice
from protocols.server_optimizers import SERVER_OPTIMIZERS

DATASETS = ("digits", "breast-cancer", "mnist", "fashion-mnist")
#: Keys that mean nothing to this version: refused (strict mode) with the reason.
REMOVED_KEYS = {"niss-unit-variance": "NISS sends one noise share per neighbour whatever the noise variance",
                "mask-dropout-rate": "renamed 'dropout-rate' (it also plans nadp's, niss's and mpddp's noise for dropouts)"}
MODELS = ("mlp", "cnn")
DEVICES = ("cpu", "cuda", "auto")


def is_import_path(value: str) -> bool:
    """``"package.module:attribute"`` -- a user model or dataset loaded by import path (see README)."""
    module, sep, attr = value.partition(":")
    return bool(sep) and all(p.isidentifier() for p in module.split(".")) and attr.isidentifier()
PARTITIONINGS = ("iid", "dirichlet", "size-skew")
__all__ = ["ConfigError", "RunConfig", "TRUE_WORDS", "changed_keys", "clients_sampled", "common_fields", "describe_changes",
           "expanded", "is_auto", "is_on", "parse_run_config"]


def _positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not ok or not math.isfinite(value):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"run-config '{key}' = {value!r} must be a finite number {bound}")


@dataclass(frozen=True)
class RunConfig:
    """Every run-config key, typed.  Field ``foo_bar`` is run-config key ``foo-bar``."""

    # What to run
    method: str = "fedavg"  # the method to run (registry: protocols/methods/)
    method_options: str = ""  # method keys the app does not declare, "{mine-boost = 3.0}" (library.md#adding-a-method)
    dataset: str = "digits"  # digits, breast-cancer, mnist, fashion-mnist, hub:<name>, or "package.module:load"
    data_dir: str = ""  # folder with <dataset>/ IDX files; "" = search $CANCELFL_DATA_DIR, then data/ folders (getting started)
    model: str = "mlp"  # mlp, cnn (image datasets), or "package.module:Net" (your nn.Module class or factory)
    hidden: str = "64"  # MLP hidden widths, comma-separated ("" = linear model)
    train_subset: int = 0  # use only the first N training samples (0 = all; more than the split has: refused)
    test_subset: int = 0  # evaluate on at most the first N test samples (0 = all)
    # Federation
    num_clients: int = 10  # nodes the server waits for (= num-partitions)
    sample_rate: float = 1.0  # fraction q of clients sampled per round
    num_rounds: int = 20  # federated rounds (at most 1,000,000); the noise is calibrated for exactly this many releases
    partitioning: str = "iid"  # how the training split is divided among clients (flwr-datasets partitioners)
    dirichlet_alpha: float = 0.5  # concentration of the dirichlet label split (smaller = more skew)
    seed: int = 42  # partitioning, sampling, initial model, batch order (never DP noise: OS CSPRNG)
    round_timeout: float = 600.0  # seconds a phase waits for replies (simulation, deploy; in-process waits for every reply)
    min_clients: int = 2  # fewest connected nodes a round runs with (waits node-timeout s, then fails)
    node_timeout: float = 60.0  # seconds a round waits for nodes to connect (the first round: for all num-clients)
    max_strikes: int = 3  # rounds in a row with an excluded reply after which a node is left out (0 = never)
    model_ema: float = 0.0  # published model = EMA of the global models with this decay (0 = the last one)
    divergence_factor: float = 100.0  # stop the run when test loss > factor x initial loss or non-finite (0 = off, else >= 1)
    # Local training
    local_epochs: int = 2  # local passes over the client data per round (at most 10,000)
    batch_size: int = 32  # local batch size (larger than a partition = one full-batch step)
    lr: float = 0.1  # local learning rate (ddpsa: its server step)
    input_centering: bool = False  # each image minus its own mean (per-record transform: no privacy cost; images only)
    device: str = "cpu"  # where clients train: cpu, cuda, auto (cuda if available); noise stays on the CPU CSPRNG
    # Privacy
    epsilon: float = 1.0  # privacy target over the whole run, every method
    delta: float = 1e-5  # delta of the (epsilon, delta) target
    privacy_unit: str = "record"  # what epsilon protects: "record" (one example) or "client" (ldp, cdp only)
    adjacency: str = "zero-out"  # neighbouring datasets: one record zeroed (sizes fixed; Opacus' convention) | replace-one
    clip: float = 1.0  # L2 bound of a client's model update (or gradient, per method)
    # Server step and testing
    fault_drop_rate: float = 0.0  # TESTING AID: the server withholds this fraction of train messages (any engine)
    server_optimizer: str = "sgd"  # the FedSGD methods' server step (mpddp family, ddpsa): sgd | adam
    # Output
    out_dir: str = ""  # "" = a fresh folder runs/<UTC time>-<method> (runs/latest points to the newest)
    resume: bool = False  # continue the run whose checkpoint is in out-dir (`cancelfl run/deploy --resume OUT`)
    #: The registered methods' own keys, one :class:`protocols.options.MethodOptions` per class; read them as
    #: ``cfg.nadp_tau`` (the key with ``_``) or ``cfg.options_of(NadpOptions).tau``.
    options: tuple[MethodOptions, ...] = dataclasses.field(default_factory=lambda: _default_options())
    #: Not a run-config key: the (key, value) pairs the method's regime set (keys the user left "auto").
    regime_applied: tuple[tuple[str, Any], ...] = dataclasses.field(default=(), compare=False)

    def __getattr__(self, name: str) -> Any:
        """A method option by its run-config attribute (``nadp_tau``) or ``<prefix>_<attribute>`` of its class."""
        if name.startswith("__") or name in ("options", "regime_applied"):
            raise AttributeError(name)
        for opts in self.__dict__.get("options", ()):
            field_name = type(opts).attribute_names().get(name)
            if field_name is not None:
                return getattr(opts, field_name)
            prefix = f"{type(opts).prefix}_"
            if type(opts).prefix and name.startswith(prefix) and hasattr(opts, name[len(prefix):]):
                return getattr(opts, name[len(prefix):])
        raise AttributeError(f"RunConfig has no key or method option {name!r}")

    def options_of(self, cls: type[MethodOptions]) -> MethodOptions:
        """The run's values of options class ``cls`` (its defaults if the class was registered after this config)."""
        for opts in self.options:
            if type(opts) is cls:
                return opts
        return cls()

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
        user sets is never replaced.  The keys ``method-options`` carries are read as keys of ``raw`` (:func:`expanded`).
        """
        raw = expanded(raw)
        known = {cls.key_of(f.name): f for f in common_fields()}
        known.update({key: f for opt_cls in options_classes() for key, f in opt_cls.keys().items()})
        values: dict[str, Any] = {}
        unset = set(AUTO_KEYS)
        for key, value in raw.items():
            f = known.get(key)
            if f is None:
                if strict and key in REMOVED_KEYS:
                    raise ConfigError(f"run-config '{key}' was removed: {REMOVED_KEYS[key]}")
                if strict:
                    near = "".join(f" (did you mean '{k}'?)" for k in difflib.get_close_matches(str(key), known, 1))
                    raise ConfigError(f"unknown run-config key '{key}'{near}; known keys: {', '.join(sorted(known))}")
                continue
            if is_auto(key, value):
                if key not in AUTO_KEYS:
                    raise ConfigError(f"run-config '{key}' cannot be \"{AUTO}\"; only {', '.join(AUTO_KEYS)} can")
                continue
            unset.discard(key)
            values[_attr(key)] = coerce(key, value, field_type(f))
        method, dataset = values.get("method", cls.method), values.get("dataset", cls.dataset)
        applied: dict[str, Any] = {}
        if method in METHODS:  # an unknown method is refused by validate() below
            for key, value in regime(method, dataset).items():
                if key in unset:
                    values[_attr(key)] = applied[key] = coerce(key, value, field_type(known[key]))
        lr_key = method_spec(method).server_step_lr if method in METHODS else None
        if "server-optimizer" in applied and lr_key not in unset:  # the user's xi / lr is the paper's SGD step
            values["server_optimizer"] = applied["server-optimizer"] = "sgd"
        if "graph" in unset and "graph" not in applied:
            k = clients_sampled(values.get("sample_rate", cls.sample_rate), values.get("num_clients", cls.num_clients))
            values["graph"] = auto_graph(method, k)
            if sparse_by_default(method):  # a decision for these methods: printed with the regime
                applied["graph"] = values["graph"]
        cfg = cls.of(**values, regime_applied=tuple(sorted(applied.items())))
        cfg.validate()
        return cfg

    @classmethod
    def of(cls, **values: Any) -> RunConfig:
        """Build from attribute names (``nadp_tau=0.3``), common keys and method options alike; not validated."""
        common = {f.name for f in fields(cls)}
        own = {k: v for k, v in values.items() if k in common}
        rest = {k: v for k, v in values.items() if k not in common}
        return cls(**own, options=_with_options(_default_options(), rest))

    def to_mapping(self) -> dict[str, Any]:
        """Inverse of :meth:`from_mapping` (for summaries and ``--run-config``): every key, resolved."""
        out = {self.key_of(f.name): getattr(self, f.name) for f in common_fields()}
        for cls in options_classes():
            out.update(self.options_of(cls).as_mapping())
        return out

    def replace(self, **changes: Any) -> RunConfig:
        """Copy with changed common keys or method options (attribute names), validated."""
        common = {f.name for f in fields(self)}
        own = {k: v for k, v in changes.items() if k in common}
        rest = {k: v for k, v in changes.items() if k not in common}
        cfg = dataclasses.replace(self, **own, options=_with_options(self.options, rest))
        cfg.validate()
        return cfg

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the key and the allowed values."""
        if self.method not in METHODS:
            raise ConfigError(
                f"run-config 'method' = {self.method!r} is not a registered method; choose one of: "
                f"{', '.join(METHODS)} (a method of your own is registered by its card: a module in "
                "protocols/methods/ or an installed package's 'cancelfl.methods' entry point, docs/library.md)"
            )
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
        _choice("privacy-unit", self.privacy_unit, PRIVACY_UNITS)
        _choice("adjacency", self.adjacency, tuple(ADJACENCIES))
        _choice("server-optimizer", self.server_optimizer, SERVER_OPTIMIZERS)
        if self.server_optimizer != "sgd" and method_spec(self.method).server_step_lr is None:
            stepping = ", ".join(m for m, spec in METHODS.items() if spec.server_step_lr is not None)
            raise ConfigError(f"run-config 'server-optimizer' = {self.server_optimizer!r} applies to the methods "
                              f"whose server steps with a released gradient ({stepping}); {self.method!r} averages "
                              "models")
        try:
            method_spec(self.method).guarantee(self.privacy_unit)
        except ValueError as err:
            raise ConfigError(f"{err} ({', '.join(m for m, s in METHODS.items() if self.privacy_unit in s.units)})") from None
        for key in ("num-clients", "num-rounds", "local-epochs", "batch-size", "min-clients"):
            if getattr(self, key.replace("-", "_")) < 1:
                raise ConfigError(f"run-config '{key}' must be an integer >= 1")
        if not 0 <= self.seed < 2**63:  # node identities and the data split take it as a signed 64-bit integer
            raise ConfigError(f"run-config 'seed' = {self.seed} must be an integer in [0, 2^63 - 1]")
        if not 0 < self.sample_rate <= 1:
            raise ConfigError(f"run-config 'sample-rate' = {self.sample_rate} must be in (0, 1]")
        need = method_spec(self.method).min_per_round
        if self.clients_per_round < need:
            fix = (f"set 'num-clients' >= {need}" if self.num_clients < need
                   else f"raise 'sample-rate' to at least {need / self.num_clients:.3g}")
            raise ConfigError(f"method {self.method!r} needs at least {need} clients per round (its protection works "
                              f"between the clients of a round): run-config 'num-clients' = {self.num_clients} x "
                              f"'sample-rate' = {self.sample_rate:g} gives {self.clients_per_round}; {fix}")
        check_counts(self)  # the data subsets, min-clients against num-clients
        if not 0 < self.delta < 1:
            raise ConfigError(f"run-config 'delta' = {self.delta} must be in (0, 1)")
        if self.max_strikes < 0:
            raise ConfigError("run-config 'max-strikes' must be an integer >= 0 (0 = never leave a node out)")
        if not (math.isfinite(self.divergence_factor) and (self.divergence_factor == 0 or self.divergence_factor >= 1)):
            raise ConfigError(f"run-config 'divergence-factor' = {self.divergence_factor} must be 0 (off) or a finite "
                              "number >= 1: the run stops once the test loss exceeds that multiple of the initial loss, "
                              "so a factor below 1 stops a run whose loss is falling")
        if not (math.isfinite(self.model_ema) and 0 <= self.model_ema < 1):
            raise ConfigError(f"run-config 'model-ema' = {self.model_ema} must be in [0, 1) (0 = publish the last "
                              "global model)")
        for key in ("lr", "epsilon", "clip", "dirichlet-alpha", "round-timeout", "node-timeout"):
            _positive(key, float(getattr(self, key.replace("-", "_"))))
        if not (math.isfinite(self.fault_drop_rate) and 0 <= self.fault_drop_rate < 1):
            raise ConfigError(f"run-config 'fault-drop-rate' = {self.fault_drop_rate} must be in [0, 1) "
                              "(testing aid: the fraction of sampled clients whose train message the server withholds)")
        if any(w < 1 for w in self.hidden_sizes):
            raise ConfigError(f"run-config 'hidden' = {self.hidden!r}: every width must be an integer >= 1 "
                              "(hidden=\"\" gives a linear model)")
        active = set(method_spec(self.method).options)
        for cls in options_classes():
            opts = self.options_of(cls)
            opts.check()
            if cls in active:
                opts.validate_run(self)
        if self.method_options:
            raise ConfigError("run-config 'method-options' is read by RunConfig.from_mapping, which sets its keys")
        if self.resume and not self.out_dir:
            raise ConfigError("run-config 'resume' = true needs 'out-dir': the folder of the run to continue")
        if self.dataset in TABULAR_DATASETS and (self.model == "cnn" or self.input_centering):
            key, fix = ("model", "'mlp'") if self.model == "cnn" else ("input-centering", "false")
            raise ConfigError(f"run-config '{key}' is for images; dataset {self.dataset!r} is tabular: set '{key}' = {fix}")

    # ------------------------------------------------------------------ derived
    @property
    def hidden_sizes(self) -> tuple[int, ...]:
        """MLP hidden layer widths."""
        try:
            return tuple(int(h) for h in self.hidden.split(",")) if self.hidden.strip() else ()
        except ValueError as err:
            raise ConfigError(f"run-config 'hidden' = {self.hidden!r} must be comma-separated integers") from err

    def key_epoch(self, server_round: int) -> int:
        """Key epoch of a round: clients keep one X25519 key pair per epoch (``key-rotation`` rounds)."""
        return 0 if self.key_rotation == 0 else (server_round - 1) // self.key_rotation

    @property
    def clients_per_round(self) -> int:
        """Number of clients sampled each round (at least 1)."""
        return clients_sampled(self.sample_rate, self.num_clients)


def clients_sampled(sample_rate: float, num_clients: int) -> int:
    """Clients sampled per round: ``round(q N)``, at least 1."""
    return max(1, round(sample_rate * num_clients))


def expanded(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` with the keys its ``method-options`` carries as ordinary keys (:func:`protocols.method_options.expand`)."""
    return method_options.expand(raw, {RunConfig.key_of(f.name) for f in common_fields()})


def common_fields() -> list[dataclasses.Field]:
    """The run-config fields of :class:`RunConfig` itself (every key but the methods' options)."""
    return [f for f in fields(RunConfig) if f.name not in ("options", "regime_applied")]


def _default_options() -> tuple[MethodOptions, ...]:
    return tuple(cls() for cls in options_classes())


def _with_options(options: tuple[MethodOptions, ...], values: dict[str, Any]) -> tuple[MethodOptions, ...]:
    """``options`` with ``values`` (RunConfig attribute names, e.g. ``nadp_tau``) applied to the class owning each.

    Raises:
        ConfigError: a name no options class owns.
    """
    rest = dict(values)
    out = []
    for opts in options:
        names = type(opts).attribute_names()
        mine = {names[k]: rest.pop(k) for k in list(rest) if k in names}
        out.append(dataclasses.replace(opts, **mine) if mine else opts)
    if rest:
        raise ConfigError(f"unknown run-config key(s): {', '.join(sorted(RunConfig.key_of(k) for k in rest))}")
    return tuple(out)


def _attr(key: str) -> str:
    return key.replace("-", "_")


def is_auto(key: str, value: Any) -> bool:
    """Whether run-config ``key`` = ``value`` leaves the key to the method's regime (``"auto"``, any case).

    ``device = "auto"`` is a literal device choice, not a regime's.
    """
    return isinstance(value, str) and value.strip().lower() == AUTO and key != "device"


def is_on(value: Any) -> bool:
    """Whether ``value`` turns a boolean setting on: ``True``, or text in :data:`TRUE_WORDS` (any case, as given)."""
    return value is True or (isinstance(value, str) and value.lower() in TRUE_WORDS)


def changed_keys(stored: Mapping[str, Any], cfg: RunConfig, ignore: Collection[str] = ()) -> list[str]:
    """The run-config keys outside ``ignore`` whose value in ``cfg`` differs from ``stored``.

    ``stored``: a run config as :meth:`RunConfig.to_mapping` gives it, kept as JSON (a checkpoint, a run's pinned
    settings); values compare as JSON, so a list read back equals the tuple it was written from.
    """
    now = cfg.to_mapping()
    return sorted(k for k in set(stored) | set(now) if k not in ignore
                  and json.dumps(stored.get(k), sort_keys=True) != json.dumps(now.get(k), sort_keys=True))


def describe_changes(stored: Mapping[str, Any], cfg: RunConfig, before: str, after: str) -> str:
    """``"key: <before> a -> <after> b, ..."`` for the keys :func:`changed_keys` finds ("" when none)."""
    now = cfg.to_mapping()
    return ", ".join(f"{k}: {before}{stored.get(k)!r} -> {after}{now.get(k)!r}" for k in changed_keys(stored, cfg))


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
