"""The client's privacy floor (issue 16, item 1): a malicious server gets a refusal, never a weaker upload.

Every test drives the real ClientApp (``client.app``) through the in-process grid with a
*malicious strategy*: a subclass of the method's real strategy that sends less noise
(nadp sigma / lambda, ldp noise std, ddpsa eps_t, mpddp scales), replays a round or
runs past ``num-rounds``, or a run config beyond the node's own policy.  Every client
of every method must answer with an error naming the parameter, and no upload.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message

from client.app import app as client_app
from client.records import to_record
from protocols.config import RunConfig
from protocols.ddpsa_floor import ddpsa_round_epsilon
from protocols.floor import FloorPolicy, FloorViolation, ldp_noise_multiplier, ldp_noise_std, mpddp_floor
from protocols.methods import METHOD_NAMES, method_spec
from protocols.privacy import FLOAT32_ROUNDING_MARGIN, largest_trainable_norm, record_sensitivity
from protocols.task.data import dataset_for
from protocols.task.models import build_model, get_weights, set_weights
from protocols.task.training import clipped_sgd
from protocols.wire.baselines import LocalDpNoise
from protocols.wire.common import TrainIns
from protocols.wire.ledger import SpentReport
from protocols.wire.mpddp import NaiveNoise
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies.base import CancelStrategy
from strategies.baselines import LocalDPStrategy
from strategies.ddpsa import DdpsaStrategy
from strategies.mpddp import MpddpStrategy, MpdpNaiveStrategy
from strategies.nadp import NadpStrategy
from strategies.registry import build_strategy

#: Small and fast: a linear model (mlp with one hidden layer for the mpddp family), one full-batch step.
FAST = {"num-clients": 4, "num-rounds": 3, "local-epochs": 1, "batch-size": 1000, "hidden": "", "train-subset": 400,
        "test-subset": 100}
PER_METHOD = {"mpddp": {"hidden": "8"}, "mpdp-naive": {"hidden": "8"}, "mpcdp": {"hidden": "8"}}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ddpsa_servers():
    """Real local intermediate servers (TLS, roster) for the DDP-SA clients' own configuration."""
    from server.intermediate.launcher import local_intermediate_servers

    with local_intermediate_servers(RunConfig.from_mapping({**app_defaults(), **FAST, "method": "ddpsa"})) as cfg:
        PER_METHOD["ddpsa"] = {"ddpsa-servers": cfg.ddpsa_servers, "ddpsa-ca": cfg.ddpsa_ca,
                               "ddpsa-server-key": cfg.ddpsa_server_key}
        yield cfg
        del PER_METHOD["ddpsa"]


@pytest.fixture
def methods_ready(request):
    """Start the DDP-SA servers when a parametrised test needs them."""
    if request.node.callspec.params.get("method") == "ddpsa":
        request.getfixturevalue("ddpsa_servers")


def setup(method: str, node_config: dict | None = None, **overrides) -> tuple[RunConfig, LocalGrid]:
    raw = {**app_defaults(), **FAST, **PER_METHOD.get(method, {}), "method": method, **overrides}
    cfg = RunConfig.from_mapping(raw)
    return cfg, LocalGrid(client_app, cfg.num_clients, raw, node_config=node_config)


def initial(cfg: RunConfig, strategy: CancelStrategy) -> ArrayRecord:
    ds = dataset_for(cfg)
    model = build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed)
    return to_record(get_weights(model), strategy.wire_dtype)


def train_round(strategy: CancelStrategy, cfg: RunConfig, grid: LocalGrid, rnd: int = 1) -> list[Message]:
    """One round's train replies (the strategy's own extra phases included)."""
    arrays = initial(cfg, strategy)
    msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord(TrainIns(rnd).to_config()), grid))
    assert msgs
    return list(grid.send_and_receive(msgs))


def assert_all_refused(replies: list[Message], parameter: str) -> None:
    assert replies
    for r in replies:
        assert r.has_error(), f"node {r.metadata.src_node_id} uploaded: {list(r.content.keys())}"
        assert "privacy floor" in r.error.reason and parameter in r.error.reason, r.error.reason


# ------------------------------------------------------------------------- malicious strategies
class QuietLdp(LocalDPStrategy):
    """Announces a noise multiplier a million times smaller."""

    def train_config(self, server_round: int) -> ConfigRecord:
        rec = super().train_config(server_round)
        rec.update(LocalDpNoise(self.z * 1e-6).to_config())
        return rec


def nadp_cut(field: str, factor: float) -> type[NadpStrategy]:
    class QuietNadp(NadpStrategy):
        def plan_round(self, keys):
            st = super().plan_round(keys)
            plan = st.plan
            value = ({n: s * factor for n, s in plan.ldp_stds.items()} if field == "ldp_stds"
                     else getattr(plan, field) * factor)
            st.plan = dataclasses.replace(plan, **{field: value})
            return st
    return QuietNadp


class LoudDdpsa(DdpsaStrategy):
    """Asks for eps_t = 1e9 (Laplace noise std ~1e-9)."""

    def epsilon_of_round(self, server_round: int) -> float:
        return 1e9


def mpddp_cut(which: str) -> type[MpddpStrategy]:
    class QuietMpddp(MpddpStrategy):
        def round_noise(self, state):
            noise = super().round_noise(state)
            return dataclasses.replace(noise, **{which: getattr(noise, which) * 1e-6})
    return QuietMpddp


class DropoutBlindMpddp(MpddpStrategy):
    """Calibrates as if no participant dropped: the run config's ``dropout-rate`` ignored (the clients' floor has it)."""

    def _calibration(self, k, min_size, scale=1.0):
        blind = RunConfig.from_mapping({**app_defaults(), **FAST, **PER_METHOD["mpddp"], "method": "mpddp"})
        return mpddp_floor(blind, k, min_size, scale, self._releases())


class QuietNaive(MpdpNaiveStrategy):
    def round_noise(self, state):
        return NaiveNoise(super().round_noise(state).sigma * 1e-6)


ATTACKS = [
    ("ldp", {}, QuietLdp, "noise-multiplier"),
    ("ldp", {"privacy-unit": "client"}, QuietLdp, "noise-multiplier"),
    ("nadp", {}, nadp_cut("sigma_up", 1e-9), "nadp-sigma-up"),
    ("nadp", {}, nadp_cut("sigma_down", 1e-9), "nadp-sigma-down"),
    ("nadp", {"nadp-lambda": 3.0}, nadp_cut("lam", 1 / 3), "nadp-lambda"),
    ("nadp", {"nadp-variant": "record-ldp"}, nadp_cut("ldp_stds", 1e-9), "nadp-ldp-stds"),
    ("ddpsa", {}, LoudDdpsa, "ddpsa-epsilon"),
    ("mpddp", {}, mpddp_cut("sigma_eta"), "mpddp-sigma-eta"),
    ("mpddp", {}, mpddp_cut("sigma_delta"), "mpddp-sigma-delta"),
    ("mpdp-naive", {}, QuietNaive, "mpddp-sigma"),
]


@pytest.mark.parametrize(("method", "extra", "strategy_cls", "parameter"), ATTACKS,
                         ids=[f"{m}-{p}" for m, _, _, p in ATTACKS])
def test_less_noise_from_the_server_is_refused_by_every_client(method, extra, strategy_cls, parameter, methods_ready):
    cfg, grid = setup(method, **extra)
    replies = train_round(strategy_cls(cfg), cfg, grid)
    assert len(replies) == cfg.clients_per_round
    assert_all_refused(replies, parameter)


def test_mpddp_scales_without_the_planned_dropouts_are_refused():
    """dropout-rate = 0.4 (m = 3 of 4): a server that leaves it out sends half the scales every client's floor has."""
    cfg, grid = setup("mpddp", **{"dropout-rate": 0.4})
    assert_all_refused(train_round(DropoutBlindMpddp(cfg), cfg, grid), "mpddp-sigma-eta")
    cfg, grid = setup("mpddp", **{"dropout-rate": 0.4})
    replies = train_round(MpddpStrategy(cfg), cfg, grid)  # the honest plan passes
    assert len(replies) == cfg.clients_per_round and not any(r.has_error() for r in replies)


def test_honest_servers_pass_the_floor_and_clients_report_their_spending():
    """The real strategies: every client uploads and reports its lifetime epsilon (inf where uploads have no DP)."""
    for method in ("ldp", "nadp", "niss", "mpddp", "mpdp-naive", "ladp"):
        cfg, grid = setup(method)
        replies = train_round(build_strategy(cfg), cfg, grid)
        for r in replies:
            assert not r.has_error(), f"{method}: {r.error.reason}"
            spent = SpentReport.from_metrics(r.content["metrics"])
            assert spent is not None and spent.releases == 1, method
            if method_spec(method).privacy.uplink is None:  # the MP family: Psi/Phi go up un-noised
                assert spent.epsilon == np.inf, method
            else:
                assert 0 < spent.epsilon < np.inf, method


@pytest.mark.parametrize("method", ["ldp", "ladp", "nadp"])
def test_a_model_too_large_for_float32_training_trains_its_update_and_one_too_large_is_refused(
        method, monkeypatch):
    """A global model offset by 2^16: its float32 training rounds one record's influence past the sensitivity.

    Measured on clients that trained it in float32 (digits, replace-one, 20 neighbour pairs): one record moved the
    trained model 2.5 times (ladp) the sensitivity its noise and ledger charge were sized for; ldp at 2^20, 5.3 times.
    Such a model trains its update from the received weights and uploads their float64 sum (an honest run whose
    model the noise dominates gets there too); one offset by 2^40 is past the float64 limit and refused.
    """
    import protocols.task.training as training

    calls = []

    def spy(model, *args, recentre: bool = False, **kwargs):
        out = real(model, *args, recentre=recentre, **kwargs)
        calls.append((recentre, next(model.parameters()).dtype))
        return out

    real = training.clipped_sgd
    monkeypatch.setattr(training, "clipped_sgd", spy)
    cfg, grid = setup(method)
    strategy = build_strategy(cfg)
    for rnd, offset, refused in ((1, 2.0 ** 16, False), (2, 2.0 ** 40, True)):
        calls.clear()
        arrays = to_record({k: v + offset for k, v in get_weights(_model(cfg)).items()}, strategy.wire_dtype)
        msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord(TrainIns(rnd).to_config()), grid))
        replies = list(grid.send_and_receive(msgs))
        if refused:
            assert_all_refused(replies, "global model L2 norm")
            assert not calls  # refused before any training
        else:
            assert replies and not any(r.has_error() for r in replies), [r.error.reason for r in replies]
            assert calls and all(c == (True, torch.float64) for c in calls), calls


def _model(cfg: RunConfig):
    ds = dataset_for(cfg)
    return build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed)


def test_float32_training_below_the_largest_norm_keeps_the_record_sensitivity():
    """One record moves a model trained from the largest admitted norm by less than the sensitivity and its margin.

    From a model 2^10 times larger, by more than twice the sensitivity in float32 (the rounding the client avoids by
    training the update instead), and within it when the update is trained.
    """
    cfg, _ = setup("ldp", adjacency="replace-one")
    ds = dataset_for(cfg)
    x, y = ds.x_train[:100], ds.y_train[:100]
    sens = record_sensitivity(cfg, len(y))
    base = get_weights(_model(cfg))
    size = sum(v.size for v in base.values())
    rng = np.random.default_rng(1)

    def moved(norm: float, recentre: bool = False) -> float:
        start = {k: v + norm / np.sqrt(size) for k, v in base.items()}  # every coordinate offset alike
        worst = 0.0
        for _ in range(10):
            i, j = rng.integers(len(y), size=2)
            x2, y2 = x.copy(), y.copy()
            x2[i], y2[i] = x[j], (y[j] + 1) % ds.num_classes  # replace-one neighbour
            trained = []
            for xs, ys in ((x, y), (x2, y2)):
                model = _model(cfg)
                set_weights(model, start)
                clipped_sgd(model, xs, ys, epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr,
                            clip=cfg.clip, seed=0, recentre=recentre)
                trained.append(np.concatenate([w.ravel() for w in get_weights(model).values()]))
            worst = max(worst, float(np.linalg.norm(trained[0] - trained[1])))
        return worst

    limit = largest_trainable_norm(cfg, len(y))
    assert moved(limit) <= sens * (1 + 1 / FLOAT32_ROUNDING_MARGIN)
    assert moved(1024 * limit) > 2 * sens
    assert moved(1024 * limit, recentre=True) <= sens * (1 + 1 / FLOAT32_ROUNDING_MARGIN)  # what the client does


def _trained(cfg: RunConfig, x: np.ndarray, y: np.ndarray, norm: float, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """``(start, trained)`` weights, flat, of :func:`clipped_sgd` from ``cfg``'s model offset to about L2 ``norm``.

    ``mode``: ``float32``, ``recentred`` (float32, training the update) or ``float64`` (a float64 model).  The
    start is float32-representable, so that every mode starts from the same weights.
    """
    base = get_weights(_model(cfg))
    size = sum(v.size for v in base.values())
    start = {k: (v + norm / np.sqrt(size)).astype(np.float32).astype(np.float64) for k, v in base.items()}
    model = _model(cfg).double() if mode == "float64" else _model(cfg)
    set_weights(model, start)
    clipped_sgd(model, x, y, epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr, clip=cfg.clip, seed=0,
                recentre=mode == "recentred")
    if mode != "float32":
        assert all(p.dtype == torch.float64 for p in model.parameters())
    flat = [np.concatenate([w.ravel() for w in ws.values()]) for ws in (start, get_weights(model))]
    return flat[0], flat[1]


def test_a_recentred_update_trains_as_float32_below_the_limit_and_as_float64_above_it():
    """Training the update changes nothing that float32 rounding does not, and keeps the steps float32 rounds away.

    Small steps (lr 0.01, clip 0.01; 30 steps): below the limit the weights are plain float32 training's to the
    steps' float32 rounding; at twice the limit the update matches float64 training's to 1e-5 (float32 training's
    is off by more than 1e-2), and the model holds float64 values float32 cannot represent.
    """
    cfg = setup("ldp")[0].replace(lr=0.01, clip=0.01, local_epochs=3, batch_size=10)
    ds = dataset_for(cfg)
    x, y = ds.x_train[:100], ds.y_train[:100]
    limit = largest_trainable_norm(cfg, len(y))
    start, recentred = _trained(cfg, x, y, limit / 8, "recentred")
    _, plain = _trained(cfg, x, y, limit / 8, "float32")
    steps = cfg.local_epochs * len(y) // cfg.batch_size
    assert np.abs(recentred - plain).max() <= 2 * steps * 2.0 ** -24 * np.abs(plain).max()
    start, recentred = _trained(cfg, x, y, 2 * limit, "recentred")
    update = _trained(cfg, x, y, 2 * limit, "float64")[1] - start
    assert np.linalg.norm(recentred - start - update) <= 1e-5 * np.linalg.norm(update)
    assert np.linalg.norm(_trained(cfg, x, y, 2 * limit, "float32")[1] - start - update) > 1e-2 * np.linalg.norm(update)
    assert np.any(recentred != recentred.astype(np.float32))


def test_client_noise_is_its_own_not_the_servers():
    """A server announcing *more* noise does not change what the client computes (nor does a smaller one pass)."""
    cfg, _ = setup("ldp")
    assert ldp_noise_multiplier(cfg) == pytest.approx(LocalDPStrategy(cfg).z)
    assert ldp_noise_std(cfg, 100) == pytest.approx(LocalDPStrategy(cfg).upload_std(100))
    assert ddpsa_round_epsilon(cfg.replace(method="ddpsa"), 1) == pytest.approx(cfg.epsilon / cfg.num_rounds)


# --------------------------------------------------------------------------- rounds and policy
@pytest.mark.parametrize("method", [m for m in METHOD_NAMES if m not in ("fedavg", "cdp", "mpcdp")])
def test_rounds_beyond_the_budget_are_refused(method, methods_ready):
    """A server that runs round T+1 (the noise is calibrated for T releases) gets a refusal from every client."""
    cfg, grid = setup(method)

    class Longer(type(build_strategy(cfg))):
        def epsilon_of_round(self, server_round: int) -> float:  # DDP-SA's schedule has T entries
            return super().epsilon_of_round(min(server_round, self.cfg.num_rounds))

    if method == "niss":  # every client refuses the round's share request already: it never reaches training
        from strategies.validation import RoundFailed

        with pytest.raises(RoundFailed, match="share exchange did not complete"):
            train_round(Longer(cfg), cfg, grid, rnd=cfg.num_rounds + 1)
        return
    assert_all_refused(train_round(Longer(cfg), cfg, grid, rnd=cfg.num_rounds + 1), "round")


def test_a_replayed_round_is_refused():
    """The same round number twice in one run would release the data again: refused."""
    cfg, grid = setup("nadp")
    strategy = build_strategy(cfg)
    first = train_round(strategy, cfg, grid)
    assert all(not r.has_error() for r in first)
    assert_all_refused(train_round(strategy, cfg, grid), "round")


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_node_policy_refuses_a_run_config_beyond_it(method, methods_ready):
    """Node config max-epsilon-per-run below the run's epsilon: every client of every method refuses."""
    cfg, grid = setup(method, node_config={"max-epsilon-per-run": 0.5}, epsilon=1.0)
    replies = train_round(build_strategy(cfg), cfg, grid)
    # Methods whose uploads carry no guarantee (fedavg, cdp, the MP family) are refused as such.
    assert_all_refused(replies, "epsilon" if method_spec(method).privacy.uplink is not None else "method")


def test_node_policy_clip_and_unprotected_methods():
    with pytest.raises(FloorViolation, match="clip"):
        FloorPolicy(max_clip=1.0).check_run(RunConfig(clip=2.0), protected=True)
    with pytest.raises(FloorViolation, match="method"):
        FloorPolicy(lifetime_epsilon=5.0).check_run(RunConfig(method="cdp"), protected=False)
    FloorPolicy().check_run(RunConfig(method="fedavg"), protected=False)  # no policy: nothing required
    with pytest.raises(ValueError, match="max-clip"):
        FloorPolicy.from_node_config({"max-clip": "-1"})


def test_the_mean_training_loss_leaves_out_the_nodes_that_withhold_it():
    """Two of four nodes ask for a guarantee and withhold their loss: the round's mean is the other two's, not halved.

    The mean counted a withheld metric as 0 (a federation mixing policies reported a train loss about half the real).
    """
    cfg, grid = setup("ldp")
    for node in grid.node_ids[:2]:
        grid.contexts[node].node_config["lifetime-epsilon"] = 50.0
    strategy = LocalDPStrategy(cfg)
    replies = train_round(strategy, cfg, grid)
    assert not any(r.has_error() for r in replies)
    reported = [r.content["metrics"] for r in replies if "train_loss" in r.content["metrics"]]
    assert len(reported) == 2
    sizes = [m["num-examples"] for m in reported]
    expected = sum(m["train_loss"] * n for m, n in zip(reported, sizes, strict=True)) / sum(sizes)
    assert strategy.mean_metrics(replies)["train_loss"] == pytest.approx(expected)
