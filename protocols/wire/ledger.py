"""The privacy figures a client reports with every train reply: what its own ledger says it has spent.

``train`` client -> server (metrics, next to :func:`protocols.wire.common.train_metrics`):
:class:`SpentReport` -- the worst account of the node's persistent ledger
(:mod:`client.ledger`, over all runs, at the node's ``lifetime-delta``) after this
round's release, and the number of rounds this node trained in the run.  An
account without a guarantee (an un-noised upload) is reported as ``-1``
(metrics must stay finite JSON).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_EPSILON = "client-epsilon"
_RELEASES = "client-releases"


@dataclass(frozen=True)
class SpentReport:
    """``train`` reply metrics: lifetime epsilon spent by this node's data (``inf`` = no guarantee) and run rounds."""

    epsilon: float
    releases: int

    def to_metrics(self) -> dict[str, float]:
        """Figures to merge into the reply's metrics."""
        return {_EPSILON: float(self.epsilon) if math.isfinite(self.epsilon) else -1.0,
                _RELEASES: float(self.releases)}

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Any]) -> SpentReport | None:
        """The report a reply carries (None when it carries none)."""
        if _EPSILON not in metrics:
            return None
        eps = float(metrics[_EPSILON])
        return cls(math.inf if eps < 0 else eps, int(metrics.get(_RELEASES, 0)))
