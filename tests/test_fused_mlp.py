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


# --------------------------------------------------------------------------- the guarantee on crafted models
def _crafted(kind: str, dtype: torch.dtype, seed: int = 0) -> MLP:
    """A model a server may send (finite weights, norm within what the client trains) built to stress one formula.

    ``saturated``: hidden unit 0 is ``relu(1e9)``, the output layer's weight 0 and its bias ``-gap`` but on class 0,
    so a class-0 record's output delta is ``~e^-gap`` (its square rounds to 0) and its weight gradient
    ``d a^T`` of norm ``~1e-14`` (float32) / ``~1e-73`` (float64).  ``huge``: random weights times 1e3 (the softmax
    saturates, logits ``~1e9``).  ``bright``: two pixels' weights ``3e38`` and the biases ``-1e38``: the hidden
    units of the record bright on both overflow float32 (it is dropped), the others' are 0.  ``dead``: every hidden
    unit below 0.  ``logits``: output biases ``+-1e30``.  ``plain``: the seeded initialisation.
    """
    torch.manual_seed(seed)
    model = MLP(64, (8, 6), 10).to(dtype)
    with torch.no_grad():
        if kind == "saturated":
            gap = 54.0 if dtype == torch.float32 else 400.0
            for p in model.parameters():
                p.zero_()
            model.layers[0].bias[0] = model.layers[1].bias[0] = 5e8 if dtype == torch.float32 else 1e100
            model.layers[1].weight[0, 0] = 1.0
            model.layers[2].bias[1:] = -gap
        elif kind == "huge":
            for p in model.parameters():
                p.mul_(1e3)
        elif kind == "bright":
            model.layers[0].weight[:, 5:7], model.layers[0].bias[:] = 3e38, -1e38
        elif kind == "dead":
            model.layers[0].bias.fill_(-1e3)
        elif kind == "logits":
            model.layers[2].bias.copy_(torch.tensor([1e30, -1e30] * 5))
    return model


def _data(n: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 8, 8, generator=gen, dtype=dtype)
    x.view(n, -1)[:, 5:7] = 0.0
    x.view(n, -1)[0, 5:7] = 1.0  # pixels 5 and 6: only record 0 has them
    y = torch.randint(0, 10, (n,), generator=gen)
    y[0] = 0
    return x, y


def _step(make, x: torch.Tensor, y: torch.Tensor, clip: float, step: float, **kw) -> torch.Tensor:
    """``-step * sum_i clip(g_i)`` of the real clipper, flattened (into zero buffers: exact at any model norm)."""
    model = make()
    into = [torch.zeros_like(p) for p in model.parameters()]
    with PerExampleClipper(model, clip, **kw) as clipper:
        clipper.descend(x, y, step, into=into)
    return torch.cat([t.double().flatten() for t in into])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["saturated", "huge", "bright", "dead", "logits", "plain"])
def test_one_record_moves_a_fused_step_by_at_most_two_clips(kind: str, dtype: torch.dtype) -> None:
    """One record moves a step of the real clipper by at most ``2 clip step`` on a model a server may send.

    Neighbouring batches (record 0 replaced), tiny to huge clips, batches of 7 and 1: the step stays finite and
    equals the layer-wise engine's and the vmap reference's.

    ``saturated`` measured without :func:`protocols.per_example.norms.outer_norms_sq` (``|d|^2`` rounding to 0, the
    class-0 record entering unclipped): the step moved by 5.4 (float32) and 58 (float64) times ``2 clip step``.
    """
    x, y = _data(7, dtype)
    xr, yr = x.clone(), y.clone()
    xr[0], yr[0] = x[3], 1
    x0, y0 = x.clone(), y.clone()
    tiny = 1e-15 if dtype == torch.float32 else 1e-75
    for clip in (tiny, 1.0, 1e6):
        for n in (7, 1):
            step = 0.3 / n
            got = _step(lambda: _crafted(kind, dtype), x[:n], y[:n], clip, step)
            other = _step(lambda: _crafted(kind, dtype), xr[:n], yr[:n], clip, step)
            assert torch.isfinite(got).all() and torch.isfinite(other).all()
            moved = float((got - other).norm())
            assert moved <= 2 * clip * step * (1 + 1e-5), (kind, clip, n, moved / (2 * clip * step))
            layerwise = _step(lambda: _crafted(kind, dtype), x[:n], y[:n], clip, step, fused=False)
            ref = vmap_clipped_grad_sum(_crafted(kind, dtype), x[:n], y[:n], clip)
            ref = torch.cat([g.double().flatten() for g in ref.grads]) * -step
            sums = PerExampleClipper(_crafted(kind, dtype), clip)(x[:n], y[:n]).grads
            for other_engine in (layerwise, ref, torch.cat([g.double().flatten() for g in sums]) * -step):
                torch.testing.assert_close(got, other_engine, rtol=1e-4, atol=1e-5 * clip * step)
    assert torch.equal(x, x0) and torch.equal(y, y0)  # nothing the caller passes is written to


@pytest.mark.parametrize("recentre", [False, True])
@pytest.mark.parametrize("kind", ["saturated", "huge", "plain"])
def test_one_record_moves_fused_local_training_by_at_most_its_sensitivity(kind: str, recentre: bool) -> None:
    """Two epochs of batches of 3 on 7 records (the last batch smaller), neighbours one record apart."""
    from protocols.privacy import local_sgd_sensitivity

    x, y = _data(7, torch.float64)
    xr, yr = x.clone(), y.clone()
    xr[0], yr[0] = x[3], 1
    clip, lr = 1e-3, 0.5
    out = []
    for xs, ys in ((x, y), (xr, yr)):
        model = _crafted(kind, torch.float32)
        start = torch.cat([p.detach().double().flatten() for p in model.parameters()])
        clipped_sgd(model, xs.float().numpy(), ys.numpy(), epochs=2, batch_size=3, lr=lr, clip=clip, seed=4,
                    recentre=recentre)
        out.append(torch.cat([p.detach().double().flatten() for p in model.parameters()]) - start)
    assert all(torch.isfinite(o).all() for o in out)
    bound = local_sgd_sensitivity(clip, 7, lr=lr, epochs=2, batch_size=3, adjacency="replace-one")
    slack = 0.0 if recentre else 8 * 2.0 ** -24 * float(start.abs().max())  # float32 weights round the steps
    assert float((out[0] - out[1]).norm()) <= bound * (1 + 1e-5) + slack


def test_a_tiny_output_gradient_times_a_large_input_is_clipped_by_every_closed_form() -> None:
    """``|d|^2`` underflows while ``|d| |a|`` does not: Linear with and without bias, and a conv's ghost norm."""

    class Conv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.c2, self.fc = nn.Conv2d(1, 2, 3, padding=1), nn.Conv2d(2, 16, 8), nn.Linear(16, 10)

        def forward(self, t: torch.Tensor) -> torch.Tensor:  # c2: one position, 16 channels: the ghost norm
            return self.fc(self.c2(torch.relu(self.c1(t))).flatten(1))

    conv = Conv()
    bare = nn.Sequential(nn.Flatten(), nn.Linear(64, 8, bias=False), nn.ReLU(), nn.Linear(8, 10, bias=False))
    with torch.no_grad():
        for p in conv.parameters():
            p.zero_()
        conv.c1.bias[0], conv.c2.bias[:], conv.fc.weight[:], conv.fc.bias[1:] = 1e12, 1.0, 1.0, -60.0
        bare[1].weight.fill_(1e6)  # every hidden unit 3.2e7 on x = 0.5
        bare[3].weight.zero_()
        bare[3].weight[1:, 0] = -54 / 3.2e7  # class 0 saturates: d ~ e^-54, |d| |a| ~ 1e-15
    x, y = torch.full((3, 1, 8, 8), 0.5), torch.zeros(3, dtype=torch.long)
    x[:, 0, 0, 0] = torch.rand(3)
    for model in (conv, bare, _crafted("saturated", torch.float32)):
        for fused in (True, False):
            got = float(_step(lambda m=model: m, x, y, 1e-16, 1.0, fused=fused).norm())
            assert 2.9e-16 <= got <= 3e-16 * (1 + 1e-5), (type(model).__name__, fused, got / 1e-16)  # 3 clipped
