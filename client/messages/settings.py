"""The method's settings, carried by every message a cancelfl strategy sends.

A strategy is built from one set of settings (a run config or keyword arguments); it puts them, resolved,
in each message under :data:`KEY`, so a ClientApp that uses :mod:`client.api` needs no copy of them and
works where Flower passes no run config (``flwr.simulation.run_simulation``).  Where the client's run
config names a method too, the two must agree: a client/server mismatch is refused with the fix named.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from flwr.app import ConfigRecord, Message, RecordDict

from protocols.config import ConfigError, RunConfig

#: The ConfigRecord that holds the strategy's settings (run-config keys, resolved values).
KEY = "cancelfl-settings"
_JSON = "json"
#: Starts the error a client raises on a method mismatch (the strategy stops the run on it).
MISMATCH = "cancelfl settings mismatch:"


def settings_record(cfg: RunConfig) -> ConfigRecord:
    """``cfg`` as a ConfigRecord: every run-config key, resolved, as one JSON text (a ConfigRecord cannot hold "")."""
    return ConfigRecord({_JSON: json.dumps(cfg.to_mapping(), sort_keys=True)})


def with_settings(content: RecordDict, cfg: RunConfig) -> RecordDict:
    """``content`` with the settings record added under :data:`KEY`; returns ``content``."""
    content[KEY] = settings_record(cfg)
    return content


def settings_of(msg: Message, run_config: Mapping[str, Any]) -> RunConfig:
    """The settings this client acts on: those the strategy sent, checked against the client's run config.

    Raises:
        ConfigError: the message carries no settings and ``run_config`` names no method, or the client's run
            config names another method than the strategy's (the message says which key to change).
    """
    sent = msg.content.config_records.get(KEY) if msg.has_content() else None
    local = run_config.get("method")
    if sent is None:
        if local is None:
            raise ConfigError("cancelfl: the message carries no method settings and the client's run config has no "
                              "'method'; build the ServerApp's strategy from cancelfl's strategies (e.g. "
                              "strategies.NadpStrategy) or pass run-config method=<name> to the ClientApp")
        return RunConfig.from_mapping(run_config, strict=False)
    try:
        cfg = RunConfig.from_mapping(json.loads(str(sent[_JSON])), strict=False)
    except (KeyError, ValueError, TypeError) as err:
        raise ConfigError(f"cancelfl: malformed '{KEY}' record in the message: {err}") from err
    if local is not None and local != cfg.method:
        raise ConfigError(f"{MISMATCH} the ServerApp's strategy runs method '{cfg.method}' but this ClientApp's run "
                          f"config says method='{local}'; set run-config method=\"{cfg.method}\" (pyproject "
                          f"[tool.flwr.app.config] or --run-config) or drop 'method' from the app's run config")
    return cfg
