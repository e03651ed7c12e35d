"""Run-config ``num-clients = "auto"`` on a federation whose size is known: the run takes that size.

Server and clients derive the same configuration: the server from the nodes it sees (Flower's
simulation: its SuperNodes; deployment: the nodes' ``num-partitions``), each client from its own node
config's ``num-partitions``.  A ``num-clients`` the user set is never replaced.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from protocols.config import RunConfig
from protocols.methods import AUTO

#: The run-config key that "auto" fits to the federation.
KEY = "num-clients"


def num_clients_left_auto(run_config: Mapping[str, Any]) -> bool:
    """True when run-config ``num-clients`` is ``"auto"`` (the app's default) or absent."""
    value = run_config.get(KEY, AUTO)
    return isinstance(value, str) and value.strip().lower() == AUTO


def fitted(run_config: Mapping[str, Any], num_partitions: int, *, strict: bool = True, **changes: Any) -> RunConfig:
    """``run_config`` with ``num-clients = num_partitions``, every other "auto" key resolved as before.

    Args:
        run_config: the run's run config (kebab-case keys), ``num-clients`` left "auto".
        num_partitions: the federation's size (its nodes' ``num-partitions``).
        strict: as in :meth:`RunConfig.from_mapping` (clients pass False).
        changes: further run-config keys to set (the server passes its resolved ``out-dir``).

    Returns:
        The validated run config.

    Raises:
        ConfigError: the method cannot run with ``num_partitions`` clients (the message names the key).
    """
    return RunConfig.from_mapping({**run_config, KEY: num_partitions, **changes}, strict=strict)
