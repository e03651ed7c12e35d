"""The federation check: the ServerApp asks a node what federation its node config describes.

``query.federation`` (empty content) is answered with the node's ``num-partitions`` and
``partition-id`` (:class:`FederationInfo`).  A node that was started for another federation size
than the run's ``num-clients`` would train on the wrong share of the data, so the ServerApp stops
before the first round and names the command that fixes it (:mod:`server.federation`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protocols.node_config import NUM_PARTITIONS as _NUM_PARTITIONS
from protocols.node_config import PARTITION_ID as _PARTITION_ID
from protocols.options import ConfigError
from protocols.wire.common import read_int

#: The query action (message type ``query.federation``).
ACTION = "federation"


@dataclass(frozen=True)
class FederationInfo:
    """What one node's node config says about the federation."""

    num_partitions: int
    partition_id: int

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> FederationInfo:
        """Read Flower's node config (simulation sets both keys; a SuperNode gets them from ``--node-config``).

        Raises ConfigError (a public refusal naming the keys) when either is missing, ValueError when not an integer.
        """
        try:
            return cls(int(node_config[_NUM_PARTITIONS]), int(node_config[_PARTITION_ID]))
        except KeyError as err:
            raise ConfigError("node config needs 'partition-id' and 'num-partitions' "
                             "(flower-supernode --node-config 'partition-id=0 num-partitions=N')") from err

    def to_config(self) -> dict[str, Any]:
        """The reply's ``"config"`` record."""
        return {_NUM_PARTITIONS: self.num_partitions, _PARTITION_ID: self.partition_id}

    @classmethod
    def from_content(cls, content: Mapping[str, Any]) -> FederationInfo:
        """Decode a reply (ValueError naming the missing or bad key)."""
        rec = content["config"]
        return cls(read_int(rec, _NUM_PARTITIONS, minimum=1), read_int(rec, _PARTITION_ID, minimum=0))
