"""The privacy audit: its statistics, an honest mechanism not flagged, planted faults in the real release code caught."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from scipy.stats import binom, binomtest, norm

from protocols.config import ConfigError, RunConfig
from protocols.privacy import GaussianEvent, PerUnitAccountant, calibrate_noise_multiplier, noise_multiplier
from protocols.privacy.audit import (
    EXCESS_ALPHA,
    audit_scores,
    clopper_pearson,
    delta_excess,
    epsilon_from_rates,
    epsilon_lower_bound,
    fisher_scores,
    gaussian_ceiling,
    odds_lower_bound,
)
from server.audit import run_audit
from server.audit_spec import AuditSpec

DELTA = 1e-5


def test_clopper_pearson_matches_scipy_exact_interval():
    for k, n in [(0, 10), (1, 10), (5, 10), (10, 10), (3, 1000), (997, 1000), (0, 50_000), (412, 99_616)]:
        ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
        lo, hi = clopper_pearson(k, n, 0.05)
        assert lo == pytest.approx(ci.low, rel=1e-9, abs=1e-15)
        assert hi == pytest.approx(ci.high, rel=1e-9, abs=1e-15)
    with pytest.raises(ValueError):
        clopper_pearson(11, 10)


def test_epsilon_from_rates_is_the_dp_inequality():
    assert epsilon_from_rates(0.5, 0.5 * math.exp(-2.0), 0.0) == pytest.approx(2.0)
    assert epsilon_from_rates(1 - 0.5 * math.exp(-1.5), 0.5, 0.0) == pytest.approx(1.5)  # the second inequality
    assert epsilon_from_rates(0.3, 0.4, DELTA) == 0.0


def test_the_bound_is_the_clopper_pearson_end_of_the_hits_odds_less_the_delta_excess():
    # 300 hits, no miss: the odds' lower end is alpha'^(1/300) (a one-sided Clopper-Pearson end with no failure).
    bound = epsilon_lower_bound(300, 0, 1000, DELTA)
    j, a_odds = delta_excess(1000, DELTA)
    assert j == 0 and a_odds == pytest.approx(0.04)
    p = a_odds ** (1 / 300)
    assert bound.epsilon_lb == pytest.approx(math.log(p / (1 - p))) and math.isinf(bound.epsilon_ub)
    # delta sets aside the hits Binomial(n, delta) reaches with probability EXCESS_ALPHA alpha.
    j, _ = delta_excess(300_000, DELTA)
    assert binom.sf(j, 300_000, DELTA) <= EXCESS_ALPHA * 0.05 < binom.sf(j - 1, 300_000, DELTA)
    assert epsilon_lower_bound(93, 4, 300_000, DELTA).epsilon_lb == pytest.approx(
        epsilon_lower_bound(93 - j, 4, 300_000, 0.0, alpha=0.04).epsilon_lb)
    assert delta_excess(300_000, 0.0) == (0, 0.05)
    assert epsilon_lower_bound(0, 5, 100, DELTA).epsilon_lb == 0.0  # no hit proves nothing
    with pytest.raises(ValueError):
        epsilon_lower_bound(60, 50, 100, DELTA)  # hits and misses are disjoint


@pytest.mark.parametrize(("epsilon", "delta", "n"), [(4.0, DELTA, 300_000), (4.0, 0.0, 20_000), (1.0, DELTA, 100_000)])
def test_the_bound_covers_the_worst_mechanism_at_the_claim(epsilon, delta, n):
    """The least favourable trial, ``P(hit) = e^epsilon P(miss) + delta``: epsilon_lb > epsilon in <= alpha of draws.

    Checked where delta dominates the hits and where the odds do.
    """
    rng = np.random.default_rng(11)
    medians = []
    for miss in (2e-5, 3e-3):
        hit = math.exp(epsilon) * miss + delta
        counts = rng.multinomial(n, [hit, miss, 1 - hit - miss], size=4_000)
        lbs = odds_lower_bound(counts[:, 0], counts[:, 1], n, delta)
        exceed = int(np.sum(lbs > epsilon))
        assert binomtest(exceed, len(lbs), 0.05, alternative="greater").pvalue > 1e-3, (miss, exceed)
        medians.append(float(np.median(lbs)))
    assert max(medians) > 0.5 * epsilon  # and the bound is not vacuous


def _gaussian_scores(mu: float, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    labels = rng.choice([-1, 1], size=n)
    return labels * mu / 2 + rng.standard_normal(n), labels, np.arange(n) // 1000


def _true_epsilon(mu: float, delta: float) -> float:
    """Epsilon of a Gaussian mechanism with sensitivity / std = mu at delta (Balle & Wang 2018)."""
    lo, hi = 0.0, 50.0
    for _ in range(100):
        eps = (lo + hi) / 2
        d = norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)
        lo, hi = (eps, hi) if d > delta else (lo, eps)
    return hi


def test_audit_scores_bound_is_below_the_true_epsilon_and_has_power():
    """Gaussian trials of known privacy: the bound never passes the truth and has power.

    With the audit's 300,000 trials it reaches half the claimed 4 every time, and a noise std off by a factor 2 is
    caught.
    """
    rng = np.random.default_rng(7)
    z = calibrate_noise_multiplier(4.0, DELTA, 1.0, 1)
    truth = _true_epsilon(1 / z, DELTA)
    bounds = [audit_scores(*_gaussian_scores(1 / z, 40_000, rng), DELTA).epsilon_lb for _ in range(10)]
    assert max(bounds) <= truth
    big = [audit_scores(*_gaussian_scores(1 / z, 300_000, rng), DELTA) for _ in range(3)]
    assert all(0.5 * 4.0 <= b.epsilon_lb <= truth for b in big), [b.epsilon_lb for b in big]
    assert all(b.epsilon_lb <= gaussian_ceiling(4.0, DELTA, b.trials) + 0.3 for b in big)
    halved = audit_scores(*_gaussian_scores(2 / z, 300_000, rng), DELTA)  # the noise std halved: claim still 4
    assert halved.epsilon_lb > truth, halved


def test_a_statistic_that_separates_every_trial_at_one_value_counts_them_all():
    """A noise-free release scores every trial alike (one value, one per owner at most): every one is a hit.

    The threshold was a quantile of ``|r|`` itself and hits were ``r > t``, so a constant statistic counted none and
    an audit of a release without noise reported epsilon 0 (gldp's planted ``skip-noise``, 3 seeds in 150).
    """
    labels = np.tile([1, -1], 1000)
    groups = np.repeat(np.arange(20), 100)
    for scores in (labels * 2.79e29, labels * 2.0):
        bound = audit_scores(scores, labels, groups, DELTA)
        assert bound.epsilon_lb > 5.0, bound
    assert audit_scores(np.zeros(2000), labels, groups, DELTA).epsilon_lb == 0.0  # no evidence stays none


def test_fisher_scores_separate_views_without_noise_and_skip_an_owner_without_both_sides():
    """Noise-free views (a fault that skips the noise) separate perfectly; no ridge overflows them to inf or nan.

    An owner with fitting trials of one label only has no statistic: its trials score 0, not nan.
    """
    labels = np.tile([1, -1], 50)
    owner = np.repeat([0, 1], 50)
    views = np.where(labels[:, None] > 0, [[0.3, -0.2]], [[0.1, 0.5]]) + 0.0
    fit = np.arange(100) % 4 < 2
    scores = fisher_scores(views, labels, owner, fit)
    assert np.all(np.isfinite(scores)) and np.all(labels * scores > 0)
    one_sided = fit & ~((owner == 1) & (labels < 0))
    scores = fisher_scores(views, labels, owner, one_sided)
    assert np.all(scores[owner == 1] == 0) and np.all(labels[owner == 0] * scores[owner == 0] > 0)


# --------------------------------------------------------------------- the real release code
def test_honest_mechanisms_are_not_flagged():
    for spec in (AuditSpec("ldp", "upload", 1.0, trials=16_000, clients=2),
                 AuditSpec("cdp", "model", 1.0, trials=16_000, clients=2),
                 AuditSpec("nadp", "upload", 1.0, trials=16_000, clients=4, per_client=250)):
        report = run_audit(spec, seed=3)
        assert math.isfinite(report.claimed_epsilon) and report.claimed_epsilon <= spec.epsilon * (1 + 1e-9)
        assert report.trials >= spec.trials and not report.violation, report.line()


def test_niss_and_ddpsa_are_audited_on_their_real_protocols_and_not_flagged():
    """niss: real share phase and distorted shares; ddpsa: real shares pushed to local intermediate servers.

    ddpsa's claim is pure epsilon-DP: the bound uses delta = 0 and the upload view is the reconstructed sum.
    """
    for spec in (AuditSpec("niss", "upload", 1.0, trials=16_000), AuditSpec("niss", "model", 1.0, trials=16_000),
                 AuditSpec("ddpsa", "upload", 4.0, trials=16_000)):
        report = run_audit(spec, seed=3)
        assert math.isfinite(report.claimed_epsilon) and report.claimed_epsilon <= spec.epsilon * (1 + 1e-9)
        assert report.trials >= spec.trials and not report.violation, report.line()
    assert report.delta == 0.0 and report.epsilon_lb > 1.0, report.line()  # ddpsa: pure DP, and the test has power


def test_ddpsa_pld_first_round_is_audited_at_delta():
    """The first of 100 ddpsa rounds calibrated by PLD: its ledger claims it at delta only, so the bound uses delta.

    The round's Laplace is at its claim and the audit reaches that small a claim: at the audit's 95 % a bound above
    it comes with probability up to 5 % (the noise is fresh OS randomness each run), so this test asks 99.9 %.
    """
    pld = run_audit(AuditSpec("ddpsa", "upload", 4.0, trials=16_000, rounds=100,
                              settings=(("ddpsa-composition", "pld"),), alpha=0.001), seed=3)
    assert pld.delta == DELTA and pld.claimed_epsilon < 0.1 and not pld.violation, pld.line()


def test_niss_colluders_within_rho_leave_the_conditioned_view_its_claim(monkeypatch):
    """0, 1 or 2 colluding neighbours of niss (niss-rho 1/2 of 4 covers 2): their material enters the server's view.

    The linear discriminant over every upload plus the colluders' shares with each audited client: signal-to-noise
    ratio times z is what protocols.niss_joint predicts (``1 / (c sqrt(f_K))``, f_K the view given K colluders, c
    the round's scale) and at most 1 (exactly 1 at the two the scale covers).  Planted fault, the scale for no
    colluders: two colluders see 1.11 times the claim's signal-to-noise (the model's need against a receiving
    participant, which the fault leaves, sets that scale: 1.29 against 1.14 for the uploads alone).
    """
    import protocols.niss_joint
    from protocols.graphs import complete_graph
    from protocols.niss import client_tau
    from protocols.niss_joint import joint_factors, joint_scale, receiver_downlink_scale

    spec = AuditSpec("niss", "upload", 4.0, clients=5)
    assert spec.adapter.tolerated_colluders(spec) == 2
    graph, sigmas = complete_graph(range(5)), dict.fromkeys(range(5), 1.0)
    tau = client_tau(RunConfig.from_mapping(spec.run_config()))
    # the round's scale: the joint view's, or the model's need against a receiving participant where larger
    model = receiver_downlink_scale(tau, sigmas, graph)
    covered = joint_scale(joint_factors(sigmas, graph, tau, rho=0.5))
    scale, plain = max(covered, model), max(joint_scale(joint_factors(sigmas, graph, tau)), model)
    z = noise_multiplier(spec.epsilon, spec.delta, 1)
    releases = 36  # measured: the estimate spreads ~1 % and its covariance estimate biases it up ~0.5 %
    for k in (0, 1, 2):
        predicted = 1 / (scale * math.sqrt(joint_factors(sigmas, graph, tau, rho=k / 4)[0]))
        measured = _snr(dataclasses.replace(spec, colluders=k), releases) * z
        assert predicted <= 1 + 1e-12 and measured == pytest.approx(predicted, rel=0.06), (k, predicted, measured)
    assert predicted == pytest.approx(covered / scale, rel=1e-12)  # 1 where the joint view sets the scale
    real = joint_factors
    monkeypatch.setattr(protocols.niss_joint, "joint_factors", lambda *a, **kw: real(*a, **{**kw, "rho": 0.0}))
    fault = _snr(dataclasses.replace(spec, colluders=2), releases) * z
    assert fault == pytest.approx(predicted * scale / plain, rel=0.06) and fault > 1.05, (fault, scale / plain)


def _snr(spec: AuditSpec, releases: int) -> float:
    """Mean over the audited clients of the Fisher signal-to-noise ratio of a canary in ``releases`` releases' view."""
    from server.audit import canaries_for, quiet
    from server.audit_release import release

    cfg = RunConfig.from_mapping(spec.run_config())
    rng = np.random.default_rng(11)
    canaries = canaries_for(spec)
    with quiet():
        rels = [release(spec, cfg, canaries, rng) for _ in range(releases)]
    feats, labels = np.concatenate([r.features for r in rels]), np.concatenate([r.labels for r in rels])
    owner = np.where(np.concatenate([r.audited for r in rels]), np.concatenate([r.owner for r in rels]), -1)
    finite = np.all(np.isfinite(feats), axis=1)
    # a rare non-finite view row (seen twice in full CI runs, never alone) is left out; more than 1 % fails the test
    assert finite.mean() > 0.99, f"{int((~finite).sum())} of {finite.size} view rows are not finite"
    snr = []
    for o in set(owner[finite]) - {-1}:
        keep = finite & (owner == o)
        x, lab = feats[keep], labels[keep]
        shift = x[lab > 0].mean(0) - x[lab < 0].mean(0)
        cov = np.cov(np.where((lab > 0)[:, None], x - x[lab > 0].mean(0), x - x[lab < 0].mean(0)).T)
        snr.append(math.sqrt(shift @ np.linalg.lstsq(np.atleast_2d(cov), shift, rcond=None)[0]))
    return float(np.mean(snr))


def test_planted_fault_halved_noise_is_caught_in_niss_and_ddpsa():
    for method in ("niss", "ddpsa"):
        report = run_audit(AuditSpec(method, "upload", 4.0, trials=8_000, fault="halve-noise"), seed=5)
        assert report.epsilon_lb > report.claimed_epsilon, report.line()


def test_cdp_uploads_claim_nothing_and_the_audit_shows_why():
    report = run_audit(AuditSpec("cdp", "upload", 1.0, trials=8_000, clients=2), seed=3)
    assert math.isinf(report.claimed_epsilon)
    assert report.bound.false_positives == 0 and report.epsilon_lb > 5  # un-noised uploads: perfectly separable


def test_planted_fault_halved_noise_is_caught():
    report = run_audit(AuditSpec("ldp", "upload", 4.0, trials=300_000, clients=2, fault="halve-noise"), seed=5)
    assert report.epsilon_lb > report.claimed_epsilon, report.line()


def test_planted_fault_client_skipping_pair_noise_is_caught():
    spec = AuditSpec("nadp", "upload", 4.0, trials=16_000, clients=8, per_client=250, fault="skip-pair-noise")
    report = run_audit(spec, seed=5)
    assert report.epsilon_lb > report.claimed_epsilon, report.line()


def test_planted_fault_server_recovery_stripping_pair_noise_is_caught():
    spec = AuditSpec("nadp", "upload", 4.0, trials=32_000, clients=8, per_client=250, fault="strip-pair-noise")
    report = run_audit(spec, seed=5)
    assert report.epsilon_lb > report.claimed_epsilon, report.line()


def test_ladp_adaptive_canaries_are_not_flagged_and_catch_a_data_dependent_noise_scale():
    """The adaptive canary's label also moves the layer's KL estimate across [B / max-boost, B].

    Honest ladp (P_j from the server's public estimate) is not flagged; the paper's P_j from the trained
    local model (fault ``private-kl``) sets a noise std 3x apart between the two neighbours, which the
    noise itself reveals: flagged above the claimed epsilon 1.
    """
    honest = run_audit(AuditSpec("ladp", "upload", 1.0, trials=480, canary="adaptive", clients=16), seed=3)
    assert honest.canary == "adaptive" and math.isfinite(honest.claimed_epsilon)
    assert honest.claimed_epsilon <= 1.0 + 1e-9 and not honest.violation, honest.line()
    faulty = run_audit(AuditSpec("ladp", "upload", 1.0, trials=480, clients=16, fault="private-kl"), seed=3)
    assert faulty.canary == "adaptive"  # the fault's own canary (the adapter's fault_canaries)
    assert faulty.epsilon_lb > faulty.claimed_epsilon, faulty.line()


def test_mp_family_downlink_is_audited_given_r_on_the_real_recovery_and_not_flagged():
    """mpddp, mpdp-naive and mpcdp: the published model after MP_Server, client noise and recovery (Eq. 22).

    The model is read with the round's R: every canary of a release counts.
    """
    for method in ("mpddp", "mpdp-naive", "mpcdp"):
        report = run_audit(AuditSpec(method, "model", 1.0, trials=1_200, clients=3, per_client=10), seed=3)
        assert math.isfinite(report.claimed_epsilon) and report.claimed_epsilon <= 1.0 + 1e-9
        assert report.trials >= 1_200 and not report.violation, report.line()
        assert report.bound.trials > report.releases  # given R a release's canaries are independent


def test_mpcdp_uploads_claim_nothing_and_the_server_recovers_them_exactly():
    """The uploads of mpcdp are un-noised and the server holds R: each client's gradient is recovered exactly."""
    report = run_audit(AuditSpec("mpcdp", "upload", 1.0, trials=2_400, clients=3, per_client=2,
                                  adjacency="replace-one"), seed=3)
    assert math.isinf(report.claimed_epsilon)
    assert report.bound.false_positives == 0 and report.bound.true_positives > 0 and report.epsilon_lb > 1


def test_bad_audit_options_are_refused_naming_them():
    for spec, word in ((AuditSpec("fedavg"), "method"), (AuditSpec("ldp", canary="adaptive"), "ladp"),
                       (AuditSpec("nadp", fault="private-kl"), "ladp"), (AuditSpec("ldp", fault="perturbed-clip"), "mpcdp"),
                       (AuditSpec("ldp", direction="down"), "direction"),
                       (AuditSpec("ldp", fault="skip-pair-noise"), "nadp"), (AuditSpec("nadp", colluders=3), "colluders"),
                       (AuditSpec("ldp", colluders=1), "niss"), (AuditSpec("ddpsa", canary="adaptive"), "ladp"),
                       (AuditSpec("ldp", trials=10), "trials")):
        with pytest.raises(ConfigError, match=word):
            spec.validate()


def test_cancelfl_audit_command(tmp_path, capsys):
    """``cancelfl audit`` prints claimed vs audited and writes the JSON report; a bad method exits 2."""
    import json

    from server.launch import main

    out = tmp_path / "audit.json"
    code = main(["audit", "--method", "ldp", "--direction", "model", "--epsilon", "1", "--trials", "8000",
                 "--clients", "2", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "claimed" in printed and "epsilon_lb" in printed and "zero-out" in printed
    report = json.loads(out.read_text())
    assert report["violation"] is False and report["claimed_epsilon"] <= 1.0 + 1e-9
    assert main(["audit", "--method", "fedavg"]) == 2


def test_niss_joint_upload_view_keeps_the_noise_the_uplink_claim_assumes():
    """The server holds every niss upload: its best linear combination of them keeps the charged noise.

    Per coordinate, upload k holds its own shares (variance sigma^2) and the distorted negated shares of its
    m = n - 1 neighbours (variance (1 + tau^2) sigma^2); two neighbours' uploads covary by -2 sigma^2 / m (each
    holds the other's negated share).  The best unbiased combination for client k has variance
    ``sigma^2 (2 + tau^2 + 2/m) / (1 + 2 / (m tau^2))`` (0.795 sigma^2 for 4 clients and tau = 1/2).  Every sigma is
    raised by the round's scale c: the joint view's (protocols.niss_joint: 1.277 here, which also covers the one
    colluding neighbour niss-rho allows) or, larger here, the model's need against a receiving participant (1.414,
    :func:`protocols.niss_joint.receiver_downlink_scale`), so the joint view keeps ``0.795 c^2 sigma^2``.  Measured on the real
    release code: the Fisher discriminant's signal-to-noise ratio over all uploads is ``1 / (z c sqrt(0.795))``
    (1.12 / z at c = 1).
    """
    from protocols.graphs import complete_graph
    from protocols.niss import client_tau
    from protocols.niss_joint import joint_factors, joint_scale, receiver_downlink_scale
    from server.audit import canaries_for, quiet
    from server.audit_release import release

    spec = AuditSpec("niss", "upload", 4.0, clients=4, per_client=500)
    cfg = RunConfig.from_mapping(spec.run_config())
    rng = np.random.default_rng(11)
    canaries = canaries_for(spec)
    with quiet():
        releases = [release(spec, cfg, canaries, rng) for _ in range(40)]
    feats = np.concatenate([r.features for r in releases])
    labels = np.concatenate([r.labels for r in releases])
    owner = np.concatenate([r.owner for r in releases])
    snr = []
    for o in range(spec.clients):
        x, lab = feats[owner == o], labels[owner == o]
        shift = x[lab > 0].mean(0) - x[lab < 0].mean(0)
        cov = np.cov(np.where((lab > 0)[:, None], x - x[lab > 0].mean(0), x - x[lab < 0].mean(0)).T)
        snr.append(math.sqrt(shift @ np.linalg.solve(cov, shift)))
    m, tau = spec.clients - 1, client_tau(cfg)
    ratio = (2 + tau**2 + 2 / m) / (1 + 2 / (m * tau**2))
    z = noise_multiplier(spec.epsilon, spec.delta, 1)
    ones, graph = dict.fromkeys(range(4), 1.0), complete_graph(range(4))
    c = joint_scale(joint_factors(ones, graph, tau, rho=cfg.niss_rho))
    assert ratio < 0.8 and c == pytest.approx(1.2766, abs=1e-4)
    c = max(c, receiver_downlink_scale(tau, ones, graph))  # the round's scale: the model's need where larger
    assert np.mean(snr) == pytest.approx(1 / (z * c * math.sqrt(ratio)), rel=0.05)  # 1.12 / z at c = 1
    # the run's figure for this view (no colluder) is the epsilon of the multiplier measured here; the claim is 4
    acc = PerUnitAccountant()
    acc.compose(GaussianEvent(1 / float(np.mean(snr))), units=[0])
    claims = releases[-1].claims
    assert claims["epsilon_uplink_no_colluder"] == pytest.approx(acc.epsilon(spec.delta), rel=0.08)
    assert claims["epsilon_uplink_no_colluder"] < 0.9 * claims["epsilon_uplink"]
