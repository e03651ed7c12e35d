"""Differential privacy, in one place: mechanisms, released events, accountants, composition theorems.

* :mod:`~protocols.privacy.mechanisms` -- one release: Gaussian (classic, analytic) and Laplace noise.
* :mod:`~protocols.privacy.events` -- what was released (:class:`GaussianEvent`, :class:`LaplaceEvent`).
* :mod:`~protocols.privacy.accountant` -- the :class:`Accountant` interface (compose events, ``epsilon(delta)``,
  JSON state) and its implementations; every RDP figure uses :data:`RDP_ORDERS`.
* :mod:`~protocols.privacy.calibration` -- epsilon of repeated Gaussian releases and the noise that meets a budget.
* :mod:`~protocols.privacy.composition` -- closed-form theorems (DDP-SA Theorem 2 / Eq. 12, NADP-FL Lemma 2).
* :mod:`~protocols.privacy.pld` -- privacy-loss-distribution composition of pure-DP (Laplace) releases.
* :mod:`~protocols.privacy.sensitivity` -- record-level sensitivity of per-example-clipped local SGD and
  of DDP-SA's clipped gradient sum.
* :mod:`~protocols.privacy.receiver` -- the published model's noise left to a receiving participant that knows its
  own noise (the model's accounts count that receiver).
* :mod:`~protocols.privacy.ledger` -- a method's accounts per adversary view (:class:`PrivacyLedger`) and its report.
* :mod:`~protocols.privacy.budget` -- epsilon as a hard cap: the budget left as shares, the noise scale of the next
  round (with a reserve), charges topped up to the noise really left.

No other module of the project imports dp-accounting.
"""

from protocols.privacy.accountant import (
    RDP_ORDERS,
    Accountant,
    DpCompositionAccountant,
    GdpAccountant,
    Lemma2Accountant,
    PerUnitAccountant,
    PldAccountant,
    RdpAccountant,
    accountant_from_state,
)
from protocols.privacy.calibration import (
    MIN_NOISE_MULTIPLIER,
    calibrate_noise_multiplier,
    gaussian_epsilon,
    gdp_epsilon,
    multiplier_under,
    noise_multiplier,
)
from protocols.privacy.composition import (
    BudgetSchedule,
    PrivacyBudget,
    advanced_composition,
    basic_composition,
    compose_advanced,
    compose_basic,
    exponential_allocation,
    lemma2_epsilon,
    lemma2_sigma,
    per_round_epsilons,
    uniform_allocation,
)
from protocols.privacy.events import (
    DpEvent,
    Event,
    GaussianEvent,
    LaplaceEvent,
    at_sensitivity,
    event_from_dict,
    joint_gaussian,
)
from protocols.privacy.ledger import Headline, PrivacyLedger
from protocols.privacy.mechanisms import (
    analytic_gaussian_epsilon,
    analytic_gaussian_sigma,
    classic_gaussian_sigma,
    gaussian_delta,
    laplace_scale,
)
from protocols.privacy.receiver import receiver_std, receiver_variance
from protocols.privacy.sensitivity import (
    CLIENT_RECORD_FACTOR,
    FLOAT32_ROUNDING_MARGIN,
    FLOAT32_ROUNDOFF,
    FLOAT64_LARGEST_RANGE,
    FLOAT64_ROUNDOFF,
    FLOAT64_SMALLEST_RESOLVABLE,
    FLOAT_RANGE_MARGIN,
    l1_sensitivity,
    largest_trainable_norm,
    local_sgd_sensitivity,
    local_sgd_steps,
    per_record,
    record_sensitivity,
    record_training_movement,
    record_training_range,
    record_training_resolution,
    resolving_dtype,
    smallest_resolvable,
)

__all__ = [
    "CLIENT_RECORD_FACTOR",
    "FLOAT32_ROUNDING_MARGIN",
    "FLOAT32_ROUNDOFF",
    "FLOAT64_LARGEST_RANGE",
    "FLOAT64_ROUNDOFF",
    "FLOAT64_SMALLEST_RESOLVABLE",
    "FLOAT_RANGE_MARGIN",
    "RDP_ORDERS",
    "Accountant",
    "BudgetSchedule",
    "DpCompositionAccountant",
    "DpEvent",
    "Event",
    "GaussianEvent",
    "GdpAccountant",
    "Headline",
    "LaplaceEvent",
    "Lemma2Accountant",
    "MIN_NOISE_MULTIPLIER",
    "PerUnitAccountant",
    "PldAccountant",
    "PrivacyBudget",
    "PrivacyLedger",
    "RdpAccountant",
    "accountant_from_state",
    "advanced_composition",
    "analytic_gaussian_epsilon",
    "analytic_gaussian_sigma",
    "at_sensitivity",
    "basic_composition",
    "calibrate_noise_multiplier",
    "classic_gaussian_sigma",
    "compose_advanced",
    "compose_basic",
    "event_from_dict",
    "exponential_allocation",
    "gaussian_delta",
    "gaussian_epsilon",
    "gdp_epsilon",
    "joint_gaussian",
    "laplace_scale",
    "lemma2_epsilon",
    "lemma2_sigma",
    "l1_sensitivity",
    "largest_trainable_norm",
    "local_sgd_sensitivity",
    "local_sgd_steps",
    "multiplier_under",
    "noise_multiplier",
    "per_record",
    "per_round_epsilons",
    "receiver_std",
    "receiver_variance",
    "record_sensitivity",
    "record_training_movement",
    "record_training_range",
    "record_training_resolution",
    "resolving_dtype",
    "smallest_resolvable",
    "uniform_allocation",
]
