"""DDP-SA's median-centred gradients (``ddpsa-centering``): least L1 norm, same model function, linear model only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import client.methods.ddpsa as ddpsa_client
from protocols.ddpsa import centred_cross_entropy, is_linear_classifier
from protocols.methods.ddpsa import DdpsaOptions
from protocols.task.models import build_model


def _linear(seed: int = 0, scale: float = 0.3) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model("mlp", (1, 8, 8), 10, (), seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, scale)
    return model


def _data(n: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((n, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, n)


def test_centred_loss_value_is_cross_entropy_and_its_gradient_the_least_l1_shift() -> None:
    torch.manual_seed(0)
    z = torch.randn(64, 10, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 10, (64,))
    loss = centred_cross_entropy(z, y)
    torch.testing.assert_close(loss, F.cross_entropy(z, y, reduction="none"))
    (grad,) = torch.autograd.grad(loss.sum(), z)
    delta = torch.softmax(z, 1).detach() - F.one_hot(y, 10).double()
    # The lower median of each row of p - e_y is subtracted (sorted index 4 of 10).
    torch.testing.assert_close(grad, delta - delta.sort(1).values[:, 4:5])
    # No shift common to the classes gives a smaller L1 norm, and the centred one is at most the plain one.
    shifts = torch.linspace(-1, 1, 401, dtype=torch.float64)
    least = (delta[:, None, :] - shifts[None, :, None]).abs().sum(2).min(1).values
    assert torch.all(grad.abs().sum(1) <= least + 1e-12)
    assert torch.all(grad.abs().sum(1) <= delta.abs().sum(1) + 1e-12)
    # At uniform predictions (the zero model) the norm falls from 2 (1 - 1/C) = 1.8 to 1.
    z0 = torch.zeros(5, 10, requires_grad=True)
    (g0,) = torch.autograd.grad(centred_cross_entropy(z0, y[:5]).sum(), z0)
    torch.testing.assert_close(g0.abs().sum(1), torch.ones(5))


def test_centred_clipped_sum_matches_a_per_sample_loop_and_is_clipped() -> None:
    model = _linear()
    x, y = _data(300)  # > CHUNK: exercises chunking
    clip = 0.5
    got, _, frac = ddpsa_client.clipped_gradient_sum(model, x, y, clip, centred=True)
    w, b = (p.detach().double().numpy() for p in model.parameters())
    expected = np.zeros_like(got)
    for i in range(len(y)):
        xi = x[i].reshape(-1).astype(np.float64)
        z = w @ xi + b
        p = np.exp(z - z.max())
        delta = p / p.sum()
        delta[y[i]] -= 1.0
        delta -= np.sort(delta)[4]
        g = np.concatenate([np.outer(delta, xi).ravel(), delta])
        expected += g / max(1.0, np.abs(g).sum() / clip)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert np.abs(got).sum() <= len(y) * clip * (1 + 1e-9)  # each record still moves the sum by L1 <= Delta
    assert frac == 1.0


def test_centred_step_gives_the_linear_model_the_same_function() -> None:
    """Unclipped (clip above every norm), one step with the centred and with the plain gradient: same softmax."""
    x, y = _data(200, seed=2)
    outputs = []
    for centred in (False, True):
        model = _linear(seed=3)
        total, _, frac = ddpsa_client.clipped_gradient_sum(model, x, y, 1e6, centred=centred)
        assert frac == 0.0
        offset = 0
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * torch.as_tensor(total[offset:offset + p.numel()].reshape(p.shape), dtype=p.dtype) / len(y)
                offset += p.numel()
            outputs.append(torch.softmax(model(torch.as_tensor(x)), 1).double())
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)
    plain, _, _ = ddpsa_client.clipped_gradient_sum(_linear(seed=3), x, y, 1e6)
    centred, _, _ = ddpsa_client.clipped_gradient_sum(_linear(seed=3), x, y, 1e6, centred=True)
    assert not np.allclose(plain, centred)  # a different vector, the same step in function space


def test_centring_is_for_the_linear_model_only() -> None:
    mlp = build_model("mlp", (1, 8, 8), 10, (16,), 0)
    assert is_linear_classifier(_linear()) and not is_linear_classifier(mlp)
    x, y = _data(8)
    with pytest.raises(ValueError, match="linear model only"):
        ddpsa_client.clipped_gradient_sum(mlp, x, y, 1.0, centred=True)
    assert DdpsaOptions().centering is True  # the default
