"""NISS against a malicious server that drives the real client handlers with forged or inconsistent inputs.

* Neighbours shown other run settings than a client (a larger epsilon: they add almost no noise of their own, so
  the negated shares of the client's noise they upload are bare): the client's floor assumed they calibrate as it
  does.  Measured without the binding below: the sum of the uploads leaves the victim 0.63 of the noise std its
  ledger charges (5 clients, complete graph).  The run settings are bound into the round's view
  (:func:`protocols.identity.settings_digest`), so such neighbours share no relay key with it: nobody uploads.
* Two share requests in one round at different joint-view scales, each client's payloads relayed from whichever
  request suits the server: a victim asked alone at 4x the scale charges its ledger for 4x the multiplier, while
  its neighbours' noise stays at 1x; measured (5 clients, complete graph, tau = 0.447, niss-rho = 0.5): its joint
  view keeps 1.90 z, 0.475 of the 4 z charged (epsilon 0.071 per round where the ledger records 0.031).  Everyone
  asked twice and the victim handed the first request's payloads: they opened, and their noise did not cancel
  (the aggregate's error std 0.46 against 0.35).  The scale is bound into the payloads' associated data, and the
  same request always draws the same shares (:func:`client.methods.niss.share_seed`), so a payload that opens
  carries the very shares its sender holds for the view and scale the receiver trains under.
* One share request delivered to a node twice at once: Flower's SuperNode may start both ClientApps on the node's
  ``Context.state`` from before either, and keeps the state the last one pushes.  A share secret made in
  ``Context.state`` on first use gives each task its own: the node trains with the shares of one answer while its
  neighbours hold the negated shares of the other, and its noise does not cancel.  The secret is random and pinned
  beside the node's ledger (:func:`client.methods.niss.share_secret`): both tasks seal the same shares.  A secret
  derived from public inputs (a simulation identity derives from the run seed) would let the server compute the
  shares and strip the noise: two nodes alike in everything public draw different secrets.
* A ``niss-tau`` so small that float64 cannot compute the joint view's factors (they came out too large, so the
  floor too small): refused below :data:`protocols.niss.MIN_TAU`.
"""

from __future__ import annotations

import copy
import stat

import pytest
from flwr.app import RecordDict

from client.app import app as client_app
from client.env import ClientEnv
from client.identity import node_identity
from client.ledger import ledger_dir
from client.methods.niss import SECRET_PURPOSE, STATE_KEY, share_secret
from protocols.graphs import complete_graph
from protocols.niss import MIN_TAU
from protocols.niss_joint import joint_factors
from protocols.wire.niss import AuthFailures
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies.base import RoundFailed
from strategies.niss import NissStrategy
from strategies.niss_shares import _share_reply
from strategies.stages import run_round
from tests.niss_setup import FAST, niss_round, niss_setup

#: The aggregate-noise figures come from the nodes' noiseless-update diagnostic.
niss_diagnostics = pytest.mark.usefixtures("niss_diagnostics")


class AskedAgain(NissStrategy):
    """A server that asks for one round's shares at each of ``factors`` times the round's scale in turn.

    It relays each sender's last payloads, but the first participant (the victim) gets its neighbours' payloads from
    the answers to ``factors[stale]`` (None: the last).  ``victim_only``: the later requests go to the victim alone.
    """

    factors: tuple[float, ...] = (1.0, 4.0)
    stale: int | None = 0
    victim_only = False

    def _share_phase(self, grid, kr):
        kr, self._ahead = self._sized(kr), None
        weights, scale, self.victim = self._weights(kr), self._scale(kr), kr.participants[0]
        self.answers, last = [], {}
        for i, factor in enumerate(self.factors):
            nodes = [self.victim] if i and self.victim_only else kr.participants
            replies, errors = self.exchange(grid, nodes, lambda n, sc=scale * factor: RecordDict(
                {"config": self._share_request(kr, n, weights, sc)}), "shares")
            assert not errors, errors
            self.answers.append({n: _share_reply(r, kr.neighbours[n]) for n, r in replies.items()})
            last.update(self.answers[-1])
        return kr, last

    def plan(self, grid, st):
        state = super().plan(grid, st)
        if self.stale is not None:
            senders = state.inbox[self.victim][0]
            state.inbox[self.victim] = (senders, [self.answers[self.stale][s].payloads[
                self.answers[self.stale][s].to_ids.index(self.victim)] for s in senders])
        return state


def _reports(strategy: AskedAgain, replies) -> dict[int, set[int]]:
    """Per node that uploaded nothing, the senders whose payloads it rejected."""
    return {r.metadata.src_node_id: set(AuthFailures.from_config(r.content["config"]).senders)
            for r in replies if "arrays" not in r.content}


def test_shares_sealed_for_another_scale_of_the_round_do_not_open():
    """Everyone asked at 1x then 4x the scale; the victim handed its neighbours' 1x payloads rejects them all."""
    cfg, grid, _, arrays = niss_setup(self_mask=False)
    strategy = AskedAgain(cfg)
    _msgs, replies = niss_round(grid, strategy, 1, arrays)
    assert _reports(strategy, replies) == {strategy.victim: set(grid.node_ids) - {strategy.victim}}


def test_a_client_asked_at_another_scale_than_its_neighbours_shares_nothing_with_them():
    """The victim alone asked again at 4x (its ledger would credit it 4x): no pair of it opens the other's payloads."""
    cfg, grid, _, arrays = niss_setup(self_mask=False)
    strategy = AskedAgain(cfg)
    strategy.victim_only, strategy.stale = True, None
    _msgs, replies = niss_round(grid, strategy, 1, arrays)
    victim, others = strategy.victim, set(grid.node_ids) - {strategy.victim}
    assert _reports(strategy, replies) == {victim: others, **{n: {victim} for n in others}}


@niss_diagnostics
def test_a_request_asked_again_after_another_scale_draws_the_same_shares():
    """Asked at 1x, 2x, then 1x again: the first answers (relayed to the victim) hold the shares of the last."""
    cfg, grid, _, arrays = niss_setup(self_mask=False, niss_tau=0.0, cancellation_check=True, num_rounds=1)
    strategy = AskedAgain(cfg)
    strategy.factors = (1.0, 2.0, 1.0)
    run_round(strategy, grid, 1, arrays)
    report = strategy.round_report()
    assert report["participants"] == cfg.num_clients and report["aggregate_error_rel"] <= 1e-9


class TwoTasks(NissStrategy):
    """A server whose share request reaches the victim twice at once, each task on a copy of its ``Context``.

    The victim keeps the first task's state (its push lands last); its neighbours get the second task's payloads.
    ``local``: the in-process grid whose contexts the tasks run on.
    """

    local = None

    def _share_phase(self, grid, kr):
        kr, self._ahead = self._sized(kr), None
        weights, scale, self.victim = self._weights(kr), self._scale(kr), kr.participants[0]

        def ask(n):
            return RecordDict({"config": self._share_request(kr, n, weights, scale)})

        before = copy.deepcopy(self.local.contexts[self.victim])  # the second task's copy, taken before either runs
        replies, errors = self.exchange(grid, kr.participants, ask, "shares")
        assert not errors, errors
        answers = {n: _share_reply(r, kr.neighbours[n]) for n, r in replies.items()}
        first, self.local.contexts[self.victim] = self.local.contexts[self.victim], before
        again, errors = self.exchange(grid, [self.victim], ask, "shares")
        assert not errors, errors
        answers[self.victim] = _share_reply(again[self.victim], kr.neighbours[self.victim])
        self.seeds = [list(c.state[STATE_KEY]["out-seeds"]) for c in (first, before)]
        self.local.contexts[self.victim] = first
        return kr, answers


@niss_diagnostics
def test_two_tasks_of_one_node_on_copies_of_its_state_seal_the_same_shares():
    """The victim trains on one task's shares, its neighbours hold the other's: they cancel (tau = 0: exactly)."""
    cfg, grid, _, arrays = niss_setup(self_mask=False, niss_tau=0.0, cancellation_check=True, num_rounds=1)
    strategy = TwoTasks(cfg)
    strategy.local = grid
    run_round(strategy, grid, 1, arrays)
    assert strategy.seeds[0] == strategy.seeds[1]
    report = strategy.round_report()
    assert report["participants"] == cfg.num_clients and report["aggregate_error_rel"] <= 1e-9


def test_the_share_secret_is_no_function_of_public_inputs_and_only_its_owner_reads_it():
    """Two fresh nodes alike in run config, run id and (seed-derived) identity draw different secrets, kept 0600."""
    raw = {**app_defaults(), **FAST}
    grids = [LocalGrid(client_app, 2, raw, run_id=4242, identities=False) for _ in range(2)]
    contexts = [g.contexts[g.node_ids[0]] for g in grids]
    envs = [ClientEnv.from_context(c) for c in contexts]
    assert node_identity(envs[0]).identity.public_bytes == node_identity(envs[1]).identity.public_bytes
    secrets_ = [share_secret(e) for e in envs]
    assert secrets_[0] != secrets_[1] and all(len(s) == 32 for s in secrets_)
    for ctx, secret in zip(contexts, secrets_, strict=True):
        # a later task on a copy of the state from before reads the pinned secret
        assert share_secret(ClientEnv.from_context(copy.deepcopy(ctx))) == secret
        (path,) = ledger_dir(ctx.node_config).glob(f"*.{SECRET_PURPOSE}.secret")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_bytes() == secret
        assert not any(secret.hex() in p.read_text() for p in ledger_dir(ctx.node_config).glob("*.json"))


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
