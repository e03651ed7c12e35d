"""The method's settings, carried by every message a cancelfl strategy sends.

A strategy is built from one set of settings (a run config or keyword arguments); it puts them, resolved,
in each message under :data:`KEY`, so a ClientApp that uses :mod:`client.api` needs no copy of them and
works where Flower passes no run config (``flwr.simulation.run_simulation``).  Every key the client's run config
sets (the method, its epsilon, clip, noise options, ...) is the client's own: the strategy's value must be the
same, or the message is refused naming the keys (:data:`SERVER_RESOLVED` keys aside, which only the ServerApp acts
on).
A diagnostic that reveals more than the method's protection (:data:`CLIENT_ONLY`: ``cancellation-check``) is
only acted on when the client's own run config turns it on too.  The client pins the settings of a run's
first message and refuses a later message of the run that carries others (:func:`protocols.config.changed_keys`,
:func:`client.api.client_env`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from protocols.config import ConfigError, RunConfig, describe_changes, expanded, is_auto, is_on

#: The record that holds the strategy's settings (run-config keys, resolved values; :func:`settings_config`).
KEY = "cancelfl-settings"
_JSON = "json"
#: Starts the error a client raises on a method mismatch (the strategy stops the run on it).
MISMATCH = "cancelfl settings mismatch:"
#: Switches a client acts on only when its own run config sets them too: diagnostics that let an upload reveal
#: more than the method's protection (``cancellation-check``: each client's mask projection or noiseless update).
CLIENT_ONLY = ("cancellation-check",)
#: Keys the ServerApp resolves for itself (``Strategy.start()``'s run folder, reply timeout and resume) and no
#: client acts on: the strategy's value may differ from the one the client's run config holds.
SERVER_RESOLVED = ("out-dir", "resume", "round-timeout")


def settings_config(cfg: RunConfig) -> dict[str, Any]:
    """The :data:`KEY` record: every run-config key, resolved, as one JSON text (a ConfigRecord cannot hold "")."""
    return {_JSON: json.dumps(cfg.to_mapping(), sort_keys=True)}


def settings_of(content: Mapping[str, Any] | None, run_config: Mapping[str, Any]) -> RunConfig:
    """The settings this client acts on: those the strategy sent, checked against the client's run config.

    ``content`` is the message's content (None for a message without content).

    Raises:
        ConfigError: the message carries no settings and ``run_config`` names no method, or the client's run
            config names another method than the strategy's (the message says which key to change).
    """
    sent = content.get(KEY) if content is not None else None
    run_config = expanded(run_config)  # the keys its method-options carries are the client's own too
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
    sent_on = cfg.to_mapping()
    _keeps_own_values(sent_on, run_config)
    for key in CLIENT_ONLY:
        own = run_config.get(key, False)
        if sent_on.get(key) is True and not is_on(own):
            raise ConfigError(f"{MISMATCH} the ServerApp's strategy turns on '{key}' (a diagnostic that reveals "
                              f"more of each upload than the method's protection) but this ClientApp's run config "
                              f"does not; set run-config {key}=true on the client too, or turn it off in the strategy")
    return cfg


def _keeps_own_values(sent: Mapping[str, Any], run_config: Mapping[str, Any]) -> None:
    """Refuse settings ``sent`` by the strategy that differ from a key the client's own ``run_config`` sets.

    A key the client's run config leaves ``"auto"`` or omits is the strategy's; :data:`SERVER_RESOLVED` keys
    are not compared.  Values compare as the run config resolves them (``"0.5"`` = ``0.5``).

    Raises:
        ConfigError: (:data:`MISMATCH`) naming each differing key with both values.
    """
    own = {k: v for k, v in run_config.items()
           if k in sent and k not in SERVER_RESOLVED and not is_auto(k, v)}
    if not own:
        return
    try:
        mine = RunConfig.from_mapping({**sent, **own}, strict=False)
    except ConfigError as err:
        raise ConfigError(f"{MISMATCH} this ClientApp's run config does not hold with the ServerApp's strategy's "
                          f"settings: {err}") from err
    shown = describe_changes(sent, mine, "strategy ", "this ClientApp ")
    if shown:
        raise ConfigError(f"{MISMATCH} the ServerApp's strategy sends other values than this ClientApp's run config "
                          f"sets ({shown}); a client acts on its own run config's values, so the strategy must send "
                          f"them (or drop the keys from the ClientApp's run config)")
