"""One run-config value typed as its key's field: :func:`coerce` and the words :data:`TRUE_WORDS`.

:class:`protocols.config.RunConfig` reads every key through :func:`coerce`; a value of the wrong type is refused
with a :class:`~protocols.options.ConfigError` naming the key, the value as written in ``--run-config`` and the
type it must be.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from protocols.options import ConfigError

__all__ = ["TRUE_WORDS", "coerce", "field_type", "shown"]

#: Text that turns a boolean setting on (any case): run-config values, node config, environment variables.
TRUE_WORDS = ("true", "1", "yes")


def field_type(f: dataclasses.Field) -> type:
    """The Python type of a field's default (the type a run-config value is coerced to)."""
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    return type(default)


def shown(value: Any) -> str:
    """A run-config value as written in ``--run-config`` (``true``, ``'text'``, ``1.5``)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def coerce(key: str, value: Any, target: type) -> Any:
    """Convert a run-config value to the field's type, or raise :class:`ConfigError` naming the key.

    A bool key takes a boolean or one of the strings true/false/1/0/yes/no (any case), never a number; a
    number key takes a number or its text, never a boolean (``True`` is an ``int`` to Python); an int key
    takes no fractional value (its range: :func:`protocols.config_checks.check_counts`); a string key takes text or a number
    (``hidden = 64``), never a boolean, an array or a date.
    """
    if target is str:
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ConfigError(f"run-config '{key}' = {shown(value)} must be a string, got {type(value).__name__} "
                              f"(write it in quotes: {key}=\"...\")")
        return str(value)
    try:
        if target is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str):
                if value.lower() in TRUE_WORDS:
                    return True
                if value.lower() in ("false", "0", "no"):
                    return False
            raise ValueError(value)
        if target in (int, float) and isinstance(value, bool):
            raise ValueError(value)
        if target is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if target is float:
            return float(value)
        return target(value)
    except (TypeError, ValueError, OverflowError) as err:
        kind = {bool: "a boolean (true or false)", int: "an integer", float: "a number"}.get(target, target.__name__)
        raise ConfigError(f"run-config '{key}' = {shown(value)} must be {kind}") from err
