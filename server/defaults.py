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
