"""The app's run-config defaults, as ``flwr run`` starts from them (``[tool.flwr.app.config]``)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from protocols.config import RunConfig

APP_DIR = Path(__file__).resolve().parent.parent


def app_defaults() -> dict:
    """The ``[tool.flwr.app.config]`` defaults of the app (what ``flwr run`` starts from)."""
    pyproject = APP_DIR / "pyproject.toml"
    if pyproject.is_file():
        return dict(tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"])
    return RunConfig().to_mapping()


def check_flower_keys(overrides: dict) -> None:
    """Refuse run-config keys that Flower's runtime (simulation, deployment) would reject: keys the app lacks.

    ``flwr run`` accepts only keys declared in ``[tool.flwr.app.config]`` of the app's ``pyproject.toml`` (its
    ServerApp then fails with "Invalid run configuration" and nothing else); a method's own options registered
    after the app was written need a line there.  Raises :class:`~protocols.config.ConfigError` naming each key
    and the line to add.
    """
    from protocols.config import ConfigError

    declared = app_defaults()
    missing = sorted(k for k in overrides if k not in declared)
    if missing:
        known = RunConfig().to_mapping()
        lines = ", ".join(f"{k} = {_toml(known[k])}" if k in known else k for k in missing)
        raise ConfigError(f"run-config {', '.join(repr(k) for k in missing)}: not declared in "
                          f"[tool.flwr.app.config] of {APP_DIR / 'pyproject.toml'}, and Flower's runtime "
                          f"accepts only declared keys; add {lines} there (or run with --engine inprocess)")


def _toml(value: object) -> str:
    """``value`` as a TOML literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)
