"""A pairwise client's work per round follows its neighbours, not the number of clients.

Per train message the client checks the round's view once (however many seeds, masks and graphs it derives from
it), verifies at most its peers' keys and derives a fixed number of seeds per peer: the counts are the same
functions of the peer count at 6 and at 16 clients (nadp, niss: sparse n-out graph; mpddp: complete graph).
"""

from __future__ import annotations

from collections import Counter
from unittest import mock

import pytest

import client.identity as identity
import client.pairwise_phase as pairwise_phase
from protocols.wire.keys import PeerKeys
from protocols.wire.niss import AHEAD_RECORD
from server.local_grid import LocalGrid

#: nadp and niss on a sparse graph; mpddp's calibration (Theorem 11) needs far more clients for one: complete.
GRAPHS = {"nadp": {"graph": "n-out", "n_out": 2}, "niss": {"graph": "n-out", "n_out": 2}, "mpddp": {"graph": "complete"}}


def _per_message_counts(run_inprocess, method: str, n: int, out: str) -> list[tuple[int, Counter]]:
    """(peers, calls) of every message showing a view, in a 2-round in-process run of ``method`` with ``n`` clients."""
    calls: Counter = Counter()
    seen: list[tuple[int, Counter]] = []

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    class CountingGrid(LocalGrid):
        def send_and_receive(self, messages, *, timeout=None):
            replies = []
            for msg in messages:
                calls.clear()
                out = list(super().send_and_receive([msg], timeout=timeout))
                if calls["check"] or calls["seed"]:  # a message that shows the round's view (train, niss' shares)
                    assert out and not out[0].has_error(), out[0].error if out else "no reply"
                    # niss's train message shows the next round's view in its ahead share request
                    view = msg.content[AHEAD_RECORD] if AHEAD_RECORD in msg.content else msg.content["config"]
                    seen.append((len(PeerKeys.from_config(view).peer_ids), Counter(calls)))
                replies.extend(out)
            return replies

    patches = [mock.patch.object(pairwise_phase, "_checked", counted("check", pairwise_phase._checked)),
               mock.patch.object(identity, "verify_key", counted("verify", identity.verify_key)),
               mock.patch.object(pairwise_phase, "derive_pair_seed",
                                 counted("seed", pairwise_phase.derive_pair_seed))]
    for p in patches:
        p.start()
    try:
        with mock.patch("server.local_grid.LocalGrid", CountingGrid):
            _, rows = run_inprocess(method=method, num_clients=n, num_rounds=2, dataset="digits", **GRAPHS[method],
                                    local_epochs=1, batch_size=64, hidden="8", test_subset=100, divergence_factor=0,
                                    out_dir=out)
    finally:
        for p in patches:
            p.stop()
    assert not any(r["failed"] for r in rows), rows
    assert len(rows) == 2, rows
    return seen


@pytest.mark.parametrize("method", ["nadp", "niss", "mpddp"])
def test_per_client_checks_and_derivations_follow_the_neighbours_not_the_federation(run_inprocess, one_thread,
                                                                                   tmp_path, method):
    per_peer: dict[int, set[int]] = {}
    for n in (6, 16):
        seen = _per_message_counts(run_inprocess, method, n, str(tmp_path / f"run-{n}"))
        assert len(seen) >= 2 * n  # every client showed a view in both rounds
        for peers, calls in seen:
            assert calls["check"] == 1, calls  # the view is checked once per message
            assert calls["verify"] <= peers  # only the peers' keys, each at most once
            assert peers >= 1 and calls["seed"] % peers == 0
        # seeds per peer (one per purpose): the same at 6 and 16 clients
        per_peer[n] = {calls["seed"] // peers for peers, calls in seen}
    assert per_peer[6] == per_peer[16], per_peer
    assert max(per_peer[16]) <= 4
