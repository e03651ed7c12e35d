"""DDP-SA against a malicious parameter server: sums over part of the round, registrations other than the view.

A client's distributed noise share is ``1/n'`` of one central noise: it is only private summed with the shares of
the participants it was shown.  These tests drive the real client code and the real intermediate server processes
with a server that asks for less.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord

from protocols.ddpsa import gamma_difference_epsilon
from protocols.privacy import l1_sensitivity, laplace_scale
from protocols.wire.intermediate import PartialSumUnavailableError, reconstruct_sum
from strategies.ddpsa import DdpsaStrategy
from tests.test_ddpsa_method import LINEAR, _initial, _served, credentials  # noqa: F401 (autouse fixture)
from tests.test_ddpsa_noise import noise_seen  # noqa: F401 (fixture)


def _train(strategy: DdpsaStrategy, cfg, grid) -> list:
    msgs = list(strategy.configure_train(1, _initial(cfg), ConfigRecord({"round": 1}), grid))
    return list(grid.send_and_receive(msgs))


def test_a_partial_sum_over_part_of_the_round_is_refused(noise_seen) -> None:  # noqa: F811 (fixture)
    """All 4 shown participants pushed; the server asks the sum of 2: it would hold half the central noise.

    Two Gamma(1/4, b) differences are a Gamma(1/2, b) difference, whose density is unbounded at 0 (no finite
    epsilon), while each client's ledger charged ``eps_t``.  The intermediate servers refuse it.
    """
    with _served(num_clients=4, num_rounds=2, ddpsa_collude_frac=0.0, **LINEAR) as (cfg, grid, _):
        strategy = DdpsaStrategy(cfg)
        try:
            replies = _train(strategy, cfg, grid)
            assert not any(r.has_error() for r in replies) and len(noise_seen) == 4
            names = sorted(strategy.names.values())
            b = laplace_scale(l1_sensitivity(cfg.clip, adjacency=cfg.adjacency), strategy.epsilon_of_round(1))
            noise = noise_seen[0] + noise_seen[1]
            # What the pair's sum would leave: half the variance of the Lap(b) each ledger charged, and no epsilon.
            assert np.var(noise) == pytest.approx(b * b, rel=0.35)
            assert gamma_difference_epsilon(2 / 4, strategy.epsilon_of_round(1), noise.size) == float("inf")
            with pytest.raises(PartialSumUnavailableError, match="participants it was shown"):
                reconstruct_sum(strategy.servers, strategy.run_id, 1, names[:2], strategy.signer, threshold=strategy.shamir)
            # Sealed by nothing: the whole round still reconstructs.
            reconstruct_sum(strategy.servers, strategy.run_id, 1, names, strategy.signer, threshold=strategy.shamir)
        finally:
            strategy.close()


class _RegistersOthers(DdpsaStrategy):
    """Shows every client all the round's names but opens the round for the first two and a name of its own."""

    def _open_round(self, server_round: int, length: int, participants: list[str]) -> None:
        super()._open_round(server_round, length, [*sorted(participants)[:2], "sybil"])


def test_a_round_registered_for_other_participants_than_shown_gets_no_share(noise_seen) -> None:  # noqa: F811
    """A push names the participants its client was shown; a server that registered others refuses it."""
    with _served(num_clients=4, num_rounds=2, **LINEAR) as (cfg, grid, _):
        strategy = _RegistersOthers(cfg)
        try:
            replies = _train(strategy, cfg, grid)
        finally:
            strategy.close()
    assert len(replies) == 4 and all(r.has_error() for r in replies)
    assert sum("participants it was shown" in r.error.reason for r in replies) == 2


def test_shares_sized_for_dropouts_sum_over_the_rest_and_no_fewer(noise_seen) -> None:  # noqa: F811 (fixture)
    """Shares sized for one dropout of 4 (``ddpsa-dropout-frac = 0.25``): the servers sum 3 of them, not 2.

    Each share is 1/3 of the central Laplace, so any 3 shares hold one ``Lap(b)`` (variance ``2 b^2``).
    """
    with _served(num_clients=4, num_rounds=2, ddpsa_collude_frac=0.0, ddpsa_dropout_frac=0.25, **LINEAR) as (
            cfg, grid, _):
        strategy = DdpsaStrategy(cfg)
        try:
            replies = _train(strategy, cfg, grid)
            assert not any(r.has_error() for r in replies) and len(noise_seen) == 4
            names = sorted(strategy.names.values())
            b = laplace_scale(l1_sensitivity(cfg.clip, adjacency=cfg.adjacency), strategy.epsilon_of_round(1))
            assert np.var(noise_seen[0] + noise_seen[1] + noise_seen[2]) == pytest.approx(2 * b * b, rel=0.35)
            assert gamma_difference_epsilon(3 / 3, strategy.epsilon_of_round(1), noise_seen[0].size) == pytest.approx(
                strategy.epsilon_of_round(1))
            with pytest.raises(PartialSumUnavailableError, match="participants it was shown"):
                reconstruct_sum(strategy.servers, strategy.run_id, 1, names[:2], strategy.signer, threshold=strategy.shamir)
            reconstruct_sum(strategy.servers, strategy.run_id, 1, names[:3], strategy.signer, threshold=strategy.shamir)
        finally:
            strategy.close()
