"""The privacy audit's canaries (:mod:`server.audit`): the records, the initial model and each trial's features.

* :class:`_Canaries`: white-box gradient canaries, one input coordinate per record, labels flipped at random;
  on :class:`CanaryModel` (linear) or, where the method's audit adapter asks (``mlp_canaries``), on
  :func:`canary_mlp`.
* :class:`_AdaptiveCanaries`: canaries whose label also moves a data-dependent noise scale (ladp's KL estimate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import Context
from flwr.clientapp import ClientApp
from torch import nn

from client.api import attach

#: Input dimension of the adaptive canaries' linear model (the noise scale is read from the other dim - 1).
ADAPTIVE_DIM = 64
#: Hidden width and output weights of the canary MLP (:func:`canary_mlp`).
MLP_HIDDEN = 4
MLP_OUT_WEIGHT = 0.5


class CanaryModel(nn.Module):
    """Bias-free linear classifier with 2 outputs: logits ``W x`` (state-dict key ``weight``, shape (2, d))."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2, bias=False)
        with torch.no_grad():
            self.linear.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.linear(x)


def canary_mlp(dim: int, hidden: int = MLP_HIDDEN, out_weight: float = MLP_OUT_WEIGHT) -> nn.Module:
    """The MP family's canary model: ``protocols.task.models.MLP(dim, [hidden], 2)``, every hidden unit active at 1.

    ``W1 = 0``, ``b1 = 1``, output rows ``+-out_weight`` and ``b2`` such that ``y_hat = (1/2, 1/2)``: for a
    record ``x = s e_k`` the true gradient on ``W1[:, k]`` is ``s W2^T (y_hat - onehot(y)) = -+ s out_weight``
    per hidden unit, its sign set by the label, in a column no other record touches.
    """
    from protocols.task.models import MLP

    m = MLP(dim, [hidden], 2)
    with torch.no_grad():
        m.layers[0].weight.zero_()
        m.layers[0].bias.fill_(1.0)
        m.layers[1].weight.copy_(torch.tensor([[out_weight] * hidden, [-out_weight] * hidden]))
        m.layers[1].bias.copy_(torch.tensor([0.5 - hidden * out_weight, 0.5 + hidden * out_weight]))
    return m


@dataclass
class _Canaries:
    """White-box gradient canaries of one release: client c holds ``scale e_k`` for k in its block, labels in {0, 1}.

    ``mlp``: the records train :func:`canary_mlp` (the MP family) instead of :class:`CanaryModel`; a record's
    coordinates are then its column of the first layer; ``zero_output``: that MLP's output layer is zero.
    ``zero_out``: a canary's secret bit says whether it is
    present (label 0) or its input is zero (no gradient: the zero-out neighbour); else the bit is its label.
    """

    clients: int
    per_client: int
    scale: float
    mlp: bool = False
    zero_out: bool = False
    zero_output: bool = False  # mlp: output layer (weights and bias) zero
    labels: np.ndarray = field(init=False)  # (clients * per_client,) in {0, 1}

    def __post_init__(self) -> None:
        self.dim = self.clients * self.per_client
        self.draw(np.random.default_rng())

    def draw(self, rng: np.random.Generator, direction: str = "upload") -> None:
        """Fresh labels for the next release (the canaries' secret values)."""
        self.labels = rng.integers(0, 2, size=self.dim)

    def model(self) -> nn.Module:
        """The initial global model (and the client's model skeleton)."""
        if not self.mlp:
            return CanaryModel(self.dim)
        m = canary_mlp(self.dim)
        if self.zero_output:
            with torch.no_grad():
                m.layers[-1].weight.zero_()
                m.layers[-1].bias.zero_()
        return m

    def data(self, client: int) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) of ``client``."""
        block = slice(client * self.per_client, (client + 1) * self.per_client)
        x = np.zeros((self.per_client, self.dim), dtype=np.float32)
        bits = self.labels[block]
        if self.zero_out:  # absent canaries: input 0, so no gradient on their own coordinates (the zero-out neighbour)
            x[np.arange(self.per_client), np.arange(block.start, block.stop)] = np.where(bits == 0, self.scale, 0.0)
            return x, np.zeros(self.per_client, dtype=np.int64)
        x[np.arange(self.per_client), np.arange(block.start, block.stop)] = self.scale
        return x, bits.astype(np.int64)

    def owner(self) -> np.ndarray:
        """The client holding each canary."""
        return np.repeat(np.arange(self.clients), self.per_client)

    def signs(self) -> np.ndarray:
        """+1 / -1 per trial (+1: label 0 or present, ``W[0]`` grows along ``v_k``)."""
        return np.where(self.labels == 0, 1, -1)

    def features(self, vectors: list[dict[str, np.ndarray]]) -> np.ndarray:
        """(trials, f): each canary's own coordinates in every view vector (state-dict arrays)."""
        if self.mlp:  # column k of the first layer (hidden entries)
            return np.concatenate([np.asarray(v["layers.0.weight"], dtype=np.float64).T for v in vectors], axis=1)
        return np.stack([_direction_scores(v["linear.weight"]) for v in vectors], axis=1)


@dataclass
class _AdaptiveCanaries:
    """Canaries for a data-dependent noise scale (ladp's KL-adaptive sigma): one trial per client upload.

    Every client holds two records at input ``scale e_0``: a fixed one (label 0) and the canary (label 0 or 1).
    At ``W = 0`` both clipped gradients are ``clip v_0``; with the canary at label 1 they cancel.  So the
    label moves the client's one full-batch step by ``lr clip`` along ``v_0``, the whole record sensitivity
    ``2 clip lr / 2``, and it also moves the layer's KL estimate between ``~0.5 / (2 dim)`` (canary at 0) and
    exactly 0 (at 1): ``P`` crosses ladp's whole ``[B / max-boost, B]`` range.  The statistic reads both
    the shift along ``v_0`` and the log mean square of the other coordinates (the noise scale).
    ``model`` view: client 0 holds the release's one canary, every other client its two records at label 0 (the
    neighbours differ in one record), one trial per release (the aggregate).
    """

    clients: int
    scale: float
    dim: int = ADAPTIVE_DIM
    per_client: int = 2
    shared: bool = False
    labels: np.ndarray = field(init=False)  # per client, in {0, 1}

    def __post_init__(self) -> None:
        self.draw(np.random.default_rng())

    def draw(self, rng: np.random.Generator, direction: str = "upload") -> None:
        """Fresh canary labels: one per client (``upload``) or client 0's alone, the others at 0 (``model``)."""
        self.shared = direction == "model"
        self.labels = rng.integers(0, 2, size=self.clients)
        if self.shared:
            self.labels[1:] = 0

    def model(self) -> nn.Module:
        return CanaryModel(self.dim)

    def data(self, client: int) -> tuple[np.ndarray, np.ndarray]:
        x = np.zeros((2, self.dim), dtype=np.float32)
        x[:, 0] = self.scale
        return x, np.array([0, self.labels[client]], dtype=np.int64)

    def owner(self) -> np.ndarray:
        return np.zeros(1 if self.shared else self.clients, dtype=np.int64)

    def signs(self) -> np.ndarray:
        lab = self.labels[:1] if self.shared else self.labels
        return np.where(lab == 0, 1, -1)

    def features(self, vectors: list[dict[str, np.ndarray]]) -> np.ndarray:
        """(trials, 2) per view vector: the shift along ``v_0`` and the log mean square of coordinates 1..dim-1."""
        rows = []
        for v in vectors:
            w = np.asarray(v["linear.weight"], dtype=np.float64).reshape(2, -1)
            rest = w[:, 1:]
            rows.append([(w[0, 0] - w[1, 0]) / math.sqrt(2.0), math.log(float(np.mean(rest * rest)) + 1e-300)])
        return np.asarray(rows)


def _client_app(canaries: _Canaries | _AdaptiveCanaries) -> ClientApp:
    """The stock handlers of the method on the canary model and this release's canaries."""
    def load(context: Context) -> tuple[nn.Module, np.ndarray, np.ndarray]:
        x, y = canaries.data(int(context.node_config["partition-id"]))
        return canaries.model(), x, y

    return attach(ClientApp(), load)


def _direction_scores(weight: np.ndarray) -> np.ndarray:
    """Per input coordinate k: the released weights projected on ``v_k`` (larger = label 0 more likely)."""
    w = np.asarray(weight, dtype=np.float64).reshape(2, -1)
    return (w[0] - w[1]) / math.sqrt(2.0)
