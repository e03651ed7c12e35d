"""A method's own run-config keys: :class:`MethodOptions` and the :func:`option` that declares one key.

A method declares its keys once, as a frozen dataclass of :func:`option` fields; the registry
(:func:`protocols.methods.register`) makes :class:`protocols.config.RunConfig` parse, validate and
document them, and ``[tool.flwr.app.config]`` and the docs' configuration reference are checked
against them (``tests/test_config.py``).  Field ``foo_bar`` of a class with ``prefix = "nadp"`` is
run-config key ``nadp-foo-bar`` (``prefix = ""``: key ``foo-bar``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar


class ConfigError(ValueError):
    """A run-config value is missing, of the wrong type or out of range."""


def choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    """Raise :class:`ConfigError` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(f"run-config '{key}' = {value!r} is not allowed; choose one of: {', '.join(allowed)}")


def in_range(key: str, value: float, low: float | None, high: float | None, *, low_open: bool = False,
             high_open: bool = False, why: str = "") -> None:
    """Raise :class:`ConfigError` unless ``value`` is finite and within the bounds (``None`` = unbounded)."""
    ok = math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "(-inf" if low is None else ("(" if low_open else "[") + f"{low:g}"
        hi = "inf)" if high is None else f"{high:g}" + (")" if high_open else "]")
        raise ConfigError(f"run-config '{key}' = {value!r} must be in {lo}, {hi}{f' ({why})' if why else ''}")


#: ``option(trust=...)``: a trust assumption a node may pin in its node config (:meth:`MethodOptions.trust_keys`).
#: ``"at-least"``: a larger value assumes a stronger adversary (more colluders, a higher reconstruction threshold),
#: so a run config below the node's value is refused; ``"at-most"``: the reverse.
TRUST_DIRECTIONS: tuple[str, ...] = ("at-least", "at-most")


def option(default: Any, help: str, *, choices: tuple[str, ...] = (), low: float | None = None,  # noqa: A002
           high: float | None = None, low_open: bool = False, high_open: bool = False, key: str = "",
           trust: str = "") -> Any:
    """One run-config key of a :class:`MethodOptions` class.

    Args:
        default: the value when the run config does not set the key (also the ``[tool.flwr.app.config]`` default).
        help: one line for ``--help`` and the configuration reference.
        choices: the allowed values of a string key.
        low: lower bound of a number key (checked by :meth:`MethodOptions.check`); ``None`` = none.
        high: upper bound of a number key; ``None`` = none.
        low_open: the lower bound itself is refused.
        high_open: the upper bound itself is refused.
        key: the run-config key, when it is not ``<prefix>-<field-name>`` (e.g. a Python keyword).
        trust: a trust assumption the client's noise is sized for (e.g. a colluding fraction): which way a run
            config may differ from a node's pinned value (:data:`TRUST_DIRECTIONS`; ``client.floor.check_trust``);
            ``""`` = not an assumption.
    """
    if trust and trust not in TRUST_DIRECTIONS:
        raise ValueError(f"option trust = {trust!r}: choose one of {', '.join(TRUST_DIRECTIONS)}")
    meta = {"help": help, "choices": tuple(choices), "low": low, "high": high, "low_open": low_open,
            "high_open": high_open, "key": key, "trust": trust}
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class MethodOptions:
    """Base of a method's options: a frozen dataclass whose fields are :func:`option` keys.

    Subclasses set :attr:`prefix` and :attr:`title` and may override :meth:`validate` for rules
    between keys.  Every registered options class is parsed and checked on every run (a typo in
    any key is refused), while :meth:`validate_run` runs only when the run's method uses the class.
    """

    #: Key prefix (``"nadp"`` -> ``nadp-<field>``); ``""`` = the field name alone.
    prefix: ClassVar[str] = ""
    #: Heading of these keys in the configuration reference.
    title: ClassVar[str] = ""

    @classmethod
    def key_of(cls, f: dataclasses.Field) -> str:
        """The run-config key of field ``f``."""
        if f.metadata.get("key"):
            return f.metadata["key"]
        name = f.name.rstrip("_").replace("_", "-")
        return f"{cls.prefix}-{name}" if cls.prefix else name

    @classmethod
    @functools.cache
    def keys(cls) -> Mapping[str, dataclasses.Field]:
        """Run-config key -> field, in declaration order (computed once per class: every option read uses it)."""
        return MappingProxyType({cls.key_of(f): f for f in dataclasses.fields(cls)})

    @classmethod
    @functools.cache
    def attribute_names(cls) -> Mapping[str, str]:
        """``RunConfig`` attribute (the key with ``_``) -> field name, e.g. ``nadp_tau`` -> ``tau``."""
        return MappingProxyType({key.replace("-", "_"): f.name for key, f in cls.keys().items()})

    @classmethod
    def trust_keys(cls) -> Mapping[str, str]:
        """Run-config key -> :data:`TRUST_DIRECTIONS` entry, for the keys declared with ``option(trust=...)``."""
        return MappingProxyType({key: f.metadata["trust"] for key, f in cls.keys().items() if f.metadata.get("trust")})

    def assumed(self, key: str, cfg: Any) -> float:
        """What trust key ``key`` assumes in the run config ``cfg`` (override where a value means "auto").

        The comparable value: e.g. ddpsa's threshold 0 resolved for the servers.  ``math.inf`` / ``-math.inf``:
        not comparable here (the method's handler checks it per round).
        """
        return float(getattr(self, self.keys()[key].name))

    def check(self) -> None:
        """Raise :class:`ConfigError` for a value outside its field's choices or bounds, then :meth:`validate`."""
        for key, f in self.keys().items():
            value, m = getattr(self, f.name), f.metadata
            if m.get("choices"):
                choice(key, value, m["choices"])
            if (m.get("low") is not None or m.get("high") is not None) and not isinstance(value, str):
                number = value if isinstance(value, int) and not isinstance(value, bool) else float(value)
                in_range(key, number, m["low"], m["high"], low_open=m["low_open"], high_open=m["high_open"])
        self.validate()

    def validate(self) -> None:
        """Rules between this class's own keys (override); raise :class:`ConfigError`."""

    def validate_run(self, cfg: Any) -> None:
        """Rules against the common keys of ``cfg`` (a :class:`protocols.config.RunConfig`); override.

        Checked only when the run's method uses these options; raise :class:`ConfigError`.
        """

    def as_mapping(self) -> dict[str, Any]:
        """Run-config key -> value."""
        return {key: getattr(self, f.name) for key, f in self.keys().items()}
