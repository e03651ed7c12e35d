"""Models build, train and round-trip through model.npz."""

from __future__ import annotations

import numpy as np
import torch

from protocols.arrays import flatten, unflatten
from protocols.task.data import load_dataset
from protocols.task.models import MLP, build_model, get_weights, load_npz_model, save_npz_model
from protocols.task.training import evaluate, train


def test_mlp_and_cnn_learn_digits():
    ds = load_dataset("digits")
    for name in ("mlp", "cnn"):
        model = build_model(name, ds.input_shape, 10, (64,), seed=0)
        _, before = evaluate(model, ds.x_test, ds.y_test)
        train(model, ds.x_train, ds.y_train, epochs=5, batch_size=32, lr=0.1, seed=0)
        _, after = evaluate(model, ds.x_test, ds.y_test)
        assert after > 0.85 > before, (name, before, after)


def test_npz_round_trip(tmp_path):
    model = build_model("mlp", (1, 8, 8), 10, (16,), seed=3)
    w = get_weights(model)
    save_npz_model(tmp_path / "model.npz", w, {"model": "mlp", "input_shape": [1, 8, 8], "num_classes": 10,
                                                "hidden": [16]})
    again, meta = load_npz_model(tmp_path / "model.npz")
    x = torch.randn(4, 1, 8, 8)
    assert torch.allclose(model(x), again(x))
    assert meta["model"] == "mlp"


def test_flatten_round_trip():
    w = get_weights(build_model("cnn", (1, 8, 8), 10, seed=1))
    back = unflatten(flatten(w), w)
    assert all(np.array_equal(w[k], back[k]) for k in w)


def test_a_linear_model_starts_at_zero_and_learns_one_class_mean_step():
    """A linear model (hidden = "") starts at zero; one step of the mean gradient is a class-mean classifier."""
    ds = load_dataset("digits")
    linear = build_model("mlp", ds.input_shape, ds.num_classes, (), seed=3)
    assert all(np.all(w == 0) for w in get_weights(linear).values())
    mlp = build_model("mlp", ds.input_shape, ds.num_classes, (16,), seed=3)
    assert all(np.any(w != 0) for k, w in get_weights(mlp).items() if k.endswith("weight"))  # symmetry broken
    x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    loss = torch.nn.functional.cross_entropy(linear(x), y)
    loss.backward()
    with torch.no_grad():
        for p in linear.parameters():
            p -= 100.0 * p.grad
    assert evaluate(linear, ds.x_test, ds.y_test)[1] > 0.8


def test_seeding_matches_torch_manual_seed_without_formatting_stacks(monkeypatch):
    """build_model and train seed as torch.manual_seed does, without formatting a stack trace per seeding.

    (``torch.manual_seed`` formats one per device type it cannot seed yet: about a millisecond a call.)
    """
    import traceback

    torch.manual_seed(5)
    reference = MLP(8, (4,), 3).state_dict()
    formatted = []
    monkeypatch.setattr(traceback, "format_stack", lambda *a, **k: formatted.append(1) or [])
    for _ in range(3):
        model = build_model("mlp", (8,), 3, (4,), seed=5)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.values(), strict=True))
        train(model, np.zeros((4, 8), np.float32), np.arange(4) % 3, epochs=1, batch_size=2, lr=0.1, seed=1)
    assert not formatted
