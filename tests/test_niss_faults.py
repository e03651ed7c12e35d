"""NISS against a lying or tampering server and dropouts, through the real message path (in-process LocalGrid).

* A share request with a wrong size or a shrunken weight is refused; sizes shown to one client only leave it
  relay keys nobody shares.
* A tampered, dropped, redirected or replayed relayed payload: its receiver uploads
  nothing and names the sender; the round goes on without it, its shares removed
  exactly by the dropout recovery (never a silently wrong model).
* Share-phase dropouts re-run the share phase, train-phase dropouts are recovered
  (strategies.recovery), a second dropout during recovery fails the round.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from flwr.app import ConfigRecord

from protocols import niss as niss_math
from protocols.wire.niss import AuthFailures, RelayedInbox, ShareRequest
from server.local_grid import LocalGrid
from strategies.base import RoundFailed
from strategies.niss import NissStrategy
from strategies.stages import close_round
from tests.niss_setup import flat, niss_round, niss_setup

#: The aggregate-noise figures these tests check come from the nodes' noiseless-update diagnostic.
pytestmark = pytest.mark.usefixtures("niss_diagnostics")


def test_a_wrong_size_for_the_client_is_refused():
    """The share request's size list must name this client's own dataset size (it derives tau from the list)."""
    cfg, grid, strategy, arrays = niss_setup()

    class Liar(NissStrategy):
        def exchange(self, grid, nodes, content_fn, action):
            if action != "shares":
                return super().exchange(grid, nodes, content_fn, action)

            def content(node, inner=content_fn):
                rec = inner(node)
                req = ShareRequest.from_config(rec["config"])
                sizes = {n: v + 1 for n, v in req.sizes.items()}
                rec["config"] = ConfigRecord(dataclasses.replace(req, sizes=sizes).to_config())
                return rec
            replies, errors = super().exchange(grid, nodes, content, action)
            self.errors += errors
            return replies, errors

    liar = Liar(cfg)
    liar.errors = []
    with pytest.raises(RoundFailed, match="share exchange did not complete"):
        niss_round(grid, liar, 1, arrays)
    assert liar.errors and all("examples" in e for e in liar.errors)


class _ShareLiar(NissStrategy):
    """A server that rewrites the share request of its ``victims`` with ``rewrite(node, request)``."""

    victims: tuple[int, ...] = ()

    def rewrite(self, node: int, req: ShareRequest) -> ShareRequest:
        raise NotImplementedError

    def exchange(self, grid, nodes, content_fn, action):
        if action != "shares":
            return super().exchange(grid, nodes, content_fn, action)

        def content(node, inner=content_fn):
            rec = inner(node)
            if node in self.victims:
                rec["config"] = ConfigRecord(self.rewrite(node, ShareRequest.from_config(rec["config"])).to_config())
            return rec
        replies, errors = super().exchange(grid, nodes, content, action)
        self.errors += errors
        return replies, errors


def test_a_shrunken_weight_is_refused():
    """A server that gives some clients a smaller p_k is refused.

    Less weight means less noise next to the negated shares they hold, which would expose a target's shares;
    each client computes p_k from the round's view itself.
    """
    cfg, grid, _, arrays = niss_setup()

    class Shrinker(_ShareLiar):
        def rewrite(self, node, req):
            return dataclasses.replace(req, weight=req.weight / 100)

    liar = Shrinker(cfg)
    liar.errors = []
    liar.victims = tuple(grid.node_ids[1:])  # everyone but the target
    with pytest.raises(RoundFailed, match="share exchange did not complete"):
        niss_round(grid, liar, 1, arrays)
    assert liar.errors and all("does not match the round's view" in e for e in liar.errors)


def test_sizes_shown_to_one_client_only_leave_it_keys_nobody_shares():
    """Sizes shown to one client only: its relay keys match nobody's.

    A server that inflates a peer's size in one client's view (and sends the weight that view gives) shrinks
    that client's p_k consistently, but the sizes are part of the view bound into the relay keys: the victim
    cannot open its peers' payloads nor they its, and it uploads nothing.
    """
    cfg, grid, _, arrays = niss_setup()

    class Inflater(_ShareLiar):
        lied: dict[int, float] = {}

        def rewrite(self, node, req):
            other = next(n for n in sorted(req.sizes) if n != node)
            sizes = {**req.sizes, other: req.sizes[other] * 100}
            self.lied[node] = niss_math.aggregation_weights(cfg, req.peers.participants, sizes)[node]
            return dataclasses.replace(req, sizes=sizes, weight=self.lied[node])

        def train_content(self, state, node, arrays):  # the same weight again with the relayed payloads
            content = super().train_content(state, node, arrays)
            if node in self.lied:
                inbox = RelayedInbox.from_config(content["config"])
                content["config"] = ConfigRecord(dataclasses.replace(inbox, weight=self.lied[node]).to_config())
            return content

    liar = Inflater(cfg)
    liar.errors = []
    victim = grid.node_ids[0]
    liar.victims = (victim,)
    _msgs, replies = niss_round(grid, liar, 1, arrays)
    assert not liar.errors  # the victim accepted the (self-consistent) request ...
    by_node = {r.metadata.src_node_id: r for r in replies}
    report = AuthFailures.from_config(by_node[victim].content["config"])
    assert report and "arrays" not in by_node[victim].content  # ... but its shrunken-weight upload never left it
    assert all(AuthFailures.from_config(r.content["config"]).senders == (victim,)
               for n, r in by_node.items() if n != victim)  # its peers cannot open its payloads either


# ------------------------------------------------------------------------- tampering
class TamperGrid(LocalGrid):
    """LocalGrid whose 'server' alters relayed payloads in train messages (set ``mode``)."""

    mode: str = ""
    saved: dict = {}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tampered: list[tuple[int, int]] = []  # (victim, sender of the altered payload) per tampered round

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        train = [m for m in messages if m.metadata.message_type == "train"]
        if train and self.mode:
            inboxes = [RelayedInbox.from_config(m.content["config"]) for m in train]
            first = inboxes[0]
            self.tampered.append((train[0].metadata.dst_node_id, first.from_ids[0]))
            senders, blobs = list(first.from_ids), list(first.payloads)
            if self.mode == "flip":
                b = bytearray(blobs[0])
                b[20] ^= 0x01
                blobs[0] = bytes(b)
            elif self.mode == "drop":
                senders, blobs = senders[1:], blobs[1:]
            elif self.mode == "swap":  # deliver another pair's payload under the same sender label
                blobs[0] = inboxes[1].payloads[0]
            elif self.mode == "replay" and first.round == 1:
                self.saved = {m.metadata.dst_node_id: inbox.payloads for m, inbox in zip(train, inboxes, strict=True)}
            elif self.mode == "replay":
                blobs = list(self.saved[train[0].metadata.dst_node_id])
            tampered = dataclasses.replace(first, from_ids=tuple(senders), payloads=tuple(blobs))
            train[0].content["config"] = ConfigRecord(tampered.to_config())
        return super().send_and_receive(messages, timeout=timeout)


@pytest.mark.parametrize(("mode", "why"), [("flip", "authentication failed"), ("drop", "missing payload"),
                                           ("swap", "authentication failed"), ("replay", "authentication failed")])
def test_tampered_relay_leaves_the_victim_out_and_is_recovered(mode, why):
    """A relayed payload the server altered: the round goes on without its receiver, exactly.

    The receiver uploads nothing and names the sender (who is struck); the dropout recovery removes the shares
    the receiver exchanged.
    """
    _, grid, strategy, arrays = niss_setup(TamperGrid, niss_tau=0.0, cancellation_check=True)
    if mode == "replay":  # round 1 untouched (payloads recorded), round 2 gets round 1's ciphertexts
        grid.mode = "replay"
        _, replies = niss_round(grid, strategy, 1, arrays)
        close_round(strategy, grid, strategy._state, replies)
        rnd = 2
    else:
        grid.mode, rnd = mode, 1
    msgs, replies = niss_round(grid, strategy, rnd, arrays)
    victim = msgs[0].metadata.dst_node_id
    assert grid.tampered[-1][0] == victim
    new_arrays, _ = close_round(strategy, grid, strategy._state, replies)
    # the victim is the only one excluded, with the reason it reported; it gets no strike (not its fault)
    assert list(strategy.excluded) == [victim]
    assert why in strategy.excluded[victim] and "uploaded nothing" in strategy.excluded[victim]
    assert victim not in strategy.strikes.count
    rep = strategy.round_report()
    assert rep["recovery"] == 1 and rep["cancellation_residual"] <= 1e-9 and rep["aggregate_error_rel"] <= 1e-9
    assert new_arrays is not None and np.all(np.isfinite(flat(new_arrays)))
    # the victim uploaded nothing; nobody else complained
    bad = [r for r in replies if "config" in r.content and AuthFailures.from_config(r.content["config"])]
    assert [r.metadata.src_node_id for r in bad] == [victim] and "arrays" not in bad[0].content
    # the sender(s) the victim names are struck once and keep their upload; nobody else is struck
    named = set(AuthFailures.from_config(bad[0].content["config"]).senders)
    if mode != "replay":  # one altered payload: its sender label is the one the victim names
        assert named == {grid.tampered[-1][1]}
    assert named and victim not in named and strategy.strikes.count == dict.fromkeys(named, 1)
    assert named <= strategy.uploaded and not named & set(strategy.excluded) and not strategy.strikes.banned


def test_runner_completes_tampered_rounds(tmp_path, monkeypatch):
    """Through the runner: every round with a tampered payload completes without its victim.

    The sender the victim names is struck each round; at ``max-strikes`` rounds in a row it is left out of later
    rounds.  Every round's model comes only from the honest uploads (the noise cancels exactly).  (An excluded
    victim leaves its round dearer than planned; the budget guard, tested in test_budget_cap, is off here.)
    """
    from server.runner import run_federation
    from strategies.run.budget import BudgetGuard

    monkeypatch.setattr(BudgetGuard, "before_round", lambda self, rnd: None)

    # round 3 has 4 clients (3 neighbours each): no colluders assumed, so the self-mask threshold 2 of 3 lets one drop
    cfg, grid, strategy, _ = niss_setup(TamperGrid, niss_tau=0.0, num_rounds=3, max_strikes=2, mask_corruption_rate=0.0,
                                    cancellation_check=True, out_dir=str(tmp_path / "t"))
    grid.mode = "flip"
    summary = run_federation(strategy, grid, cfg, progress=lambda _s: None)
    assert summary["failed_rounds"] == [] and summary["rounds_completed"] == 3 and summary["model_round"] == 3
    rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and len(grid.tampered) == 3
    for row, (victim, _sender) in zip(rows, grid.tampered, strict=True):
        assert not row["failed"] and list(row["excluded"]) == [str(victim)]
        assert "authentication failed" in row["excluded"][str(victim)]
        assert row["recovery"] == 1 and row["cancellation_residual"] <= 1e-9 and row["aggregate_error_rel"] <= 1e-9
    (v1, s1), (v2, s2), (_v3, s3) = grid.tampered
    assert (v1, s1) == (v2, s2)  # the same pair is tampered while both take part
    assert rows[0]["left_out"] == [] and rows[1]["left_out"] == rows[2]["left_out"] == [str(s1)]
    assert s3 != s1 and rows[2]["clients"] == cfg.num_clients - 1  # the banned sender is no longer sampled
    assert list(strategy.strikes.banned) == [s1] and "failed 2 rounds in a row" in strategy.strikes.banned[s1]
    assert f"rejected by neighbour(s) [{v1}]" in strategy.strikes.banned[s1]


# -------------------------------------------------------------------------- dropouts
class PhaseDropGrid(LocalGrid):
    """LocalGrid where node ``victim`` drops messages of type ``phase``."""

    victim: int = 0
    phase: str = ""

    def send_and_receive(self, messages, *, timeout=None):
        messages = [m for m in messages
                    if not (m.metadata.dst_node_id == self.victim and m.metadata.message_type == self.phase)]
        return super().send_and_receive(messages, timeout=timeout)


def test_share_phase_dropout_is_recovered():
    _, grid, strategy, arrays = niss_setup(PhaseDropGrid, niss_tau=0.0, cancellation_check=True)
    grid.victim, grid.phase = grid.node_ids[2], "query.shares"
    msgs, replies = niss_round(grid, strategy, 1, arrays)
    assert len(msgs) == 4 and grid.victim not in {m.metadata.dst_node_id for m in msgs}
    close_round(strategy, grid, strategy._state, replies)
    rep = strategy.round_report()
    assert rep["participants"] == 4 and rep["dropped"] == 1
    assert rep["aggregate_error_rel"] <= 1e-9  # the survivors' shares still cancel


def test_train_dropout_is_recovered():
    """A client that drops after the share exchange: the shares it exchanged are removed exactly.

    The survivors reveal them (strategies.recovery); the survivors' own shares still cancel.
    """
    _, grid, strategy, arrays = niss_setup(PhaseDropGrid, niss_tau=0.0, cancellation_check=True)
    grid.victim, grid.phase = grid.node_ids[1], "train"
    _, replies = niss_round(grid, strategy, 1, arrays)
    close_round(strategy, grid, strategy._state, replies)
    rep = strategy.round_report()
    assert rep["dropped"] == 1 and rep["recovery"] == 1 and rep["kept_pairs"] == 0
    assert rep["aggregate_error_rel"] <= 1e-9 and rep["cancellation_residual"] <= 1e-9


def test_train_dropout_without_recovery_fails_the_round():
    """A strategy whose recovery phase cannot reach the survivors fails the round instead of keeping the noise."""
    _, grid, strategy, arrays = niss_setup(PhaseDropGrid, niss_tau=0.0)
    grid.victim, grid.phase = grid.node_ids[1], "train"
    _, replies = niss_round(grid, strategy, 1, arrays)
    grid.victim, grid.phase = grid.node_ids[2], "query.recover"  # a second dropout, during recovery
    with pytest.raises(RoundFailed, match="did not answer"):
        close_round(strategy, grid, strategy._state, replies)
