"""NISS against a malicious server that drives the real client handlers with forged or inconsistent inputs.

* Neighbours shown other run settings than a client (a larger epsilon: they add almost no noise of their own, so
  the negated shares of the client's noise they upload are bare): the client's floor assumed they calibrate as it
  does.  Measured without the binding below: the sum of the uploads leaves the victim 0.63 of the noise std its
  ledger charges (5 clients, complete graph).  The run settings are bound into the round's view
  (:func:`protocols.identity.settings_digest`), so such neighbours share no relay key with it: nobody uploads.
* A ``niss-tau`` so small that float64 cannot compute the joint view's factors (they came out too large, so the
  floor too small): refused below :data:`protocols.niss.MIN_TAU`.
"""

from __future__ import annotations

import pytest

from protocols.graphs import complete_graph
from protocols.niss import MIN_TAU
from protocols.niss_joint import joint_factors
from protocols.wire.niss import AuthFailures
from strategies.base import RoundFailed
from strategies.niss import NissStrategy
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


def test_joint_factors_refuse_a_tau_float64_cannot_resolve():
    """Near ``tau = 0`` the uploads' covariance is nearly singular: float64 overstated ``f`` by 1.39 at 2e-8.

    On 5 clients (complete graph, equal sigmas, no colluder; closed form ``(2 + tau^2 + 2/m) / (1 + 2/(m tau^2))``)
    the scale from that ``f`` left the view 0.85 of the std the ledger charges; at 1e-8 the inverse failed.
    """
    graph, sigmas = complete_graph(range(5)), dict.fromkeys(range(5), 1.0)
    with pytest.raises(ValueError, match="MIN_TAU"):
        joint_factors(sigmas, graph, 2e-8)
    tau, m = MIN_TAU, 4
    exact = (2 + tau**2 + 2 / m) / (1 + 2 / (m * tau**2))
    assert joint_factors(sigmas, graph, tau)[0] == pytest.approx(exact, rel=1e-9)


def test_a_client_refuses_a_run_config_with_a_tau_below_the_reliable_one():
    """A run config with ``niss-tau = 2e-8`` (the server's choice): every client refuses it, naming the key."""
    cfg, grid, _, arrays = niss_setup()
    for ctx in grid.contexts.values():
        ctx.run_config["niss-tau"] = 2e-8

    class Recording(NissStrategy):
        errors: list[str] = []

        def exchange(self, grid, nodes, content_fn, action):
            replies, errors = super().exchange(grid, nodes, content_fn, action)
            self.errors += errors
            return replies, errors

    strategy = Recording(cfg)
    with pytest.raises(RoundFailed):
        niss_round(grid, strategy, 1, arrays)
    assert len(strategy.errors) == len(grid.node_ids) and all("'niss-tau'" in e for e in strategy.errors)


def test_settings_that_change_no_peers_noise_leave_the_pair_keys_alone():
    """Where a node writes, reads its data, trains, and the server's timeout differ freely between the nodes of a run."""
    from protocols.config import RunConfig
    from protocols.identity import settings_digest

    base = RunConfig.from_mapping({"method": "niss"})
    same = RunConfig.from_mapping({"method": "niss", "out-dir": "/elsewhere", "round-timeout": 7.0, "device": "cpu"})
    assert settings_digest(base) == settings_digest(same)
    assert settings_digest(base) != settings_digest(RunConfig.from_mapping({"method": "niss", "epsilon": 2.0}))
