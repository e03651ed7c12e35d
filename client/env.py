"""What a ClientApp handler needs, rebuilt from Flower's ``Context`` for every message.

Every message may run in a fresh process (always in deployment), so nothing
lives in module globals except read-only caches (datasets).  Secrets that must
survive between phases of a round (e.g. a private key) go to ``Context.state``.
The task (data, model, training: :mod:`protocols.task`) is imported on first use, so a message that trains
nothing (a key, share or recovery query) does not load it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Context, Message, MetricRecord, RecordDict

from protocols.config import ConfigError, RunConfig
from protocols.federation import fitted, num_clients_left_auto
from protocols.node_config import check_node_config, trusted_fabs
from protocols.wire.arrays import Weights, from_record
from protocols.wire.common import TrainIns, train_metrics

if TYPE_CHECKING:
    from torch import nn

#: A node's local data: ``(x or a function gathering x, y, num_classes, input_shape)``.
LocalData = tuple[np.ndarray | Callable[[], np.ndarray], np.ndarray, int, tuple[int, ...]]


@dataclass
class ClientEnv:
    """A client's configuration, identity and local data for one message.

    The local data (:attr:`x`, :attr:`y`, :attr:`num_classes`, :attr:`input_shape`) is loaded on first use: a
    message that needs none of it (e.g. a dropout-recovery query) does not load the partition.
    """

    cfg: RunConfig
    context: Context
    node_id: int
    partition_id: int
    num_partitions: int
    #: The local data, or a function that loads it (called once, on first use).
    data: LocalData | Callable[[], LocalData]
    #: Builds the local model instead of run-config ``model`` (a user's own model, :mod:`client.api`).
    model_fn: Callable[[], nn.Module] | None = None
    #: Results a handler computes once per message and reuses (e.g. the checked round view,
    #: :func:`client.pairwise_phase.checked_pair_seeds`); lives as long as this message's env.
    memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_context(cls, context: Context) -> ClientEnv:
        """Parse the run config; this node's partition is loaded when first used.

        Run-config ``num-clients`` left "auto" takes the node config's ``num-partitions`` (the federation's size).
        A node config holding a near miss of a key cancelfl reads is refused first
        (:func:`protocols.node_config.check_node_config`); a node that pins its app (``trusted-fab``) refuses a
        model or dataset import path outside it (:func:`pinned_imports`).
        """
        check_node_config(context.node_config)
        cfg = RunConfig.from_mapping(context.run_config, strict=False)
        if trusted_fabs(context.node_config) is not None:
            pinned_imports(cfg)
        try:
            pid = int(context.node_config["partition-id"])
            nparts = int(context.node_config["num-partitions"])
        except KeyError as err:
            raise ConfigError(
                "node config needs 'partition-id' and 'num-partitions' "
                "(flower-supernode --node-config 'partition-id=0 num-partitions=N')"
            ) from err
        if nparts != cfg.num_clients and num_clients_left_auto(context.run_config):
            cfg = fitted(context.run_config, nparts, strict=False)  # as the ServerApp does (server.federation)

        def load() -> LocalData:
            from protocols.task.partition_cache import cache_folder, local_data

            # Through the node's data cache when it names one (cancelfl-supernode does): a fresh process per
            # message then reads its partition instead of loading and splitting the whole dataset.
            return local_data(cfg, pid, nparts, cache_folder(context.node_config))
        return cls(cfg, context, int(context.node_id), pid, nparts, load)

    def _local(self) -> LocalData:
        if callable(self.data):
            self.data = self.data()
        return self.data

    @property
    def x(self) -> np.ndarray:
        """Training inputs of this node (gathered on first use: the key and share phases need only ``len(y)``)."""
        local = self._local()
        if callable(local[0]):
            self.data = local = (local[0](), *local[1:])
        return local[0]

    @property
    def y(self) -> np.ndarray:
        """Training labels of this node."""
        return self._local()[1]

    @property
    def num_classes(self) -> int:
        """Classes of the task."""
        return self._local()[2]

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input."""
        return self._local()[3]

    def model(self, weights: dict[str, np.ndarray] | None = None) -> nn.Module:
        """A fresh model, optionally loaded with ``weights``."""
        from protocols.task.models import build_model, resolve_device, set_weights

        m = self.model_fn() if self.model_fn is not None else build_model(
            self.cfg.model, self.input_shape, self.num_classes, self.cfg.hidden_sizes, self.cfg.seed)
        if weights is not None:
            set_weights(m, weights)
        return m.to(resolve_device(self.cfg.device))  # run-config 'device'; training follows the model's device

    def round_seed(self, server_round: int, purpose: str = "train") -> int:
        """A deterministic 63-bit seed for local randomness that is not secret (batch order)."""
        h = hashlib.sha256(f"{self.cfg.seed}|{server_round}|{self.partition_id}|{purpose}".encode()).digest()
        return int.from_bytes(h[:8], "big") >> 1


def pinned_imports(cfg: RunConfig) -> None:
    """Refuse run-config ``model`` / ``dataset`` import paths whose package is not part of this app.

    A node that pins its app's FAB (node config ``trusted-fab``, :mod:`server.fab_pin`) runs reviewed code only;
    an import path is the server's choice, and importing it runs that module and calls its object.  Only packages
    of the folder this ClientApp was loaded from pass.  Raises ConfigError (naming the key and the import path, not
    the folder: its text reaches the server).
    """
    import importlib.util

    import client

    root = Path(client.__file__).resolve().parent.parent
    for key, value in (("model", cfg.model), ("dataset", cfg.dataset)):
        if ":" not in value:
            continue
        top = value.partition(":")[0].split(".")[0]
        spec = importlib.util.find_spec(top) if top else None
        where = [] if spec is None else [*(spec.submodule_search_locations or []), *([spec.origin] if spec.origin else [])]
        if not where or not all(Path(w).resolve().is_relative_to(root) for w in where):
            raise ConfigError(f"run-config '{key}' = {value!r} imports code outside this node's pinned app; a node "
                              "with 'trusted-fab' runs only the app it pinned (the app's folder stays on the node)")


def local_training(msg: Message, env: ClientEnv, *, grad_clip: float | None = None) -> tuple[Weights, Weights, float]:
    """Train the received global model on local data.

    Returns ``(global_weights, local_weights, train_loss)``.
    """
    from protocols.task.models import get_weights
    from protocols.task.training import train

    global_w = from_record(msg.content["arrays"])
    model = env.model(global_w)
    rnd = TrainIns.from_config(msg.content["config"]).round
    train_loss = train(model, env.x, env.y, epochs=env.cfg.local_epochs, batch_size=env.cfg.batch_size,
                       lr=env.cfg.lr, seed=env.round_seed(rnd), grad_clip=grad_clip)
    return global_w, get_weights(model), train_loss


def record_level_training(msg: Message, env: ClientEnv) -> tuple[Weights, Weights, float, float]:
    """Train the received global model with per-example clipping at run-config ``clip`` (record-level DP).

    The training every record-level method runs; its sensitivity is
    :func:`protocols.privacy.record_sensitivity` of the run config and the client's dataset size.

    Deterministic given the message (batch order from the public round seed).
    Returns ``(global_weights, local_weights, train_loss, clipped_fraction)``.

    A model whose L2 norm is above :func:`protocols.privacy.largest_trainable_norm` (float32 weights would round
    one record's influence past the sensitivity the noise is sized for) trains its update from the received
    weights (:func:`protocols.task.training.clipped_sgd`, ``recentre``): the steps round relative to the update,
    not to the model, and the local weights come back in float64.  So many local steps that float32 rounds even
    the update's steps past the margin (the limit is 0) train in float64, and so does a training whose values
    (:func:`protocols.privacy.record_training_range`: the run's ``lr`` and ``clip``, the model's norm) float32 may
    not hold: a weight overflowing to ``inf`` where the records' steps add up past float32's range would tell the
    server, through the noise, which records the node holds.  So does one whose clip or steps are so small that float32
    rounds them on its subnormal grid (:func:`protocols.privacy.record_training_resolution`): a record's squared
    gradient norm rounding to 0 lets it into the sum unclipped.  All are decided on public values before training.

    Raises:
        FloorViolation: before any training, a received model whose L2 norm is not finite or above the float64
            limit, or a training whose values even float64 may not hold or resolve.
    """
    from protocols.floor import at_least, at_most
    from protocols.privacy import (
        FLOAT64_LARGEST_RANGE,
        FLOAT64_ROUNDOFF,
        FLOAT64_SMALLEST_RESOLVABLE,
        FLOAT_RANGE_MARGIN,
        largest_trainable_norm,
        record_training_range,
        record_training_resolution,
        smallest_resolvable,
    )
    from protocols.task.models import get_weights
    from protocols.task.training import clipped_sgd

    global_w = from_record(msg.content["arrays"])
    norm = float(np.sqrt(sum(float(np.sum(np.square(w, dtype=np.float64))) for w in global_w.values())))
    model = env.model(global_w)
    limit = largest_trainable_norm(env.cfg, len(env.y))
    recentre = not norm <= limit  # a noise-dominated honest model, or a crafted one
    if recentre:
        at_most("global model L2 norm", norm, largest_trainable_norm(env.cfg, len(env.y), FLOAT64_ROUNDOFF),
                "even float64 training would round one record's influence past the sensitivity the noise is sized for")
    span = record_training_range(env.cfg, len(env.y), norm)
    fine = record_training_resolution(env.cfg, len(env.y))
    info = _float_info(model)
    if not (span <= info.max / FLOAT_RANGE_MARGIN and fine >= smallest_resolvable(info.max, info.tiny)) or (
            recentre and limit <= 0.0):
        at_most("record-level training range", span, FLOAT64_LARGEST_RANGE,
                "even float64 training may overflow a weight where the records' steps add up (run-config 'lr', "
                "'clip', 'batch-size' and the model's norm)")
        at_least("record-level training resolution", fine, FLOAT64_SMALLEST_RESOLVABLE,
                 "even float64 training would round a record's clipping factor or step on its subnormal grid "
                 "(run-config 'clip', 'lr' and 'batch-size')")
        model = model.double()
    rnd = TrainIns.from_config(msg.content["config"]).round
    cfg = env.cfg
    loss, frac = clipped_sgd(model, env.x, env.y, epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr,
                             clip=cfg.clip, seed=env.round_seed(rnd), recentre=recentre)
    return global_w, get_weights(model), loss, frac


def full_batch_dtype(clip: float, dtype: str = "float32") -> str:
    """The dtype a full-batch per-example-clipped sum at ``clip`` is computed in (:func:`protocols.privacy.resolving_dtype`).

    ``dtype``, or float64 where ``dtype`` does not resolve ``clip`` (DDP-SA's sum, the MP family's gradient at W-hat).

    Raises:
        FloorViolation: before any work, a clip even float64 does not resolve.
    """
    return _resolving(clip, dtype, "even float64 would round a record's gradient norm or clip factor on its subnormal grid")


def client_level_update(msg: Message, env: ClientEnv, clip: float) -> tuple[Weights, np.ndarray, float, float]:
    """Client-level DP's local step: train the received model, clip its update to ``clip`` (sensitivity ``clip``).

    The update is clipped (:func:`protocols.clipping.clip_l2`), and noised by the method, in float64.  A clip float64
    does not resolve (:func:`protocols.privacy.resolving_dtype`) is refused before any training: the clipped update
    and the noise, whose std is proportional to the clip, would round on float64's subnormal grid (at ``5e-324`` a
    noise std below half the grid rounds to 0, and the upload would leave unnoised).

    Returns:
        ``(global_weights, clipped flat update (float64), train_loss, the update's L2 norm before clipping)``.

    Raises:
        FloorViolation: before any training, a clip below :data:`protocols.privacy.FLOAT64_SMALLEST_RESOLVABLE`.
    """
    from protocols.arrays import flatten
    from protocols.clipping import clip_l2

    _resolving(clip, "float64", "float64, in which the update is clipped and noised, would round the clipped update and "
               "its noise (std proportional to the clip) on its subnormal grid")
    global_w, local_w, loss = local_training(msg, env)
    clipped, norm = clip_l2(flatten(local_w) - flatten(global_w), clip)
    return global_w, clipped, loss, norm


def _resolving(clip: float, dtype: str, why: str) -> str:
    """:func:`protocols.privacy.resolving_dtype` of ``clip``; FloorViolation (naming ``why``) where even float64 fails."""
    from protocols.floor import at_least
    from protocols.privacy import FLOAT64_SMALLEST_RESOLVABLE, resolving_dtype

    resolving = resolving_dtype(clip, dtype)
    if resolving is None:
        at_least("clip", clip, FLOAT64_SMALLEST_RESOLVABLE, why)
    assert resolving is not None  # refused above
    return resolving


def _float_info(model: nn.Module):
    """``torch.finfo`` of the dtype ``model`` trains in (its first parameter's; float32 without one)."""
    import torch

    first = next(model.parameters(), torch.empty(0))
    return torch.finfo(first.dtype if first.is_floating_point() else torch.float32)


def reply(msg: Message, arrays, num_examples: int, **metrics: float) -> Message:
    """The standard train reply: upload arrays + metrics (:func:`protocols.wire.common.train_metrics`)."""
    return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(train_metrics(num_examples, **metrics))}), reply_to=msg)
