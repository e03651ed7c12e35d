"""The fused MLP step equals the recorded layer-wise engine, drops non-finite examples, and is taken only where exact."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

from protocols.per_example import PerExampleClipper, cross_entropy, per_example_gradients, vmap_clipped_grad_sum
from protocols.per_example.fused_mlp import FusedMLP
from protocols.task.models import MLP
from protocols.task.training import clipped_sgd


class Recorded(MLP):
    """The same network under another class: it takes the recorded layer-wise path (the reference here)."""


def _pair(hidden: tuple[int, ...], seed: int, dtype=torch.float64) -> tuple[MLP, Recorded]:
    torch.manual_seed(seed)
    fused = MLP(64, hidden, 10).to(dtype)
    recorded = Recorded(64, hidden, 10).to(dtype)
    recorded.load_state_dict(fused.state_dict())
    return fused, recorded


def _batch(n: int, seed: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 8, 8, generator=gen, dtype=dtype) * 3, torch.randint(0, 10, (n,), generator=gen)


def _middle_clip(model: nn.Module, x: torch.Tensor, y: torch.Tensor, norm: str) -> float:
    """A clip between the two middle per-example norms: about half the batch clipped."""
    g = [t.reshape(len(y), -1) for t in per_example_gradients(model, x, y).values()]
    norms = sum((t * t).sum(1) for t in g).sqrt() if norm == "l2" else sum(t.abs().sum(1) for t in g)
    s = norms.sort().values
    return float(s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


@pytest.mark.parametrize("hidden", [(), (16,), (16, 8)])
@pytest.mark.parametrize("norm", ["l2", "l1"])
def test_the_fused_step_equals_the_layerwise_engine(hidden: tuple[int, ...], norm: str, caplog, monkeypatch) -> None:
    monkeypatch.setattr("protocols.per_example.clipper._logged", set())  # the path is logged once per process
    fused, recorded = _pair(hidden, 3)
    x, y = _batch(11, 4)
    clip = _middle_clip(recorded, x, y, norm)
    with caplog.at_level(logging.INFO, logger="protocols.per_example"):
        a, b = PerExampleClipper(fused, clip, norm=norm), PerExampleClipper(recorded, clip, norm=norm)
    assert a._fused is not None and b._fused is None
    assert "per-example clipping for MLP: fused MLP path" in caplog.text
    got, ref = a(x, y), b(x, y)
    assert 0 < got.clipped == ref.clipped < 11  # some clipped, some not: both branches of the scale
    torch.testing.assert_close(got.losses, ref.losses, rtol=1e-12, atol=0)
    for g, r in zip(got.grads, ref.grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    into = [torch.ones_like(p) for p in fused.parameters()]
    a.descend(x, y, 0.3, into=into)  # into buffers: the parameters stay
    a.descend(x, y, 0.3)
    b.descend(x, y, 0.3)
    for t, p, r, g in zip(into, fused.parameters(), recorded.parameters(), ref.grads, strict=True):
        torch.testing.assert_close(t, 1 - 0.3 * g, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(p, r, rtol=1e-10, atol=1e-12)
    b.close()


def test_a_non_finite_example_adds_nothing_on_the_fused_step() -> None:
    fused, recorded = _pair((16,), 5)
    x, y = _batch(8, 6)
    x[3, 0, 2, 2] = float("inf")
    got = PerExampleClipper(fused, 0.5)(x, y)
    keep = torch.arange(8) != 3
    alone = vmap_clipped_grad_sum(recorded, x[keep], y[keep], 0.5)
    assert got.losses[3] == 0 and all(torch.isfinite(g).all() for g in got.grads)
    assert got.clipped == alone.clipped + 1  # the dropped example counts as clipped
    for g, r in zip(got.grads, alone.grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_models_the_fused_step_does_not_cover_take_the_recorded_path() -> None:
    def built() -> MLP:
        return MLP(64, (16,), 10).double()

    assert FusedMLP.of(built(), "l2", cross_entropy) is not None
    assert FusedMLP.of(Recorded(64, (16,), 10), "l2", cross_entropy) is None  # a subclass may change forward
    assert FusedMLP.of(built(), "l2", lambda out, t: cross_entropy(out, t) * 2) is None  # another loss
    frozen = built()
    frozen.layers[0].bias.requires_grad_(False)
    assert FusedMLP.of(frozen, "l2", cross_entropy) is None
    hooked = built()
    hooked.layers[1].register_forward_hook(lambda m, i, o: o * 2)
    assert FusedMLP.of(hooked, "l2", cross_entropy) is None
    own = built()
    own.layers[0].forward = lambda t, _lin=own.layers[0]: nn.Linear.forward(_lin, t)
    assert FusedMLP.of(own, "l2", cross_entropy) is None
    biasless = built()
    biasless.layers[0] = nn.Linear(64, 16, bias=False).double()
    assert FusedMLP.of(biasless, "l2", cross_entropy) is None
    # whatever the path, the sums are the vmap reference's
    x, y = _batch(7, 8)
    for model in (frozen, hooked):
        got = PerExampleClipper(model, 0.3)(x, y)
        ref = vmap_clipped_grad_sum(model, x, y, 0.3)
        for g, r in zip(got.grads, ref.grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("recentre", [False, True])
def test_local_training_on_the_fused_step_follows_the_layerwise_engine(recentre: bool) -> None:
    """Two epochs of float32 client training: the fused and recorded engines end at the same model."""
    fused, recorded = _pair((32,), 9, torch.float32)
    rng = np.random.default_rng(10)
    x, y = rng.random((200, 64), dtype=np.float32), rng.integers(0, 10, 200)
    kw = dict(epochs=2, batch_size=16, lr=0.5, clip=2.0, seed=11, recentre=recentre)
    loss_a, frac_a = clipped_sgd(fused, x, y, **kw)
    loss_b, frac_b = clipped_sgd(recorded, x, y, **kw)
    assert frac_a == pytest.approx(frac_b) and 0 < frac_a < 1
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    for p, r in zip(fused.parameters(), recorded.parameters(), strict=True):
        assert p.dtype == r.dtype
        torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-5)
