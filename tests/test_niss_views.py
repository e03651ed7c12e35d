"""NISS's two upload figures: the claim and the view with no colluding neighbour (``epsilon_uplink_no_colluder``).

The claim holds given the worst ``floor(niss-rho x d_k)`` colluding neighbours of each client.

Derivation (:mod:`protocols.niss_joint`): with every ``sigma_k = z Delta f_k`` raised by ``c``, client k's view keeps
``c^2 f_k sigma_k^2``.  The claim charges the multiplier ``z g`` (``g``: the budget guard's raise) with
``c = g max(1, 1/sqrt(min_k f^rho_k)) d`` (``d``: the dropout factor).  A colluder's material only removes noise,
so ``f^0_k >= f^rho_k`` and ``z^0_k = z c sqrt(f^0_k) >= z g``: the figure without colluders is never above the
claim.  Where niss-rho covers no colluder (``floor(rho d_k) = 0``) ``f^0 = f^rho``, and the worst-off client keeps
``z g max(1, sqrt(min f)) d``: exactly the claim when ``min f <= 1`` and ``d = 1``, less (a smaller epsilon)
when the joint view holds more than the charged noise (``min f > 1``, large tau) or a dropout factor applies.
On a complete graph with equal sigmas (m neighbours) ``f^0 = (2 + tau^2 + 2/m) / (1 + 2/(m tau^2))``
(tests/test_audit.py measures it on the real release code).
"""

from __future__ import annotations

import math

import pytest

import protocols.floor
import protocols.niss_joint
from client.methods import niss as niss_client
from protocols.config import RunConfig
from protocols.dropouts import niss_dropout_factor
from protocols.floor import niss_floor
from protocols.graphs import complete_graph, n_out_graph
from protocols.methods import NO_COLLUDER, method_spec
from protocols.niss_joint import (
    joint_factors,
    joint_scale,
    receiver_downlink_multiplier,
    receiver_downlink_scale,
    view_multipliers,
)
from protocols.privacy import GaussianEvent, PerUnitAccountant, noise_multiplier
from server.defaults import app_defaults
from strategies import niss_shares as niss_strategy
from strategies.run.notes import privacy_summary
from strategies.stages import close_round
from tests.niss_setup import FAST, niss_round, niss_setup


def _cfg(**kw) -> RunConfig:
    return RunConfig.from_mapping({**app_defaults(), **FAST, **{k.replace("_", "-"): v for k, v in kw.items()}})


def _closed_form(m: int, tau: float) -> float:
    """``f^0`` of a complete graph with equal sigmas, ``m`` neighbours each."""
    return (2 + tau**2 + 2 / m) / (1 + 2 / (m * tau**2))


SPARSE = n_out_graph(list(range(10)), 2, bytes(range(32)))


@pytest.mark.parametrize("graph", [complete_graph(range(4)), complete_graph(range(6)), SPARSE])
@pytest.mark.parametrize("rho", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("tau", [0.3, 0.5, 1.5])
def test_no_colluder_multiplier_is_never_below_the_claims(graph, rho, tau):
    """Every client's view without colluders keeps at least ``z`` at the claim's scale (unequal sigmas too)."""
    sigmas = {k: 1.0 + 0.37 * (k % 3) for k in graph}
    colluded, alone = joint_factors(sigmas, graph, tau, rho=rho), joint_factors(sigmas, graph, tau)
    c, z = joint_scale(colluded), 1.7
    open_z = view_multipliers(alone, z, c)
    assert min(open_z.values()) >= z * (1 - 1e-12)
    for k in graph:  # conditioning on the colluders' material only removes noise
        assert alone[k] >= colluded[k] * (1 - 1e-12)
        assert open_z[k] == pytest.approx(z * c * math.sqrt(alone[k]), rel=1e-15)
    if rho == 0.0:
        assert min(open_z.values()) == pytest.approx(z * max(1.0, math.sqrt(min(alone.values()))), rel=1e-12)


def test_no_colluder_figure_equals_the_claim_exactly_where_rho_covers_no_colluder():
    """10 clients (9 neighbours each): rho 0 and 0.1 cover none; rho 1/2 covers four, and the figure drops below.

    At tau 0.3 the uploads' joint view sets the round's scale (the model's need against a receiving participant,
    :func:`protocols.niss_joint.receiver_downlink_scale`, is smaller: 1.18 against 1.23).
    """
    graph, sizes = complete_graph(range(10)), dict.fromkeys(range(10), 100)
    z = noise_multiplier(1.0, 1e-5, 1)
    tau = 0.3
    f0 = _closed_form(9, tau)
    assert f0 < 1 and receiver_downlink_scale(tau, dict.fromkeys(graph, 1.0), graph) < 1 / math.sqrt(f0)
    for rho in (0.0, 0.1):
        floor = niss_floor(_cfg(num_clients=10, niss_rho=rho, num_rounds=1), sizes, graph, tau, open_view=True)
        assert floor.scale == pytest.approx(1 / math.sqrt(f0), rel=1e-12)
        assert min(floor.open_multipliers(z).values()) == pytest.approx(z, rel=1e-12)  # the claim exactly
        assert min(floor.open_multipliers(z, 1.5).values()) == pytest.approx(1.5 * z, rel=1e-12)  # guard's raise
    floor = niss_floor(_cfg(num_clients=10, niss_rho=0.5, num_rounds=1), sizes, graph, tau, open_view=True)
    assert min(floor.open_multipliers(z).values()) == pytest.approx(floor.scale * z * math.sqrt(f0), rel=1e-12)
    assert floor.scale * math.sqrt(f0) > 1.1  # more private than the claim without the colluders


def test_the_scale_covers_the_model_against_a_receiving_participant_where_the_joint_view_needs_less():
    """4 clients at tau 0.5: a participant knows half the model's noise; the scale keeps the model's z for the rest."""
    graph, sizes = complete_graph(range(4)), dict.fromkeys(range(4), 100)
    z = noise_multiplier(1.0, 1e-5, 1)
    floor = niss_floor(_cfg(num_clients=4, niss_rho=0.0, num_rounds=1), sizes, graph, 0.5)
    assert floor.scale > 1 / math.sqrt(_closed_form(3, 0.5))
    model = floor.scale * receiver_downlink_multiplier(0.5, dict.fromkeys(graph, 1.0), z, graph)
    assert model == pytest.approx(z, rel=1e-12)


def test_no_colluder_figure_is_below_the_claim_where_the_joint_view_holds_more_or_dropouts_raise_the_scale():
    """At rho 0, ``min f > 1`` (tau 1.5: the scale stays 1) or a dropout factor above 1 leave more than the claim's z."""
    graph, sizes = complete_graph(range(5)), dict.fromkeys(range(5), 100)
    z = noise_multiplier(1.0, 1e-5, 1)
    big = niss_floor(_cfg(niss_rho=0.0, num_rounds=1), sizes, graph, 1.5, open_view=True)
    f0 = _closed_form(4, 1.5)
    assert f0 > 1 and big.scale == 1.0
    assert min(big.open_multipliers(z).values()) == pytest.approx(z * math.sqrt(f0), rel=1e-12)
    graph, sizes = complete_graph(range(10)), dict.fromkeys(range(10), 100)
    drop = niss_floor(_cfg(num_clients=10, niss_rho=0.0, num_rounds=1, dropout_rate=0.05), sizes, graph, 0.3,
                      open_view=True)
    d = niss_dropout_factor(dict.fromkeys(range(10), 1.0), graph, 0.05)
    assert _closed_form(9, 0.3) < 1 and d > 1.5
    assert min(drop.open_multipliers(z).values()) == pytest.approx(z * d, rel=1e-9)


def _round_figures(monkeypatch=None, planted=None) -> tuple[RunConfig, dict[str, float], float]:
    """One real round (5 clients, digits): the ledger's figures and the round's tau; ``planted`` wraps joint_factors."""
    if planted is not None:
        monkeypatch.setattr(protocols.niss_joint, "joint_factors", planted)
    cfg, grid, strategy, arrays = niss_setup(num_rounds=1)
    _msgs, replies = niss_round(grid, strategy, 1, arrays)
    tau = strategy._state.tau
    close_round(strategy, grid, strategy._state, replies)
    return cfg, {**strategy.privacy.report(), **strategy.privacy.extra_report()}, tau


def _epsilon(z: float, delta: float) -> float:
    acc = PerUnitAccountant()
    acc.compose(GaussianEvent(z), units=[0])
    return acc.epsilon(delta)


def test_the_run_reports_both_figures_from_the_round_factors(monkeypatch):
    """A real round: the claim is the target; the second figure is the closed form's view at the round's scale.

    A planted wrong factor for the view without colluders (0.8 f^0) moves the reported figure accordingly: the
    figure is computed from the round's own factors, not a copy.
    """
    cfg, figures, tau = _round_figures()
    m = cfg.num_clients - 1
    z = noise_multiplier(cfg.epsilon, cfg.delta, 1)
    c = joint_scale(joint_factors(dict.fromkeys(range(5), 1.0), complete_graph(range(5)), tau, rho=cfg.niss_rho))
    alone = figures[f"epsilon_{NO_COLLUDER}"]
    assert figures["epsilon_uplink"] == pytest.approx(cfg.epsilon, rel=1e-3)
    assert alone == pytest.approx(_epsilon(z * c * math.sqrt(_closed_form(m, tau)), cfg.delta), rel=1e-9)
    assert alone < 0.95 * figures["epsilon_uplink"]
    real = protocols.niss_joint.joint_factors

    def wrong(*a, **kw):
        f = real(*a, **kw)
        return f if kw.get("rho") else {k: 0.8 * v for k, v in f.items()}

    _, planted, _ = _round_figures(monkeypatch, wrong)
    assert planted[f"epsilon_{NO_COLLUDER}"] == pytest.approx(
        _epsilon(z * c * math.sqrt(0.8 * _closed_form(m, tau)), cfg.delta), rel=1e-9)
    assert planted[f"epsilon_{NO_COLLUDER}"] > alone * 1.05 and planted["epsilon_uplink"] == figures["epsilon_uplink"]


def test_no_colluder_figure_follows_the_noise_scale(monkeypatch):
    """A floor whose scale is 1.3 times larger (every client adds that noise): the figure is that view's epsilon."""
    real = niss_strategy.niss_floor
    monkeypatch.setattr(niss_strategy, "niss_floor",
                        lambda *a, **k: protocols.floor.NissFloor(1.3 * (f := real(*a, **k)).scale, f.factors,
                                                                  f.open_factors))
    monkeypatch.setattr(niss_client, "niss_floor", niss_strategy.niss_floor)
    cfg, figures, tau = _round_figures()
    z = noise_multiplier(cfg.epsilon, cfg.delta, 1)
    c = joint_scale(joint_factors(dict.fromkeys(range(5), 1.0), complete_graph(range(5)), tau, rho=cfg.niss_rho))
    expected = _epsilon(1.3 * z * c * math.sqrt(_closed_form(cfg.num_clients - 1, tau)), cfg.delta)
    assert figures[f"epsilon_{NO_COLLUDER}"] == pytest.approx(expected, rel=1e-9)


def test_summary_names_the_view_without_colluders_only_where_the_card_has_one():
    row = {"epsilon_uplink": 1.0, "epsilon_downlink": 0.8, f"epsilon_{NO_COLLUDER}": 0.7, "epsilon": 1.0}
    niss = privacy_summary(_cfg(), row)
    assert niss["uplink_no_colluder"]["epsilon"] == 0.7 and niss["uplink"]["epsilon"] == 1.0
    assert "no neighbour" in niss["uplink_no_colluder"]["adversary"]
    assert method_spec("niss").guarantee("client").uplink_no_colluder == niss["uplink_no_colluder"]["adversary"]
    assert "uplink_no_colluder" not in privacy_summary(_cfg(method="nadp"), row)
