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


def flower_run_config(overrides: dict) -> dict:
    """``overrides`` as Flower's runtime (simulation, deployment) takes them: keys the app declares only.

    ``flwr run`` accepts only keys declared in ``[tool.flwr.app.config]`` of the app's ``pyproject.toml`` (its
    ServerApp then fails with "Invalid run configuration" and nothing else).  A key of a registered method's
    options that the app does not declare (a method of an installed package's: docs/library.md) travels in
    the declared ``method-options`` (:mod:`protocols.method_options`), which both apps expand.  Raises
    :class:`~protocols.config.ConfigError` naming any other undeclared key and the line to add, or a key given
    both itself and in ``method-options``.
    """
    from protocols import method_options
    from protocols.config import ConfigError
    from protocols.methods import options_classes

    declared = app_defaults()
    carried = {key for cls in options_classes() for key in cls.keys()} if method_options.KEY in declared else set()
    moved = {k: v for k, v in overrides.items() if k not in declared and k in carried}
    missing = sorted(k for k in overrides if k not in declared and k not in carried)
    if missing:
        known = RunConfig().to_mapping()
        lines = ", ".join(f"{k} = {_toml(known[k])}" if k in known else k for k in missing)
        raise ConfigError(f"run-config {', '.join(repr(k) for k in missing)}: not declared in "
                          f"[tool.flwr.app.config] of {APP_DIR / 'pyproject.toml'}, and Flower's runtime "
                          f"accepts only declared keys; add {lines} there (or run with --engine inprocess)")
    if not moved:
        return dict(overrides)
    out = {k: v for k, v in overrides.items() if k not in moved}
    given = method_options.parse(out.get(method_options.KEY, ""))
    if twice := sorted(set(given) & set(moved)):
        raise ConfigError(f"run-config {', '.join(repr(k) for k in twice)} given twice: as itself and in "
                          f"'{method_options.KEY}'; give it once")
    out[method_options.KEY] = method_options.render({**given, **moved})
    return out


def check_flower_keys(overrides: dict) -> None:
    """Raise :class:`~protocols.config.ConfigError` where Flower's runtime cannot take ``overrides``."""
    flower_run_config(overrides)


def _toml(value: object) -> str:
    """``value`` as a TOML literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)
