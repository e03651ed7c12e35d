"""DDP-SA's client floor, Flower-free: the round's epsilon, the noise share and the sums a share may enter.

Each function is computed by both ends from the client's own run config and public values of the round (the
strategy in :mod:`strategies.ddpsa`, the client in :mod:`client.methods.ddpsa`); a server-sent value that would
give a client less protection is refused with :class:`protocols.floor.FloorViolation`.
"""

from __future__ import annotations

from protocols.config import RunConfig
from protocols.floor import FloorViolation, at_most
from protocols.privacy import per_round_epsilons

__all__ = ["ddpsa_min_summed", "ddpsa_noise_multiplier", "ddpsa_noise_share", "ddpsa_round_epsilon", "separable_sums"]


def ddpsa_round_epsilon(cfg: RunConfig, rnd: int) -> float:
    """``ddpsa``: ``eps_t`` of round ``rnd`` (1-based) from the run's budget schedule (Eq. 12 / Theorem 2)."""
    schedule = per_round_epsilons(cfg.epsilon, cfg.delta, cfg.num_rounds, allocation=cfg.ddpsa_allocation,
                                  alpha=cfg.ddpsa_decay, composition=cfg.ddpsa_composition)
    return float(schedule.epsilons[rnd - 1])


def ddpsa_noise_share(cfg: RunConfig, noise: str, participants: int, *, federation: int = 0) -> int | None:
    """``ddpsa``: ``n'`` such that this client adds ``Gamma(1/n', b) - Gamma(1/n', b)``, or None for a full Laplace.

    A ``"local"`` round gets the paper's full ``Lap(b)`` (never less than the client's floor).  A
    ``"distributed"`` round splits one ``Lap(b)`` (a ``"gaussian"`` round one ``N(0, (z Delta_2)^2)``, taken only by
    a client whose own config asks Gaussian noise, and it only) over ``n' = n - max(1, floor(f N)) - floor(d n)``
    participants (:func:`protocols.ddpsa.honest_participants`, ``f`` and ``d`` = the client's own
    ``ddpsa-collude-frac`` and ``ddpsa-dropout-frac``, ``N`` its clients per round, however short the list); it is
    refused when the client's run config asks for local noise, or when the participant list is longer
    than the client's own ``clients_per_round`` (a longer list would shrink its share).
    ``federation``: the population the server draws the participants from (a node's roster; 0: none given): the
    colluders are counted among ``max(N, federation)`` clients, as a server choosing who shares a round may put
    every colluder of the federation, ``floor(f federation)``, into it.

    Raises:
        FloorViolation: the above, or a round whose colluders and dropouts leave no share to count on.
    """
    from protocols.ddpsa import honest_participants
    if (noise == "gaussian") != (cfg.ddpsa_noise == "gaussian"):
        raise FloorViolation("ddpsa-noise", noise, cfg.ddpsa_noise,
                             "Gaussian and Laplace rounds give different guarantees; this client adds what its own "
                             "run config asks")
    if noise == "local":
        return None
    if cfg.ddpsa_noise == "local":
        raise FloorViolation("ddpsa-noise", noise, "local",
                             "this client's run config adds the paper's full Laplace noise itself")
    at_most("ddpsa-participants", participants, cfg.clients_per_round,
            "the distributed noise is split over the participants: a longer list would shrink this client's share")
    counted = max(cfg.clients_per_round, int(federation))  # a shorter list shrinks no colluder count
    try:
        return honest_participants(participants, cfg.ddpsa_collude_frac, cfg.ddpsa_dropout_frac, per_round=counted)
    except ValueError as err:
        raise FloorViolation("ddpsa-participants", participants, "more than the colluders and dropouts counted",
                             f"{err}, counted among {counted} clients (run-config 'ddpsa-collude-frac')") from None


def ddpsa_min_summed(cfg: RunConfig, noise: str, participants: int, *, threshold: int, servers: int) -> int:
    """``ddpsa``: the fewest clients a partial sum holding a client's share may cover (its push's signed terms).

    A ``"local"`` share carries its own full Laplace: any sum (1).  A distributed or Gaussian share is one of
    ``n'`` parts of one central noise (:func:`ddpsa_noise_share`) and the ledger charges that whole noise, which a
    sum holds when it leaves out at most ``floor(d n)`` of the ``participants`` the client was shown
    (:func:`protocols.ddpsa.fewest_summed`, ``d`` = the client's own ``ddpsa-dropout-frac``): a server that may
    leave honest shares out of a sum could otherwise keep too few of them.  With ``2 threshold <= servers`` two
    disjoint sets of ``threshold`` intermediate servers could each reconstruct a sum over other clients, and the
    difference of two sums isolates a share: there a share is summed only with all the ``participants``.
    """
    from protocols.ddpsa import fewest_summed

    if noise == "local":
        return 1
    if separable_sums(threshold, servers):
        return int(participants)
    return fewest_summed(participants, cfg.ddpsa_dropout_frac)


def separable_sums(threshold: int, servers: int) -> bool:
    """``ddpsa``: whether two disjoint sets of ``threshold`` of the ``servers`` can each reconstruct a sum."""
    return 2 * threshold <= servers


def ddpsa_noise_multiplier(cfg: RunConfig) -> float:
    """``ddpsa``, Gaussian rounds: ``z`` from the client's own run config (:func:`protocols.ddpsa.gaussian_multiplier`)."""
    from protocols.ddpsa import gaussian_multiplier
    return gaussian_multiplier(cfg.epsilon, cfg.delta, cfg.num_rounds)
