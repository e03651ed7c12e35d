"""Server optimizers of the FedSGD methods (protocols.server_optimizers) and their run-config rules."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from protocols.config import ConfigError, RunConfig
from protocols.server_optimizers import ServerAdam, make_server_optimizer, optimizer_from_state


def _problem(seed: int = 0) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    rng = np.random.default_rng(seed)
    params = [rng.normal(size=(3, 4)), rng.normal(size=(4,))]
    grads = [[rng.normal(size=(3, 4)), rng.normal(size=(4,))] for _ in range(6)]
    return params, grads


def test_adam_matches_torch_adam() -> None:
    params, grads = _problem()
    ours = make_server_optimizer("adam", 0.05)
    tparams = [torch.nn.Parameter(torch.tensor(p)) for p in params]
    ref = torch.optim.Adam(tparams, lr=0.05)
    cur = params
    for g in grads:
        cur = ours.step(cur, g)
        for tp, tg in zip(tparams, g, strict=True):
            tp.grad = torch.tensor(tg)
        ref.step()
    for p, tp in zip(cur, tparams, strict=True):
        np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-12, atol=1e-12)


def test_sgd_is_the_papers_xi_step() -> None:
    params, grads = _problem()
    new = make_server_optimizer("sgd", 0.5).step(params, grads[0])
    for p, g, n in zip(params, grads[0], new, strict=True):
        np.testing.assert_allclose(n, p - 0.5 * g, rtol=0, atol=0)


def test_resumed_adam_continues_exactly() -> None:
    """A checkpointed optimizer (JSON, as server/checkpoint.py stores it) continues bit-identically."""
    params, grads = _problem(1)
    straight = make_server_optimizer("adam", 0.01)
    cur = params
    for g in grads:
        cur = straight.step(cur, g)
    first = make_server_optimizer("adam", 0.01)
    resumed_cur = params
    for g in grads[:3]:
        resumed_cur = first.step(resumed_cur, g)
    resumed = optimizer_from_state(json.loads(json.dumps(first.to_state())))
    for g in grads[3:]:
        resumed_cur = resumed.step(resumed_cur, g)
    for a, b in zip(cur, resumed_cur, strict=True):
        np.testing.assert_array_equal(a, b)


def test_state_is_compact_and_reads_the_float_list_form() -> None:
    """Moments travel as base64 float64 bytes (~11 JSON bytes per value, not a float list's ~20).

    A state holding them as float lists loads to the same optimizer.
    """
    rng = np.random.default_rng(3)
    params = [rng.normal(size=(100, 500)), rng.normal(size=500)]
    opt = make_server_optimizer("adam", 0.01)
    opt.step(params, [rng.normal(size=p.shape) for p in params])
    state = opt.to_state()
    assert len(json.dumps(state)) < 12 * 2 * sum(p.size for p in params)
    listed = {**state, "m": [{"shape": list(m.shape), "values": m.reshape(-1).tolist()} for m in opt.m],
              "v": [{"shape": list(v.shape), "values": v.reshape(-1).tolist()} for v in opt.v]}
    for other in (optimizer_from_state(json.loads(json.dumps(state))), optimizer_from_state(listed)):
        assert isinstance(other, ServerAdam) and other.t == 1
        for a, b in zip([*opt.m, *opt.v], [*other.m, *other.v], strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype == np.float64
            np.testing.assert_array_equal(a, b)


def test_non_finite_gradient_leaves_the_moments() -> None:
    params, grads = _problem(2)
    opt = make_server_optimizer("adam", 0.01)
    opt.step(params, grads[0])
    before = json.dumps(opt.to_state())
    bad = [g.copy() for g in grads[1]]
    bad[0][0, 0] = np.nan
    with pytest.raises(ValueError, match="not finite"):
        opt.step(params, bad)
    assert json.dumps(opt.to_state()) == before
    assert isinstance(opt, ServerAdam) and opt.t == 1


def test_bad_inputs_are_refused() -> None:
    params, grads = _problem()
    with pytest.raises(ValueError, match="unknown server optimizer"):
        make_server_optimizer("rmsprop", 0.1)
    with pytest.raises(ValueError, match="positive"):
        make_server_optimizer("adam", 0.0)
    with pytest.raises(ValueError, match="shape"):
        make_server_optimizer("sgd", 0.1).step(params, [grads[0][1], grads[0][0]])


def test_regime_and_user_settings() -> None:
    """The MP family steps with Adam by default; a user's xi keeps its paper meaning (SGD); ddpsa may use Adam."""
    for method in ("mpddp", "mpcdp", "mpdp-naive"):
        cfg = RunConfig.from_mapping({"method": method, "dataset": "digits"})
        assert cfg.server_optimizer == "adam"
        assert dict(cfg.regime_applied)["server-optimizer"] == "adam"
    assert RunConfig.from_mapping({"method": "mpddp", "mpddp-server-lr": 0.5}).server_optimizer == "sgd"
    assert RunConfig.from_mapping({"method": "ddpsa"}).server_optimizer == "sgd"  # its regime: SGD, few rounds
    assert RunConfig.from_mapping({"method": "ddpsa", "server-optimizer": "adam", "lr": 0.1}).server_optimizer == "adam"
    explicit = RunConfig.from_mapping({"method": "mpddp", "mpddp-server-lr": 0.02, "server-optimizer": "adam"})
    assert (explicit.server_optimizer, explicit.mpddp_server_lr) == ("adam", 0.02)
    assert RunConfig.from_mapping({"method": "nadp"}).server_optimizer == "sgd"
    with pytest.raises(ConfigError, match="averages models"):
        RunConfig.from_mapping({"method": "nadp", "server-optimizer": "adam"})
    with pytest.raises(ConfigError, match="server-optimizer"):
        RunConfig.from_mapping({"method": "mpddp", "server-optimizer": "lbfgs"})
