"""The accountant against known values and exact RDP identities."""

from __future__ import annotations

import math

import pytest

from protocols.accounting import GaussianAccountant, calibrate_noise_multiplier, gaussian_epsilon


def test_abadi_moments_accountant_value():
    """Abadi et al. 2016: q=0.01, sigma=4, 10k steps, delta=1e-5 gives epsilon ~1.26.

    That is the moments accountant; modern RDP conversions are slightly tighter.
    """
    eps = gaussian_epsilon(4.0, 0.01, 10_000, 1e-5)
    assert 0.95 < eps < 1.3


def test_gaussian_composition_is_exact_in_rdp():
    """T releases with sigma equal one release with sigma/sqrt(T) (RDP of the Gaussian is linear in 1/sigma^2)."""
    for steps in (4, 25):
        assert gaussian_epsilon(3.0, 1.0, steps, 1e-5) == pytest.approx(
            gaussian_epsilon(3.0 / math.sqrt(steps), 1.0, 1, 1e-5), rel=1e-9)


def test_single_gaussian_matches_classic_bound():
    """One Gaussian release: the RDP epsilon is below the classic sqrt(2 ln(1.25/delta))/sigma bound (eps<1 regime)."""
    sigma, delta = 5.0, 1e-5
    classic = math.sqrt(2 * math.log(1.25 / delta)) / sigma
    eps = gaussian_epsilon(sigma, 1.0, 1, delta)
    assert 0.5 * classic < eps < classic


@pytest.mark.parametrize(("eps", "q", "steps"), [(1.0, 1.0, 20), (1.0, 0.1, 100), (8.0, 0.5, 10)])
def test_calibration_round_trip(eps, q, steps):
    z = calibrate_noise_multiplier(eps, 1e-5, q, steps)
    assert gaussian_epsilon(z, q, steps, 1e-5) <= eps
    assert gaussian_epsilon(z * 0.99, q, steps, 1e-5) > eps


def test_amplification_and_monotonicity():
    assert gaussian_epsilon(1.0, 0.1, 10, 1e-5) < gaussian_epsilon(1.0, 1.0, 10, 1e-5)
    assert gaussian_epsilon(2.0, 1.0, 10, 1e-5) < gaussian_epsilon(1.0, 1.0, 10, 1e-5)


def test_incremental_accountant_matches_batch():
    acc = GaussianAccountant(delta=1e-5)
    assert acc.epsilon() == 0.0
    for _ in range(10):
        acc.compose(2.0, 0.2)
    assert acc.epsilon() == pytest.approx(gaussian_epsilon(2.0, 0.2, 10, 1e-5))


def test_bad_inputs():
    with pytest.raises(ValueError):
        gaussian_epsilon(0.0, 1.0, 1, 1e-5)
    with pytest.raises(ValueError):
        gaussian_epsilon(1.0, 0.0, 1, 1e-5)
    with pytest.raises(ValueError):
        calibrate_noise_multiplier(-1.0, 1e-5, 1.0, 1)
