"""Client-level releases (``privacy-unit = "client"``) against a server's tiny clip and learning rate.

The update is clipped by :func:`protocols.clipping.clip_l2` and noised with a std proportional to the clip, both in
float64.  These tests drive the real library client (:mod:`client.api`) on neighbouring datasets.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context
from flwr.clientapp import ClientApp
from torch import nn

from client.api import attach
from client.ledger import ClientLedger, ledger_dir
from client.records import to_record
from protocols.clipping import clip_l2
from protocols.config import RunConfig
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies.registry import build_strategy

FEATURES, CLASSES = 8, 3


def _norm(v: np.ndarray) -> float:
    """L2 norm that squaring does not underflow."""
    top = float(np.max(np.abs(v)))
    return top * float(np.linalg.norm(v / top)) if top > 0 else 0.0


@pytest.mark.parametrize(("entry", "bound"), [(1e-170, 1e-300), (1e-200, 1e-250), (1e-160, 1e-300), (1e37, 1e-300)])
def test_clip_l2_bounds_a_vector_whatever_its_magnitude(entry: float, bound: float) -> None:
    """The clipped vector has norm ``bound`` along the vector's direction; the reported norm is the vector's.

    Measured with ``sqrt(sum of squares)``: entries of ``1e-170`` square to 0, the norm read 0 and the vector came
    back unclipped, 3.2e131 times a bound of ``1e-300``; at ``1e37`` the factor ``bound / norm`` rounded to 0.
    """
    vector = np.full(1000, entry) * np.linspace(0.5, 1.5, 1000)
    clipped, norm = clip_l2(vector, bound)
    assert norm == pytest.approx(_norm(vector), rel=1e-12)
    assert _norm(clipped) == pytest.approx(bound, rel=1e-12)
    np.testing.assert_allclose(clipped / bound, vector / _norm(vector), rtol=1e-12)


class _Net(nn.Module):
    """A user's model: one linear layer, in ``dtype``."""

    dtype = torch.float64

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(FEATURES, CLASSES).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@pytest.mark.parametrize("method", ["ldp", "cdp"])
@pytest.mark.parametrize(("dtype", "lr", "clip", "epsilon"), [
    (torch.float64, 1e-170, 1e-300, 1.0),  # the update's squares underflow: it went out unclipped
    (torch.float32, 0.1, 5e-324, 50.0),  # a noise std below half of float64's subnormal step: noise 0
])
def test_client_level_release_at_a_clip_float64_does_not_resolve_is_refused_before_training(
        method, dtype, lr, clip, epsilon, tmp_path, monkeypatch) -> None:
    """A server's clip below float64's :func:`protocols.privacy.smallest_resolvable`: refused, nothing trained or charged.

    From a zero model (the server's), a float64 model's update at ``lr = 1e-170`` has entries ``~1e-171``, whose
    squares round to 0.  Measured without the rule (ldp, real noise): the uploads of two datasets one record apart
    differed by 7.1e128 times the clip (``1e-300``), the noise ``~6e-300`` invisible, while the ledger charged a
    finite epsilon (1.34).  At clip ``5e-324`` (epsilon 50, multiplier 0.22) the noise std rounded to 0 and every
    upload left unnoised.
    """
    import protocols.task.training as training

    monkeypatch.setattr(_Net, "dtype", dtype)
    trained: list[int] = []
    real_train = training.train
    monkeypatch.setattr(training, "train", lambda *a, **k: trained.append(1) or real_train(*a, **k))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, FEATURES)).astype(np.float32), rng.integers(0, CLASSES, 40)

    def load(context: Context) -> tuple[nn.Module, np.ndarray, np.ndarray]:
        return _Net(), x, y

    raw = {**app_defaults(), "method": method, "num-clients": 2, "num-rounds": 2, "epsilon": epsilon,
           "privacy-unit": "client", "lr": lr, "clip": clip, "local-epochs": 1, "batch-size": 40}
    strategy = build_strategy(RunConfig.from_mapping(raw))
    zero = {k: np.zeros(v.shape) for k, v in _Net().state_dict().items()}
    grid = LocalGrid(attach(ClientApp(), load), 2, {"method": method}, node_config={"ledger-dir": str(tmp_path)})
    msgs = list(strategy.configure_train(1, to_record(zero, np.float64), ConfigRecord({"round": 1}), grid))
    reply = list(grid.send_and_receive(msgs[:1]))[0]
    assert reply.has_error() and "refusing the round: clip" in reply.error.reason, reply.content
    assert not trained
    with ClientLedger.open(ledger_dir(grid.contexts[grid.node_ids[0]].node_config), 0, write=False) as led:
        assert led.spent(1e-5) == {}
