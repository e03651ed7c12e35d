"""What the pairwise-noise methods (nadp, niss, mpddp) share: the pairing graph and double-masking options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocols.methods.registry import METHODS
from protocols.options import ConfigError, MethodOptions, option

#: Clients per round from which ``graph = "auto"`` is the sparse n-out graph for a method whose card sets
#: ``MethodSpec.sparse_graph``.
SPARSE_FROM = 32
GRAPHS = ("complete", "n-out")


def sparse_by_default(method: str) -> bool:
    """Whether ``method``'s card sets ``sparse_graph`` (False for an unknown method)."""
    spec = METHODS.get(method)
    return spec is not None and spec.sparse_graph


def auto_graph(method: str, clients_per_round: int) -> str:
    """The neighbour graph of ``graph = "auto"``: n-out from :data:`SPARSE_FROM` clients per round, else complete.

    Only for a method whose card sets ``sparse_graph``; the others keep the complete graph.
    """
    return "n-out" if sparse_by_default(method) and clients_per_round >= SPARSE_FROM else "complete"


@dataclass(frozen=True)
class PairwiseOptions(MethodOptions):
    """The pairing graph, key rotation and double masking of nadp, niss and mpddp."""

    prefix = ""
    title = "Pairwise noise (nadp, niss, mpddp)"

    graph: str = option("complete", "pairwise-noise neighbour graph", choices=GRAPHS)
    n_out: int = option(4, "neighbours each client picks in an n-out graph", low=1)
    key_rotation: int = option(0, "rounds per X25519 key pair (0 = one pair per node for the run, 1 = fresh every "
                                  "round)", low=0)
    cancellation_check: bool = option(False, "clients report a random projection of their pairwise mask (diagnostic)")
    self_mask: bool = option(True, "double masking: a Shamir-shared self-mask on every pairwise upload")
    unmask_next_round: bool = option(False, "double masking: unmask a round without dropouts in the next round's "
                                            "train messages (no query.recover phase; each round's update reaches "
                                            "the model one round later)")
    dropout_rate: float = option(0.0, "assumed share of a round's participants that drop after the key phase, in "
                                      "[0, 0.5): nadp, niss and mpddp plan their noise for the dropouts a 1e-3 binomial "
                                      "tail allows (protocols.dropouts; 0 = plan for none, the budget guard then raises "
                                      "later rounds' noise); also the logged P[< t surviving neighbours]",
                                 low=0.0, high=0.5, high_open=True)
    mask_corruption_rate: float = option(0.1, "assumed colluding share of a neighbourhood, in [0, 0.5): sets the "
                                              "self-mask threshold t", low=0.0, high=0.5, high_open=True,
                                 trust="at-least")

    def validate_run(self, cfg: Any) -> None:
        """``unmask-next-round`` carries double masking's phase and needs every client in every round.

        On the complete graph a ``fault-drop-rate`` that leaves every arriving upload fewer kept neighbours than its
        self-mask threshold (:func:`protocols.masking.mask_threshold`) fails every round: refused.
        """
        self._check_withheld(cfg)
        if self.unmask_next_round and not self.self_mask:
            raise ConfigError("run-config 'unmask-next-round' = true needs 'self-mask' = true (it carries the "
                              "unmasking phase of double masking in the next round's train messages)")
        if self.unmask_next_round and cfg.sample_rate < 1:
            raise ConfigError(f"run-config 'unmask-next-round' = true needs 'sample-rate' = 1, not {cfg.sample_rate:g}: "
                              "the next round's train messages must reach every client of the round")

    def _check_withheld(self, cfg: Any) -> None:
        from protocols.config_checks import fault_withheld
        from protocols.masking import mask_threshold

        k = cfg.clients_per_round
        lost = fault_withheld(cfg.fault_drop_rate, k)
        if not (lost and self.self_mask and self.graph == "complete"):
            return
        degree = k - 1
        need = mask_threshold(degree, self.mask_corruption_rate)
        if degree - lost < need:
            raise ConfigError(f"run-config 'fault-drop-rate' = {cfg.fault_drop_rate:g} withholds {lost} of the {k} "
                              f"clients of every round: each upload that arrives keeps {degree - lost} of its {degree} "
                              f"neighbours, fewer than its self-mask threshold {need} (protocols.masking.mask_threshold, "
                              f"'mask-corruption-rate' = {self.mask_corruption_rate:g}), so no round can be unmasked; "
                              f"withhold at most {max(degree - need, 0)} (a lower 'fault-drop-rate'), raise "
                              "'num-clients', or set 'self-mask' = false")
