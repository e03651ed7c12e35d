"""Baseline message parts: ldp's noise multiplier and cdp's clipping norm reach the client as the strategy meant them.

And what the real client does with them: it refuses a smaller ldp multiplier, and its noise is its own.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM  # what Flower's fixedclipping_mod reads

from client.app import app as client_app
from client.env import ClientEnv, record_level_training
from client.records import to_record
from protocols.adjacency import adjacency_factor
from protocols.arrays import flatten
from protocols.config import RunConfig
from protocols.floor import ldp_noise_multiplier, ldp_noise_std
from protocols.privacy import GaussianEvent, GdpAccountant, calibrate_noise_multiplier
from protocols.wire.arrays import from_record
from protocols.wire.baselines import ClippingNorm, LocalDpNoise
from protocols.wire.common import TrainIns, train_metrics
from protocols.wire.ledger import SpentReport
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies.baselines import CentralDPStrategy, LocalDPStrategy, record_mean_sensitivity
from strategies.stages import RoundState
from tests.test_privacy_floor import FAST, initial

pytestmark = pytest.mark.usefixtures("one_thread", "task_identity")


def _cfg(method: str, **extra) -> RunConfig:
    return RunConfig.from_mapping({**app_defaults(), "method": method, "num-clients": 5, "num-rounds": 3, **extra})


def test_ldp_train_config_carries_the_calibrated_multiplier() -> None:
    strategy = LocalDPStrategy(_cfg("ldp"))
    rec = strategy.train_config(2)
    assert TrainIns.from_config(rec).round == 2
    z = calibrate_noise_multiplier(1.0, 1e-5, 1.0, 3)  # exact RDP, no sampling, num-rounds releases
    assert LocalDpNoise.from_config(rec).multiplier == pytest.approx(z) == strategy.z
    assert ldp_noise_multiplier(strategy.cfg) == strategy.z


def test_ldp_std_rule_by_privacy_unit() -> None:
    rec = _cfg("ldp", **{"batch-size": 1_000_000, "local-epochs": 1, "lr": 4.0, "clip": 1.0})
    z = ldp_noise_multiplier(rec)
    assert rec.adjacency == "zero-out" and ldp_noise_std(rec, 150) == pytest.approx(z * 1.0 * 4.0 / 150)  # C lr / n_k
    replace_one = rec.replace(adjacency="replace-one")
    assert ldp_noise_std(replace_one, 150) == pytest.approx(z * 2 * 1.0 * 4.0 / 150)  # Lemma 1: 2 C lr / n_k
    with pytest.raises(ValueError, match="dataset size"):
        ldp_noise_std(rec)
    client = _cfg("ldp", **{"privacy-unit": "client", "clip": 0.5})
    assert ldp_noise_std(client, 150) == pytest.approx(ldp_noise_multiplier(client) * 0.5)


def test_cdp_train_config_carries_the_clip_under_flowers_key_only_at_client_level() -> None:
    strategy = CentralDPStrategy(_cfg("cdp", **{"privacy-unit": "client"}))
    rec = strategy.train_config(1)
    assert rec[KEY_CLIPPING_NORM] == pytest.approx(strategy.cfg.clip)  # what fixedclipping_mod reads
    assert KEY_CLIPPING_NORM not in CentralDPStrategy(_cfg("cdp")).train_config(1)  # record level: no mod


@pytest.mark.parametrize("bad", [-0.1, float("inf"), "1.0"])
def test_noise_multiplier_decoder_names_the_key(bad) -> None:
    with pytest.raises(ValueError, match="noise-multiplier"):
        LocalDpNoise.from_config(ConfigRecord({"noise-multiplier": bad}))


def test_clipping_norm_must_be_positive() -> None:
    with pytest.raises(ValueError, match=KEY_CLIPPING_NORM):
        ClippingNorm(0.0)


# ------------------------------------------------------------------ the real client, through the grid
def _announcing(factor: float) -> type[LocalDPStrategy]:
    class Announcing(LocalDPStrategy):
        def train_config(self, server_round: int) -> ConfigRecord:
            rec = super().train_config(server_round)
            rec.update(LocalDpNoise(self.z * factor).to_config())
            return rec
    return Announcing


def _ldp_round(factor: float, **extra):
    raw = {**app_defaults(), **FAST, "method": "ldp", "lr": 4.0, "clip": 1.0, **extra}
    cfg = RunConfig.from_mapping(raw)
    grid = LocalGrid(client_app, cfg.num_clients, raw)
    strategy = _announcing(factor)(cfg)
    msgs = list(strategy.configure_train(1, initial(cfg, strategy), ConfigRecord(TrainIns(1).to_config()), grid))
    return cfg, grid, msgs, list(grid.send_and_receive(msgs))


def test_a_smaller_announced_multiplier_is_refused_by_the_real_client() -> None:
    _, _, _, replies = _ldp_round(0.5)
    assert replies
    for r in replies:
        assert r.has_error() and "privacy floor" in r.error.reason and "noise-multiplier" in r.error.reason


@pytest.mark.parametrize("factor", [1.0, 3.0])
def test_record_level_ldp_upload_noise_is_z_times_2_clip_lr_over_n_k(factor) -> None:
    """The noise measured in real uploads: std z' 2 C lr / n_k (one full-batch step), charged so in the ledger.

    z' is the larger of the announced z and the client's own (the server raises it to keep a run within its target).
    """
    cfg, grid, msgs, replies = _ldp_round(factor)
    z = calibrate_noise_multiplier(cfg.epsilon, cfg.delta, 1.0, cfg.num_rounds)
    normalised = []
    for msg, r in zip(msgs, replies, strict=True):
        assert not r.has_error(), r.error.reason
        env = ClientEnv.from_context(grid.contexts[msg.metadata.dst_node_id])
        n_k = len(env.y)
        _, local_w, _, _ = record_level_training(msg, env)  # deterministic: the model before the noise
        noise = flatten(from_record(r.content["arrays"])) - flatten(local_w)
        expected = factor * z * adjacency_factor(cfg.adjacency) * cfg.clip * cfg.lr / n_k
        assert r.content["metrics"]["noise_std"] == pytest.approx(expected)
        spent = GdpAccountant([GaussianEvent(factor * z)]).epsilon(cfg.delta)  # one release at the multiplier used
        assert SpentReport.from_metrics(r.content["metrics"]).epsilon == pytest.approx(spent, rel=1e-6)
        normalised.append(noise / expected)
    pooled = np.concatenate(normalised)  # ~2600 draws: the std is within a few % of 1
    assert abs(pooled.mean()) < 0.1
    assert pooled.std() == pytest.approx(1.0, rel=0.08)


def test_record_level_cdp_server_noise_is_z_times_2_clip_lr_over_n() -> None:
    """The server's noise on the example-weighted mean has std z 2 C lr / N (N = the participants' records)."""
    cfg = _cfg("cdp", **{"batch-size": 1_000_000, "local-epochs": 1, "lr": 4.0, "clip": 1.0})
    strategy = CentralDPStrategy(cfg)
    sizes = {11: 100, 12: 300, 13: 50}
    models = {n: np.full(20_000, float(i), dtype=np.float32) for i, n in enumerate(sizes)}
    by_node = {n: Message(RecordDict({"arrays": to_record({"w": models[n]}, np.float32),
                                      "metrics": MetricRecord(train_metrics(sizes[n]))}), n, "train") for n in sizes}
    out = flatten(from_record(strategy.aggregate(RoundState(1, sorted(sizes), replies=by_node))))
    mean = sum(sizes[n] * models[n].astype(np.float64) for n in sizes) / sum(sizes.values())
    expected = strategy.z * 1.0 * 4.0 / 450  # zero-out: C lr / N
    assert record_mean_sensitivity(cfg, sizes) == pytest.approx(4.0 / 450)
    assert (out - mean).std() == pytest.approx(expected, rel=0.03)
    assert abs((out - mean).mean()) < 0.05 * expected


# ------------------------------------------------------------------ client level with fewer replies than planned
def _client_level_replies(sizes: dict[int, int], dim: int = 20_000) -> dict[int, Message]:
    return {n: Message(RecordDict({"arrays": to_record({"w": np.zeros(dim, dtype=np.float32)}, np.float32),
                                   "metrics": MetricRecord(train_metrics(sizes[n]))}),
                       n, "train") for n in sizes}


def test_client_level_cdp_noise_is_sized_on_the_replies_aggregated() -> None:
    """5 planned, 3 arrive: the mean of 3 clipped updates (sensitivity C / 3) gets std z C / 3, so multiplier z holds.

    Sized on the 5 planned (Flower's ``num_sampled_clients``) the std is z C / 5: multiplier 0.6 z, charged as z.
    """
    strategy = CentralDPStrategy(_cfg("cdp", **{"privacy-unit": "client", "clip": 0.5}))
    assert strategy.cfg.clients_per_round == 5
    replies = _client_level_replies({11: 100, 12: 100, 13: 100})
    out = flatten(from_record(strategy.aggregate(RoundState(1, [11, 12, 13, 14, 15], replies=replies))))
    assert out.std() == pytest.approx(strategy.z * 0.5 / 3, rel=0.03)


def test_client_level_ldp_model_is_charged_with_the_uploads_aggregated() -> None:
    """The model's account counts the k uploads that reached the mean: multiplier z sqrt(k - 1), not z sqrt(m - 1)."""
    from strategies.baselines import RecordRound

    strategy = LocalDPStrategy(_cfg("ldp", **{"privacy-unit": "client"}))
    st = RecordRound(1, [11, 12, 13, 14, 15], replies=_client_level_replies({11: 100, 12: 100}))
    strategy.charge_release(st)
    strategy.aggregate(st)
    strategy.account(st)
    assert st.mean_multiplier == pytest.approx(strategy.z * 1.0)  # 2 uploads: the other's noise, z sqrt(1)
    from protocols.privacy import RdpAccountant

    expected = RdpAccountant([GaussianEvent(strategy.z)]).epsilon(strategy.cfg.delta)  # the strategy's accountant
    assert strategy.privacy.downlink.epsilon(strategy.cfg.delta) == pytest.approx(expected, rel=1e-3)


def test_client_level_cdp_server_clips_each_update_to_the_clip_its_noise_is_sized_on() -> None:
    """A float32 upload ``w + u`` carries ``u`` only to float32 rounding of ``w``, and a client may clip loosely.

    Three aligned updates of norm ``1.0009 clip`` (inside the reply check's float32 slack): the mean's distance from
    the round model is ``clip`` at most, the sensitivity ``clip / k`` the noise is sized on (noise off here).
    """
    strategy = CentralDPStrategy(_cfg("cdp", **{"privacy-unit": "client", "clip": 0.5}))
    strategy.noise_scale = 0.0
    rng = np.random.default_rng(3)
    w0 = rng.normal(size=5_000).astype(np.float32)
    strategy.round_model = to_record({"w": w0}, np.float32)  # the model the round sent
    direction = rng.normal(size=5_000)
    u = direction / np.linalg.norm(direction) * 0.5 * 1.0009
    replies = {n: Message(RecordDict({"arrays": to_record({"w": (w0 + u).astype(np.float32)}, np.float32),
                                      "metrics": MetricRecord(train_metrics(100))}), n, "train") for n in (11, 12, 13)}
    for n in replies:
        assert strategy.norm_limit(RoundState(1, [11, 12, 13]), n) > np.linalg.norm(u)  # the reply check lets it in
    out = flatten(from_record(strategy.aggregate(RoundState(1, [11, 12, 13], replies=replies))))
    assert np.linalg.norm(out - w0.astype(np.float64)) <= 0.5 * (1 + 1e-6)
