"""The cancelfl app's task around the one round loop: dataset, model and central evaluation from the run config.

:func:`run_federation` runs a :class:`~strategies.base.CancelStrategy` with :class:`AppTask` through
:func:`strategies.run.loop.run_rounds` (outputs: see that module); the final model is saved as ``model.npz``
+ ``model.json`` (:func:`protocols.task.models.load_npz_model` rebuilds it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from flwr.app import ArrayRecord
from flwr.serverapp import Grid

from protocols.arrays import Weights
from protocols.config import ConfigError, RunConfig
from protocols.task.data import dataset_for, partitions_for
from protocols.task.models import build_model, get_weights, save_npz_model, set_weights
from protocols.task.training import evaluate
from protocols.wire.arrays import from_record
from strategies.base import CancelStrategy
from strategies.records import to_record
from strategies.run.loop import run_rounds
from strategies.run.notes import chance_level


def largest_partition(cfg: RunConfig) -> int | None:
    """Size of the largest client partition of the run (None if it cannot be computed here).

    A partitioning no client can get (:class:`ConfigError`: a client without records, a Dirichlet split too
    skewed for its clients) stops the run here, before round 1: every client would fail the same way in every round.
    """
    try:
        idx = partitions_for(cfg)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - the cap is a safeguard; without it the round median rule applies
        return None
    return max(len(i) for i in idx)


class AppTask:
    """The run config's dataset and model, evaluated on its test split.

    Built with :mod:`protocols.task.data` and :mod:`protocols.task.models`.
    """

    def __init__(self, cfg: RunConfig, wire_dtype) -> None:
        self.cfg = cfg
        self.ds = dataset_for(cfg)
        self.model = build_model(cfg.model, self.ds.input_shape, self.ds.num_classes, cfg.hidden_sizes, cfg.seed)
        self.initial: ArrayRecord = to_record(get_weights(self.model), wire_dtype)
        self.num_params = sum(int(p.numel()) for p in self.model.parameters())
        self.chance: float | None = chance_level(self.ds.y_test)

    def evaluate(self, server_round: int, arrays: ArrayRecord) -> tuple[float, float]:
        """``(loss, accuracy)`` of ``arrays`` on the test split."""
        set_weights(self.model, from_record(arrays))
        return evaluate(self.model, self.ds.x_test, self.ds.y_test)

    def save_model(self, path: Path, weights: Weights) -> str:
        """``model.npz`` + ``model.json`` in ``path``."""
        save_npz_model(path / "model.npz", weights, {
            "model": self.cfg.model, "input_shape": list(self.ds.input_shape), "num_classes": self.ds.num_classes,
            "hidden": list(self.cfg.hidden_sizes), "dataset": self.cfg.dataset,
        })
        return "model.npz"


def run_federation(strategy: CancelStrategy, grid: Grid, cfg: RunConfig,
                   progress: Callable[[str], None] = print, *, verbose: bool | None = None) -> dict:
    """Run all rounds of ``strategy`` on the run config's task, write outputs to ``cfg.out_dir``, return the summary.

    ``verbose``: detailed round lines (:func:`strategies.run.loop.round_line`); None = ``$CANCELFL_VERBOSE``.
    """
    if cfg != strategy.cfg:
        raise ValueError("run_federation: cfg is not the strategy's run config (build the strategy from cfg)")
    task = AppTask(cfg, strategy.wire_dtype)
    if strategy.max_examples is None:
        strategy.max_examples = largest_partition(cfg)
    return run_rounds(strategy, grid, task, progress=progress, verbose=verbose).summary
