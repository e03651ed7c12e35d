"""Client-level releases (``privacy-unit = "client"``) against a server's tiny clip, learning rate or huge model.

The update is clipped by :func:`protocols.clipping.clip_l2` and noised with a std proportional to the clip, both in
float64, before the received model is added.  These tests drive the real library client (:mod:`client.api`) on
neighbouring datasets.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context
from flwr.clientapp import ClientApp
from torch import nn

import protocols.niss as niss_math
from client.api import attach
from client.ledger import ClientLedger, ledger_dir
from client.records import to_record
from protocols.arrays import flatten
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


def test_niss_upload_on_a_huge_model_moves_by_the_sensitivity_plus_the_noised_values_rounding(tmp_path,
                                                                                               monkeypatch) -> None:
    """NISS (client level) on a model of crafted magnitudes: the uploads move by ``p clip`` plus the final rounding.

    A server that knows a target record sets every feature's weights (all classes alike: the softmax is unchanged)
    near ``2^52`` times the target's clipped update there, so float64's spacing at ``p g`` is just above ``p |u|``:
    ``p (g + u)`` rounds each coordinate of the bare update up to about twice its size.  The noise is replaced by
    16 values evenly spread across one spacing (one per client, all clients holding the same record): their mean
    stands for the average over any noise smooth at that scale (the real std is 5.2 times the largest spacing).
    Averaged over them, the upload of a client holding the target record (update of norm ``clip``) and of one whose
    record trains to a zero update differ by the weighted update plus at most ``spacing / 16`` per coordinate
    (here 0.999 times the charged sensitivity ``p clip``, the bound 1.11).  Measured with the model added before
    the noise: 1.39 times (the update rounded before any noise, the same for every noise value).
    """
    clients, clip, lr = 16, 2.0 ** -4, 0.5
    rng = np.random.default_rng(5)
    target = rng.normal(size=(1, FEATURES)).astype(np.float32)
    start = {k: v.detach().numpy().astype(np.float64) for k, v in _Net().state_dict().items()}
    start["fc.bias"] = np.array([60.0, 0.0, 0.0])  # every record is class 0 with certainty: the target's label is 1
    # The target's clipped update: -lr (1, -1, 0) x (x, 1), scaled to norm clip; per feature the entries' size.
    column = clip * np.abs(np.append(target[0], 1.0)) / np.sqrt(2.0 * (float(np.sum(target[0] ** 2.0)) + 1.0))
    offset = 2.0 ** (np.ceil(np.log2(column)) + 52) * 1.0001  # spacing 2^ceil(log2 |u|): |u| rounds up to it
    g = {"fc.weight": start["fc.weight"] + offset[:FEATURES], "fc.bias": start["fc.bias"] + offset[FEATURES]}
    p = 1.0 / clients
    spacing = np.spacing(p * np.abs(flatten(g)))
    raw = {**app_defaults(), "method": "niss", "num-clients": clients, "num-rounds": 2, "epsilon": 4.0,
           "privacy-unit": "client", "lr": lr, "clip": clip, "local-epochs": 1, "batch-size": 1, "self-mask": False}
    order: list[int] = []

    def dither(bundles, size: int) -> np.ndarray:  # the sender's noise: its own point across one spacing
        k = order.index(bundles[0].sender)
        return ((k + 0.5) / clients - 0.5) * spacing

    monkeypatch.setattr(niss_math, "sender_noise", dither)
    monkeypatch.setattr("protocols.prg.gaussian_many", lambda seeds, size, sigma=1.0: (np.zeros(size) for _ in seeds))
    mean_upload = []
    for x, y in ((target, np.array([1])), (np.zeros((1, FEATURES), np.float32), np.array([0]))):
        grid = LocalGrid(attach(ClientApp(), lambda context, x=x, y=y: (_Net(), x, y)), clients, {"method": "niss"},
                         node_config={"ledger-dir": str(tmp_path / str(len(mean_upload)))})
        order[:] = sorted(grid.node_ids)
        strategy = build_strategy(RunConfig.from_mapping(raw))
        msgs = list(strategy.configure_train(1, to_record(g, np.float64), ConfigRecord({"round": 1}), grid))
        replies = list(grid.send_and_receive(msgs))
        assert len(replies) == clients and not any(r.has_error() for r in replies)
        # each upload less p g (exact: they lie within a spacing or two): the mean of the huge values would round
        mean_upload.append(np.mean([flatten({k: a.numpy() for k, a in r.content["arrays"].items()}) - p * flatten(g)
                                    for r in replies], axis=0))
        sigma = float(replies[0].content["metrics"]["niss-sigma"])
    assert sigma > 4 * float(np.max(spacing))  # the real noise is resolved on the model's grid
    moved = float(np.linalg.norm(mean_upload[0] - mean_upload[1]))
    assert moved <= p * clip + float(np.linalg.norm(spacing)) / clients, moved / (p * clip)
