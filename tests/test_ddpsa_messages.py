"""DDP-SA message vocabulary: the strategy's train config decodes on the client; bad records are refused by key."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from protocols.config import RunConfig
from protocols.wire.common import TrainIns
from protocols.wire.ddpsa import RECEIPT, DdpsaRound, ShareReceipt
from server.defaults import app_defaults
from strategies.base import RoundFailed
from strategies.ddpsa import DdpsaState, DdpsaStrategy
from tests.ddpsa_setup import ddpsa_credentials

SERVERS = ("127.0.0.1:5001", "127.0.0.1:5002", "127.0.0.1:5003")


def _round(**changes) -> DdpsaRound:
    fields = {"epsilon": 0.5, "noise": "distributed", "participants": ("node-1", "node-2"), "servers": SERVERS,
              "threshold": 2, "run_id": "abc", "frac_bits": 24, "max_clients": 10, **changes}
    return DdpsaRound(**fields)


def test_strategy_train_config_decodes_to_the_round_plan(tmp_path) -> None:
    raw = {**app_defaults(), "method": "ddpsa", "num-clients": 6, "num-rounds": 4, "epsilon": 2.0,
           "ddpsa-servers": ",".join(SERVERS), "ddpsa-frac-bits": 20, **ddpsa_credentials(tmp_path)}
    strategy = DdpsaStrategy(RunConfig.from_mapping(raw))
    with pytest.raises(RoundFailed, match="no participant list"):  # the plan names the round's participants
        strategy.train_config(3)
    strategy._state = DdpsaState(3, [11, 12], [], {11: "node-b", 12: "node-a"})
    rec = strategy.train_config(3)
    assert TrainIns.from_config(rec).round == 3
    plan = DdpsaRound.from_config(rec)
    assert plan.participants == ("node-a", "node-b") and plan.noise == "distributed"
    assert plan.threshold == 2 and plan.shamir_threshold == 2  # auto: m - 1 of m = 3 servers
    assert plan.epsilon == pytest.approx(strategy.epsilon_of_round(3)) and plan.epsilon == pytest.approx(0.5)
    assert plan.servers == SERVERS and plan.run_id == strategy.run_id
    assert plan.codec() == strategy.codec  # the client encodes with the codec the server decodes with


def test_round_trip_and_foreign_keys_ignored() -> None:
    plan = _round()
    rec = plan.to_config()
    rec["round"] = 7  # another part's key in the same record
    assert DdpsaRound.from_config(rec) == plan


@pytest.mark.parametrize(("key", "value", "match"), [
    ("ddpsa-epsilon", -1.0, "ddpsa-epsilon"),
    ("ddpsa-epsilon", "1", "ddpsa-epsilon"),
    ("ddpsa-servers", ["127.0.0.1:1"], "at least 2"),
    ("ddpsa-servers", "127.0.0.1:1,127.0.0.1:2", "ddpsa-servers"),
    ("ddpsa-run-id", "", "ddpsa-run-id"),
    ("ddpsa-noise", "central", "ddpsa-noise"),
    ("ddpsa-threshold", 1, "ddpsa-threshold"),
    ("ddpsa-threshold", 4, "ddpsa-threshold"),
    ("ddpsa-participants", ["a", "a"], "ddpsa-participants"),
    ("ddpsa-participants", [], "ddpsa-participants"),
    ("ddpsa-frac-bits", 63, "ddpsa-frac-bits"),
    ("ddpsa-max-clients", 0, "ddpsa-max-clients"),
])
def test_decoder_names_the_bad_key(key: str, value, match: str) -> None:
    rec = dict(_round().to_config())
    rec[key] = value
    with pytest.raises(ValueError, match=match):
        DdpsaRound.from_config(ConfigRecord(rec))


def test_decoder_names_a_missing_key() -> None:
    rec = dict(_round().to_config())
    del rec["ddpsa-run-id"]
    with pytest.raises(ValueError, match="ddpsa-run-id"):
        DdpsaRound.from_config(ConfigRecord(rec))


def test_share_receipt_round_trip() -> None:
    receipt = ShareReceipt("node-3", share_bytes=3 * 8 * 650, share_time_s=0.25)
    metrics = MetricRecord({"num-examples": 40, **receipt.to_metrics()})
    reply = RecordDict({"metrics": metrics})
    reply[RECEIPT] = ConfigRecord(receipt.to_config())
    assert ShareReceipt.from_reply(reply) == receipt and ShareReceipt.client_of(reply) == "node-3"
    plain = RecordDict({"metrics": MetricRecord({"num-examples": 40})})
    assert ShareReceipt.from_reply(plain) is None
    with pytest.raises(ValueError, match="ddpsa-receipt"):
        ShareReceipt.client_of(plain)
