"""NISS against a malicious server that drives the real client handlers with forged or inconsistent inputs.

* Neighbours shown other run settings than a client (a larger epsilon: they add almost no noise of their own, so
  the negated shares of the client's noise they upload are bare): the client's floor assumed they calibrate as it
  does.  Measured without the binding below: the sum of the uploads leaves the victim 0.63 of the noise std its
  ledger charges (5 clients, complete graph).  The run settings are bound into the round's view
  (:func:`protocols.identity.settings_digest`), so such neighbours share no relay key with it: nobody uploads.
"""

from __future__ import annotations

from protocols.wire.niss import AuthFailures
from tests.niss_setup import niss_round, niss_setup


def test_neighbours_under_other_run_settings_share_no_relay_key():
    """A server that gives every neighbour of a victim ``epsilon = 1e4`` gets no upload from anyone."""
    _cfg, grid, strategy, arrays = niss_setup(self_mask=False)
    victim, others = grid.node_ids[0], grid.node_ids[1:]
    for node in others:
        grid.contexts[node].run_config["epsilon"] = 1e4
    _msgs, replies = niss_round(grid, strategy, 1, arrays)
    by_node = {r.metadata.src_node_id: r for r in replies}
    assert "arrays" not in by_node[victim].content  # the victim could not open its neighbours' payloads
    assert set(AuthFailures.from_config(by_node[victim].content["config"]).senders) == set(others)
    assert all(victim in AuthFailures.from_config(by_node[n].content["config"]).senders for n in others)
