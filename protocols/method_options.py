"""A method's own run-config keys carried in one declared key, ``method-options``, through Flower's runtimes.

Flower's simulation and deployment runtimes accept only the run-config keys the app declares in
``[tool.flwr.app.config]``; a method registered by a package of its own (docs/library.md) has keys the app does
not declare.  ``cancelfl run/deploy`` put those in ``method-options``, one TOML inline table (or JSON object) as
text (:func:`render`), and :meth:`protocols.config.RunConfig.from_mapping` sets them as ordinary keys before any
value is read (:func:`expand`), on the ServerApp and the ClientApp alike: the settings the strategy sends, the
client's check of them against its own run config, its trust check and the settings digest see ordinary keys.
"""

from __future__ import annotations

import json
import numbers
import re
import tomllib
from collections.abc import Collection, Mapping
from typing import Any

from protocols.options import ConfigError

#: The declared run-config key that carries the undeclared ones.
KEY = "method-options"
_BARE = re.compile(r"[A-Za-z0-9_-]+")


def parse(text: Any) -> dict[str, Any]:
    """The keys ``text`` carries: a TOML inline table (``{mine-boost = 3.0}``) or a JSON object; ``""`` = none.

    Raises:
        ConfigError: not one table of numbers, booleans and strings, or a key written twice.
    """
    if not isinstance(text, str):
        raise ConfigError(f"run-config '{KEY}' = {text!r} must be a string holding a TOML inline table")
    if not text.strip():
        return {}
    try:
        doc = tomllib.loads(f"v = {text}")
        table = doc["v"] if list(doc) == ["v"] else None
    except tomllib.TOMLDecodeError:
        try:
            table = json.loads(text, object_pairs_hook=_no_twice)
        except ValueError as err:
            raise ConfigError(f"run-config '{KEY}' = {text!r} is not a TOML inline table ('{{mine-boost = 3.0}}') "
                              f"or a JSON object: {err}") from err
    if not isinstance(table, dict):
        raise ConfigError(f"run-config '{KEY}' = {text!r} must be one table of key = value pairs")
    for key, value in table.items():
        if not isinstance(value, str | int | float | bool):
            raise ConfigError(f"run-config '{KEY}': '{key}' = {value!r} must be a number, boolean or string")
    return table


def _no_twice(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key '{key}' written twice")
        out[key] = value
    return out


def expand(raw: Mapping[str, Any], common: Collection[str]) -> dict[str, Any]:
    """``raw`` with the keys its ``method-options`` carries set as ordinary keys, and ``method-options`` dropped.

    ``common``: the keys the run config declares itself (never carried).  The same on every end: the ServerApp
    and each ClientApp expand the run config they were given before anything reads it.

    Raises:
        ConfigError: malformed text (:func:`parse`), a carried key that is a common key, or a key set both as itself
            (given, or declared by the app) and in ``method-options``.
    """
    out = {k: v for k, v in raw.items() if k != KEY}
    for key, value in parse(raw.get(KEY, "")).items():
        if key == KEY or key in common:
            raise ConfigError(f"run-config '{KEY}' carries '{key}', a key the app declares: set run-config "
                              f"'{key}' itself")
        if key in out:  # given by the user, or the default of a key the app declares (always in its run config)
            raise ConfigError(f"run-config '{key}' is set as itself ({out[key]!r}; a key the app declares always is, "
                              f"to its default) and in '{KEY}' ({value!r}): set run-config '{key}' itself and leave it "
                              f"out of '{KEY}'")
        out[key] = value
    return out


def render(values: Mapping[str, Any]) -> str:
    """``values`` as the TOML inline table :func:`parse` reads, without a double quote.

    Flower's ``--run-config`` parser ends a quoted value at the next ``"``: this text travels whole.

    Raises:
        ConfigError: a key that is not a bare TOML key, or a string value holding a quote or a line break.
    """
    pairs = []
    for key, value in values.items():
        if not _BARE.fullmatch(key):
            raise ConfigError(f"run-config '{key}' cannot travel in '{KEY}': use letters, digits, '-' and '_'")
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, numbers.Integral):
            text = str(int(value))
        elif isinstance(value, numbers.Real):
            text = repr(float(value))  # a numpy float's repr is "np.float64(3.0)"
        elif isinstance(value, str) and not any(c in value for c in "'\"\n\r"):
            text = f"'{value}'"
        else:
            raise ConfigError(f"run-config '{key}' = {value!r} cannot travel in '{KEY}' (a number, a boolean or a "
                              "string without quotes or line breaks)")
        pairs.append(f"{key} = {text}")
    return "{" + ", ".join(pairs) + "}"
