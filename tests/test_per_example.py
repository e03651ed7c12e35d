"""Per-example clipping: every layer-wise fast path equals the vmap reference, and the vmap reference equals a loop."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from torch import nn

from protocols.ddpsa import l1_clip
from protocols.per_example import (
    PerExampleClipper,
    clipped_grad_sum,
    cross_entropy,
    fast_path_blocker,
    per_example_gradients,
    vmap_clipped_grad_sum,
)
from protocols.task.models import MLP, SmallCNN, build_model

RTOL = 1e-6


@pytest.fixture(autouse=True)
def _float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _norms(model: nn.Module, x: torch.Tensor, y: torch.Tensor, norm: str) -> torch.Tensor:
    g = [t.reshape(len(y), -1) for t in per_example_gradients(model, x, y).values()]
    return sum((t * t).sum(1) for t in g).sqrt() if norm == "l2" else sum(t.abs().sum(1) for t in g)


def _middle_clip(norms: torch.Tensor) -> float:
    """A clip halfway between two middle norms: about half the examples clipped, none on the boundary."""
    s = norms.sort().values
    mid = len(s) // 2
    return float(s[mid - 1] + s[mid]) / 2


def _assert_same(got, ref) -> None:
    assert got.clipped == ref.clipped
    torch.testing.assert_close(got.losses, ref.losses, rtol=RTOL, atol=0)
    assert len(got.grads) == len(ref.grads)
    for a, b in zip(got.grads, ref.grads, strict=True):
        assert a.shape == b.shape
        assert float((a - b).norm() / b.norm()) <= RTOL


def _zoo() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    return {"mlp": (build_model("mlp", (1, 28, 28), 10, (128,), 1).double(), (1, 28, 28)),
            "cnn": (build_model("cnn", (1, 28, 28), 10, seed=2).double(), (1, 28, 28))}


@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("norm", ["l2", "l1"])
def test_zoo_fast_path_equals_vmap_reference(name: str, norm: str) -> None:
    model, shape = _zoo()[name]
    assert fast_path_blocker(model) is None
    gen = torch.Generator().manual_seed(3)
    x, y = torch.rand(24, *shape, generator=gen), torch.randint(0, 10, (24,), generator=gen)
    norms = _norms(model, x, y, norm)
    clip = _middle_clip(norms)
    result = clipped_grad_sum(model, x, y, clip, norm=norm)
    _assert_same(result, vmap_clipped_grad_sum(model, x, y, clip, norm=norm))
    assert result.clipped == int((norms > clip).sum()) and 0 < result.clipped < 24  # clipped and unclipped examples
    # unclipped: the plain gradient of the summed loss
    plain = clipped_grad_sum(model, x, y, math.inf, norm=norm)
    assert plain.clipped == 0
    model.zero_grad()
    cross_entropy(model(x), y).sum().backward()
    for g, p in zip(plain.grads, model.parameters(), strict=True):
        assert float((g - p.grad).norm() / p.grad.norm()) <= RTOL
    # a batch of one, clipped and not
    for c in (0.5 * float(norms[0]), 2.0 * float(norms[0])):
        one = clipped_grad_sum(model, x[:1], y[:1], c, norm=norm)
        _assert_same(one, vmap_clipped_grad_sum(model, x[:1], y[:1], c, norm=norm))
        assert one.clipped == int(norms[0] > c)


@pytest.mark.parametrize("norm", ["l2", "l1"])
def test_clipped_sum_matches_a_loop_of_single_example_backward_passes(norm: str) -> None:
    """Independent of torch.func: clip each example's flattened gradient (numpy l1_clip for L1) and sum."""
    model = build_model("cnn", (1, 8, 8), 10, seed=4).double()
    gen = torch.Generator().manual_seed(5)
    x, y = torch.rand(9, 1, 8, 8, generator=gen), torch.randint(0, 10, (9,), generator=gen)
    flat = []
    for i in range(9):
        model.zero_grad()
        cross_entropy(model(x[i:i + 1]), y[i:i + 1]).sum().backward()
        flat.append(np.concatenate([p.grad.numpy().ravel() for p in model.parameters()]))
    flat = np.stack(flat)
    clip = _middle_clip(torch.from_numpy(np.abs(flat).sum(1) if norm == "l1" else np.linalg.norm(flat, axis=1)))
    if norm == "l1":
        expected = l1_clip(flat, clip).sum(0)
    else:
        expected = (flat / np.maximum(1.0, np.linalg.norm(flat, axis=1) / clip)[:, None]).sum(0)
    got = clipped_grad_sum(model, x, y, clip, norm=norm)
    vec = np.concatenate([g.numpy().ravel() for g in got.grads])
    np.testing.assert_allclose(vec, expected, rtol=1e-10, atol=1e-13)
    bound = np.abs(vec).sum() if norm == "l1" else np.linalg.norm(vec)
    assert bound <= 9 * clip * (1 + 1e-12)


class _Layers(nn.Module):
    """Every fast path beyond the zoo: strided, dilated, grouped, padded convs, a ghost-norm conv, a sequence Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 8, 3, stride=2, padding=1, dilation=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding="same", dilation=2, groups=4, padding_mode="reflect")
        self.c3 = nn.Conv2d(8, 16, (3, 2), stride=3, bias=False)  # output 2x2: L (K + O) < O K, the ghost norm
        self.seq1 = nn.Linear(16, 12)  # over a (B, 4, 16) sequence: ghost norm (T (K + O) < O K)
        self.seq2 = nn.Linear(12, 5, bias=False)  # over (B, 4, 12): materialised per-example gradient
        self.head = nn.Linear(20, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.c2(torch.relu(self.c1(x))))
        h = torch.relu(self.c3(h)).flatten(2).transpose(1, 2)
        return self.head(self.seq2(torch.sigmoid(self.seq1(h))).flatten(1))


def test_every_fast_path_equals_vmap_reference_for_both_norms() -> None:
    model = _Layers()
    gen = torch.Generator().manual_seed(6)
    x, y = torch.randn(7, 2, 13, 13, generator=gen), torch.randint(0, 3, (7,), generator=gen)
    assert fast_path_blocker(model) is None
    for norm in ("l2", "l1"):
        clip = _middle_clip(_norms(model, x, y, norm))
        result = clipped_grad_sum(model, x, y, clip, norm=norm)
        assert 0 < result.clipped < 7
        _assert_same(result, vmap_clipped_grad_sum(model, x, y, clip, norm=norm))
        _assert_same(clipped_grad_sum(model, x[:1], y[:1], clip, norm=norm),
                     vmap_clipped_grad_sum(model, x[:1], y[:1], clip, norm=norm))


def test_frozen_parameters_get_zero_gradients_and_do_not_count() -> None:
    model = build_model("cnn", (1, 8, 8), 10, seed=7).double()
    model.conv1.weight.requires_grad_(False)
    model.fc.bias.requires_grad_(False)
    gen = torch.Generator().manual_seed(8)
    x, y = torch.rand(6, 1, 8, 8, generator=gen), torch.randint(0, 10, (6,), generator=gen)
    for norm in ("l2", "l1"):
        clip = _middle_clip(_norms(model, x, y, norm))
        result = clipped_grad_sum(model, x, y, clip, norm=norm)
        ref = vmap_clipped_grad_sum(model, x, y, clip, norm=norm)
        assert not result.grads[0].any() and not result.grads[-1].any()
        assert result.clipped == ref.clipped and 0 < result.clipped < 6
        for a, b, p in zip(result.grads, ref.grads, model.parameters(), strict=True):
            if p.requires_grad:
                assert float((a - b).norm() / b.norm()) <= RTOL


def test_custom_per_example_loss() -> None:
    model = build_model("mlp", (1, 8, 8), 4, (6,), 9).double()
    gen = torch.Generator().manual_seed(10)
    x, y = torch.rand(5, 1, 8, 8, generator=gen), torch.rand(5, 4, generator=gen)

    def squared(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).sum(1)

    for norm in ("l2", "l1"):
        _assert_same(clipped_grad_sum(model, x, y, 0.3, norm=norm, loss=squared),
                     vmap_clipped_grad_sum(model, x, y, 0.3, norm=norm, loss=squared))
    with pytest.raises(ValueError, match="one value per example"):
        clipped_grad_sum(model, x, y, 0.3, loss=lambda out, t: squared(out, t).sum())


def test_in_place_activation_keeps_the_fast_path_exact(caplog) -> None:
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(5, 7), nn.Linear(7, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(nn.functional.relu(self.a(x), inplace=True))

    model = InPlace()
    x, y = torch.randn(6, 5, generator=torch.Generator().manual_seed(11)), torch.tensor([0, 1, 2, 0, 1, 2])
    with caplog.at_level(logging.INFO, logger="protocols.per_example"):
        result = clipped_grad_sum(model, x, y, 0.5, norm="l1")
    assert "InPlace: layer-wise path" in caplog.text
    _assert_same(result, vmap_clipped_grad_sum(model, x, y, 0.5, norm="l1"))


def test_path_selection_is_logged_once_per_model_class(caplog) -> None:
    class Net(MLP):
        pass

    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.norm = nn.Linear(4, 3), nn.LayerNorm(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.lin(x))

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(torch.tanh(self.lin(x)))

    x, y = torch.randn(3, 4), torch.tensor([0, 1, 2])
    with caplog.at_level(logging.INFO, logger="protocols.per_example"):
        fast = Net(4, [5], 3)
        clipped_grad_sum(fast, x, y, 1.0)
        clipped_grad_sum(fast, x, y, 1.0, norm="l1")
        normed = Normed()
        _assert_same(clipped_grad_sum(normed, x, y, 0.1), vmap_clipped_grad_sum(normed, x, y, 0.1))
        twice = Twice()
        _assert_same(clipped_grad_sum(twice, x, y, 0.1, norm="l1"), vmap_clipped_grad_sum(twice, x, y, 0.1, norm="l1"))
    messages = [r.getMessage() for r in caplog.records]
    assert messages.count("per-example clipping for Net: layer-wise path") == 1
    assert fast_path_blocker(normed) == "LayerNorm 'norm' has no fast path"
    assert "per-example clipping for Normed: vmap (LayerNorm 'norm' has no fast path) path" in messages
    assert "per-example clipping for Twice: vmap (layer Linear ran 2 times in one forward) path" in messages


def test_per_example_gradients_match_a_loop_and_reject_bad_arguments() -> None:
    model = SmallCNN(1, 8, 10).double()
    gen = torch.Generator().manual_seed(12)
    x, y = torch.rand(4, 1, 8, 8, generator=gen), torch.randint(0, 10, (4,), generator=gen)
    per_example = per_example_gradients(model, x, y)
    assert list(per_example) == [n for n, _ in model.named_parameters()]
    for i in range(4):
        model.zero_grad()
        cross_entropy(model(x[i:i + 1]), y[i:i + 1]).sum().backward()
        for (name, p) in model.named_parameters():
            torch.testing.assert_close(per_example[name][i], p.grad)
    for bad in ({"clip": 0.0}, {"norm": "linf"}):
        with pytest.raises(ValueError):
            clipped_grad_sum(model, x, y, **{"clip": 1.0, **bad})
    with pytest.raises(ValueError):
        clipped_grad_sum(model, x[:0], y[:0], 1.0)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        clipped_grad_sum(model, x, y, 1.0)


def test_float32_model_gets_float32_sums_close_to_float64() -> None:
    model = build_model("cnn", (1, 8, 8), 10, seed=13)
    gen = torch.Generator().manual_seed(14)
    x, y = torch.rand(10, 1, 8, 8, generator=gen), torch.randint(0, 10, (10,), generator=gen)
    for norm in ("l2", "l1"):
        single = clipped_grad_sum(model.float(), x.float(), y, 0.5, norm=norm)
        double = clipped_grad_sum(model.double(), x, y, 0.5, norm=norm)
        assert all(g.dtype == torch.float32 for g in single.grads) and single.clipped == double.clipped
        for a, b in zip(single.grads, double.grads, strict=True):
            assert float((a.double() - b).norm() / b.norm()) < 1e-5


def _descend_matches_clipped_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float, norm: str) -> None:
    """``descend(step)`` moves every parameter by ``-step`` times the reference clipped sum; same losses and count.

    With ``into``, the buffers receive that move (added to what they hold) and the parameters stay as they are.
    """
    ref = vmap_clipped_grad_sum(model, x, y, clip, norm=norm)
    before = [p.detach().clone() for p in model.parameters()]
    with PerExampleClipper(model, clip, norm=norm) as clipper:
        into = [torch.ones_like(p) for p in model.parameters()]
        into_step = clipper.descend(x, y, 0.3, into=into)
        assert all(torch.equal(p, p0) for p, p0 in zip(model.parameters(), before, strict=True))
        for p, t, g in zip(model.parameters(), into, ref.grads, strict=True):
            if not p.requires_grad:
                assert torch.equal(t, torch.ones_like(p))
            else:
                assert float((t - 1 + 0.3 * g).norm() / (0.3 * g).norm()) <= RTOL
        step = clipper.descend(x, y, 0.3)
    assert int(into_step.clipped) == ref.clipped
    assert int(step.clipped) == ref.clipped
    torch.testing.assert_close(step.losses, ref.losses, rtol=RTOL, atol=0)
    for p, p0, g in zip(model.parameters(), before, ref.grads, strict=True):
        moved = p.detach() - p0
        if not p.requires_grad:
            assert not moved.any()
        else:
            assert float((moved + 0.3 * g).norm() / (0.3 * g).norm()) <= RTOL


@pytest.mark.parametrize("norm", ["l2", "l1"])
def test_descend_is_one_step_of_the_clipped_sum(norm: str) -> None:
    gen = torch.Generator().manual_seed(15)
    for model, shape in _zoo().values():
        x, y = torch.rand(12, *shape, generator=gen), torch.randint(0, 10, (12,), generator=gen)
        clip = _middle_clip(_norms(model, x, y, norm))
        _descend_matches_clipped_sum(model, x, y, clip, norm)
    frozen = build_model("mlp", (1, 8, 8), 10, (16,), 16).double()
    frozen.layers[0].bias.requires_grad_(False)
    frozen.layers[1].weight.requires_grad_(False)
    x, y = torch.rand(9, 1, 8, 8, generator=gen), torch.randint(0, 10, (9,), generator=gen)
    _descend_matches_clipped_sum(frozen, x, y, _middle_clip(_norms(frozen, x, y, norm)), norm)
    layers = _Layers()  # conv and sequence forms
    x, y = torch.randn(7, 2, 13, 13, generator=gen), torch.randint(0, 3, (7,), generator=gen)
    _descend_matches_clipped_sum(layers, x, y, _middle_clip(_norms(layers, x, y, norm)), norm)


def test_descend_on_the_vmap_path_and_the_layers_get_their_forward_back_nested() -> None:
    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.norm = nn.Linear(4, 3), nn.LayerNorm(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.lin(x))

    gen = torch.Generator().manual_seed(17)
    x, y = torch.randn(6, 4, generator=gen), torch.tensor([0, 1, 2, 0, 1, 2])
    _descend_matches_clipped_sum(Normed(), x, y, 0.2, "l2")
    class Recorded(MLP):  # a subclass of the built-in MLP takes the recorded layer-wise path, not the fused one
        pass

    torch.manual_seed(18)
    model = Recorded(64, (16,), 10).double()
    xs = torch.rand(5, 1, 8, 8, generator=gen)
    plain = model(xs)
    ys = torch.arange(5)
    with PerExampleClipper(model, 1.0) as clipper:
        assert all("forward" in vars(m) for m in model.layers)
        torch.testing.assert_close(model(xs), plain, rtol=0, atol=0)  # unrecorded outside a step, same output
        _assert_same(clipped_grad_sum(model, xs, ys, 0.1), vmap_clipped_grad_sum(model, xs, ys, 0.1))  # nested
        _assert_same(clipper(xs, ys), vmap_clipped_grad_sum(model, xs, ys, 1.0))  # still recording after it
    assert not any("forward" in vars(m) for m in model.layers)
    torch.testing.assert_close(model(xs), plain, rtol=0, atol=0)
    # a layer with its own instance forward (here: doubling the output) takes the vmap path, its forward untouched
    doubled = model.layers[1].forward = lambda t, _lin=model.layers[1]: 2 * nn.Linear.forward(_lin, t)
    assert fast_path_blocker(model) == "Linear 'layers.1' has no fast path"
    _assert_same(clipped_grad_sum(model, xs, ys, 0.1), vmap_clipped_grad_sum(model, xs, ys, 0.1))
    assert vars(model.layers[1])["forward"] is doubled


def test_clipped_sgd_equals_a_loop_of_reference_steps() -> None:
    """Two epochs of client training equal SGD with the vmap reference's clipped sums on the same batches."""
    from protocols.task.training import _batches, clipped_sgd

    rng = np.random.default_rng(19)
    x, y = rng.random((70, 1, 8, 8)), rng.integers(0, 10, 70)
    model = build_model("mlp", (1, 8, 8), 10, (16,), 20).double()
    ref = build_model("mlp", (1, 8, 8), 10, (16,), 20).double()
    loss, frac = clipped_sgd(model, x, y, epochs=2, batch_size=16, lr=0.5, clip=2.0, seed=21)
    order = np.random.default_rng(21)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    clipped, last = 0, []
    for _ in range(2):
        last = []
        for idx in _batches(70, 16, order):
            r = vmap_clipped_grad_sum(ref, xt[idx], yt[idx], 2.0)
            with torch.no_grad():
                for p, g in zip(ref.parameters(), r.grads, strict=True):
                    p -= 0.5 / len(idx) * g
            clipped += r.clipped
            last.append(r.losses)
    assert 0 < clipped < 140 and frac == clipped / 140
    assert loss == pytest.approx(float(torch.cat(last).sum()) / 70, rel=1e-9)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert float((a - b).detach().norm() / b.detach().norm()) <= 1e-9


@pytest.mark.parametrize(("batch_size", "gather_batches"), [(32, 64), (7, 3)])
def test_clipped_sgd_blocks_are_the_documented_batches(monkeypatch: pytest.MonkeyPatch, batch_size: int,
                                                       gather_batches: int) -> None:
    """clipped_sgd's block gathers give bit for bit the steps of one descend per batch in the seed's order."""
    import protocols.task.training as training

    monkeypatch.setattr(training, "_GATHER_BATCHES", gather_batches)
    rng = np.random.default_rng(0)
    x, y = rng.random((300, 1, 6, 6)), rng.integers(0, 4, 300)  # float64, the module's default dtype
    trained, ref = (build_model("mlp", (1, 6, 6), 4, (8,), 0) for _ in range(2))
    training.clipped_sgd(trained, x, y, epochs=2, batch_size=batch_size, lr=0.1, clip=0.5, seed=3)
    order_rng, xt, yt = np.random.default_rng(3), torch.as_tensor(x), torch.as_tensor(y)
    with PerExampleClipper(ref, 0.5) as clipper:
        for _ in range(2):
            order = torch.as_tensor(order_rng.permutation(len(y)))
            for start in range(0, len(y), batch_size):
                ix = order[start:start + batch_size]
                clipper.descend(xt[ix], yt[ix], 0.1 / len(ix))
    for a, b in zip(trained.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
