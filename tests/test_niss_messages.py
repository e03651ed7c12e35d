"""NISS message vocabulary (protocols/wire/niss.py): round trips, validation, and one home for every key."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from client.records import to_record
from protocols.config import RunConfig
from protocols.wire import niss as messages
from protocols.wire.keys import PeerKeys
from protocols.wire.niss import AuthFailures, Diagnostic, NissMetrics, RelayedInbox, ShareReply, ShareRequest

ROOT = Path(__file__).resolve().parent.parent
BIG = 2**64 - 1  # node ids are unsigned 64-bit


def test_share_request_round_trip_carries_round_and_peers():
    peers = PeerKeys((BIG, 7), (b"\x01" * 32, b"\x02" * 32), key_epoch=3)
    req = ShareRequest(5, 0.25, peers)
    rec = req.to_config()
    assert ShareRequest.from_config(rec) == req
    assert PeerKeys.from_config(rec) == peers  # the peer part is the key phase's own vocabulary
    assert ShareRequest.from_config(ConfigRecord({**rec, "unrelated": 1})) == req  # foreign keys ignored
    sized = ShareRequest(5, 0.25, peers, {BIG: 144, 7: 143})
    assert ShareRequest.from_config(sized.to_config()) == sized and req.sizes == {}
    with pytest.raises(ValueError, match="niss-sizes"):
        ShareRequest(5, 0.25, peers, {7: 0})
    bad = sized.to_config()
    bad["niss-sizes"] = [144]
    with pytest.raises(ValueError, match="niss-size"):
        ShareRequest.from_config(bad)


@pytest.mark.parametrize("weight", [0.0, -0.1, 1.5, float("nan")])
def test_weight_outside_unit_interval_is_rejected(weight):
    peers = PeerKeys((7,), (b"\x01" * 32,), key_epoch=0)
    with pytest.raises(ValueError, match="niss-weight"):
        ShareRequest(1, weight, peers)
    good = ShareRequest(1, 0.5, peers).to_config()
    good["niss-weight"] = weight
    with pytest.raises(ValueError, match="niss-weight"):
        ShareRequest.from_config(good)


def test_share_reply_and_inbox_round_trip_and_validation():
    reply = ShareReply((BIG, 2), (b"a", b"b"))
    assert ShareReply.from_config(reply.to_config()) == reply
    with pytest.raises(ValueError, match="niss-to"):
        ShareReply((1, 2), (b"a",))
    with pytest.raises(ValueError, match="niss-payloads"):
        ShareReply.from_config(ConfigRecord({"niss-to": ["1"], "niss-payloads": ["not bytes"]}))
    with pytest.raises(ValueError, match="niss-to"):
        ShareReply.from_config(ConfigRecord({"niss-to": ["-1"], "niss-payloads": [b"a"]}))

    inbox = RelayedInbox(4, 0.2, (3, BIG), (b"x", b"y"), b"\x09" * 32)
    assert RelayedInbox.from_config(inbox.to_config()) == inbox
    empty = RelayedInbox(4, 0.2, (), (), b"\x09" * 32)  # a node nobody sends to still gets a valid inbox
    assert RelayedInbox.from_config(empty.to_config()) == empty
    rec = inbox.to_config()
    rec["niss-from"] = ["3"]
    with pytest.raises(ValueError, match="niss-from"):
        RelayedInbox.from_config(rec)
    rec = inbox.to_config()
    del rec["probe-seed"]
    with pytest.raises(ValueError, match="probe-seed"):
        RelayedInbox.from_config(rec)


def test_auth_failures_report():
    assert not AuthFailures.from_config(ConfigRecord({"other": 1}))  # a reply without a report
    report = AuthFailures((BIG, 0), ("missing payload", "malformed relay inbox"))
    assert report and AuthFailures.from_config(report.to_config()) == report
    assert report.describe(9) == [f"{BIG} -> 9: missing payload", "0 -> 9: malformed relay inbox"]
    with pytest.raises(ValueError, match="niss-auth-reason"):
        AuthFailures.from_config(ConfigRecord({"niss-auth-failed": ["1"]}))


def test_metrics_and_diagnostic():
    figures = NissMetrics(0.5, 0.25, 12, received_var=0.125)
    assert NissMetrics.from_metrics(MetricRecord(figures.to_metrics())) == figures
    plain = NissMetrics(0.5, 0.0, 0)
    assert NissMetrics.from_metrics(MetricRecord(plain.to_metrics())).received_var is None
    with pytest.raises(ValueError, match="niss-tau"):
        NissMetrics.from_metrics(MetricRecord({"niss-sigma": 0.5, "niss-shares": 1.0}))
    content = RecordDict({"metrics": MetricRecord({"num-examples": 1})})
    assert Diagnostic.from_content(content) is None
    update = to_record({"w": np.arange(3.0)}, np.float64)
    Diagnostic(update).add_to(content)
    got = Diagnostic.from_content(content)
    assert isinstance(got.update, ArrayRecord) and np.array_equal(got.update["w"].numpy(), np.arange(3.0))


def _message_keys() -> set[str]:
    """The string constants the vocabulary module defines at module level (its keys), less run-config keys.

    (``niss-tau`` names both the run-config entry and the train-reply metric; the run-config key is
    ``RunConfig``'s and may appear wherever runs are configured.)
    """
    tree = ast.parse(Path(messages.__file__).read_text())
    keys = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            keys.add(node.value.value)
    return keys - set(RunConfig().to_mapping())


def test_every_niss_key_lives_only_in_the_vocabulary():
    keys = _message_keys()
    assert {"niss-weight", "niss-payloads", "niss-auth-failed", "diagnostic"} <= keys
    home = Path(messages.__file__).resolve()
    offenders = []
    for pkg in ("server", "strategies", "client", "protocols"):
        for path in (ROOT / pkg).rglob("*.py"):
            if path.resolve() == home:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in keys:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not offenders, "NISS message keys written outside protocols/wire/niss.py:\n" + "\n".join(offenders)
