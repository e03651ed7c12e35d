"""What the server learns from one client's upload, and the gradient-inversion attack on it.

:func:`capture_first_round` runs round 1 of a method in-process (real strategy,
ClientApp and method code) with one sample per client, batch size 1 and one
local epoch -- the setting of DLG/iDLG -- and intercepts the victim's train
message and reply on the grid.  :func:`attacker_view` turns the reply into the
gradient the server can infer: the method's audit adapter says how
(:meth:`server.audit_adapter.AuditAdapter.gradient_view`).  :func:`uplink_attack` runs
:func:`benchmarks.adversary.dlg.invert` on it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Message

from benchmarks.adversary.dlg import AttackReport, invert, param_gradient
from benchmarks.adversary.observe import run_observed
from protocols.config import RunConfig
from protocols.methods import method_spec
from protocols.task.data import client_partition, dataset_for
from protocols.task.models import build_model, get_weights, set_weights
from protocols.wire.arrays import Weights
from server.audit_adapter import AuditAdapter, GradientView

__all__ = ["UplinkCapture", "AttackerView", "adapter_of", "training_loss", "capture_first_round", "attacker_view",
           "true_gradient", "uplink_attack", "UplinkResult"]

#: The per-client gradient the server infers, or why there is none (the adapters' view).
AttackerView = GradientView


def adapter_of(method: str) -> AuditAdapter:
    """``method``'s audit adapter (its card's ``MethodSpec.audit``); the default adapter for a method without one."""
    from server.audit_spec import audit_adapter

    return audit_adapter(method) if method_spec(method).audit is not None else AuditAdapter()


def training_loss(method: str) -> str:
    """Loss the method's clients train with (the attacker matches gradients of that loss)."""
    return adapter_of(method).training_loss


@dataclass
class UplinkCapture:
    """Round 1 as seen on the wire for the victim, plus what the benchmark (not the attacker) knows."""

    cfg: RunConfig
    strategy: object
    global_weights: Weights  # the server's model at the start of round 1
    sent: Message  # train message to the victim
    reply: Message  # the victim's train reply
    x: np.ndarray  # the victim's only sample (input shape)
    y: int
    side: dict[str, np.ndarray] | None = None  # what left the clients outside the Flower grid, by roster name


def capture_first_round(overrides: dict, *, victim: int = 0) -> UplinkCapture:
    """Run round 1 with one sample per client; intercept partition ``victim``'s train exchange."""
    k = int(overrides.get("num-clients", 10))
    ov = {**overrides, "num-rounds": 1, "batch-size": 1, "local-epochs": 1, "train-subset": k,
          "sample-rate": 1.0}
    sent: dict[int, Message] = {}
    got: dict[int, Message] = {}

    def hook(msgs: list[Message], replies: list[Message]) -> None:
        if msgs and msgs[0].metadata.message_type == "train":
            sent.update((m.metadata.dst_node_id, m) for m in msgs)
            got.update((r.metadata.src_node_id, r) for r in replies)

    cfg = RunConfig.from_mapping({**_defaults(), **ov})
    side: dict[str, np.ndarray] = {}
    with adapter_of(cfg.method).uplink_side_channel(side):
        obs = run_observed(ov, hooks=[hook], keep_strategy=True)
    node = obs.grid.node_ids[victim]  # LocalGrid gives its i-th node partition i
    if node not in sent or node not in got:
        raise RuntimeError(f"victim node {node} was not part of round 1 "
                           f"(failed rounds: {obs.summary.get('failed_rounds')})")
    ds = dataset_for(cfg)
    model = build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed)
    wire = getattr(obs.strategy, "wire_dtype", np.float64)
    # The server's model as the runner put it on the wire (float32 for some methods).
    w0 = OrderedDict((k, np.asarray(v, dtype=wire).astype(np.float64)) for k, v in get_weights(model).items())
    x, y = client_partition(cfg, victim, cfg.num_clients)
    if len(y) != 1:
        raise RuntimeError(f"victim holds {len(y)} samples, expected 1")
    return UplinkCapture(cfg, obs.strategy, w0, sent[node], got[node], x[0], int(y[0]), side)


def _defaults() -> dict:
    from server.defaults import app_defaults

    return app_defaults()


def attacker_view(cap: UplinkCapture) -> AttackerView:
    """The gradient the server infers from the victim's upload (the method's adapter's ``gradient_view``)."""
    return adapter_of(cap.cfg.method).gradient_view(cap)


def true_gradient(cap: UplinkCapture) -> Weights:
    """The victim's exact gradient at the server's model (what the benchmark compares against)."""
    ds = dataset_for(cap.cfg)
    model = build_model(cap.cfg.model, ds.input_shape, ds.num_classes, cap.cfg.hidden_sizes, cap.cfg.seed).double()
    set_weights(model, cap.global_weights)
    g = param_gradient(model, torch.as_tensor(cap.x[None]).double(), torch.tensor([cap.y]),
                       loss=training_loss(cap.cfg.method), num_classes=ds.num_classes)
    names = [n for n, _ in model.named_parameters()]
    return OrderedDict((n, t.detach().numpy()) for n, t in zip(names, g, strict=True))


@dataclass
class UplinkResult:
    """Attack outcome on one method's upload."""

    method: str
    note: str
    report: AttackReport | None
    cosine: float  # cosine(inferred gradient, true gradient); 1 = exact direction
    rel_error: float  # ||inferred - true|| / ||true||


def _flat(w: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.ravel(v) for v in w.values()])


def uplink_attack(cap: UplinkCapture, *, restarts: int = 2, iterations: int = 300, seed: int = 0) -> UplinkResult:
    """Infer the victim's gradient from its upload and invert it (DLG l2/cosine + analytic)."""
    view = attacker_view(cap)
    if view.gradient is None:
        return UplinkResult(cap.cfg.method, view.note, None, math.nan, math.nan)
    truth = true_gradient(cap)
    g_hat, g = _flat(OrderedDict((k, view.gradient[k]) for k in truth)), _flat(truth)
    cos = float(g_hat @ g / (np.linalg.norm(g_hat) * np.linalg.norm(g) + 1e-300))
    rel = float(np.linalg.norm(g_hat - g) / (np.linalg.norm(g) + 1e-300))
    ds = dataset_for(cap.cfg)
    model = build_model(cap.cfg.model, ds.input_shape, ds.num_classes, cap.cfg.hidden_sizes, cap.cfg.seed).double()
    set_weights(model, cap.global_weights)
    value_range = (float(ds.x_train.min()), float(ds.x_train.max()))
    scales = [view.noise_scale[k] for k in truth] if view.noise_scale is not None else None
    report = invert(model, OrderedDict((k, view.gradient[k]) for k in truth), truth=cap.x, label_true=cap.y,
                    num_classes=ds.num_classes, loss=training_loss(cap.cfg.method), value_range=value_range,
                    restarts=restarts, iterations=iterations, seed=seed, noise_scale=scales)
    return UplinkResult(cap.cfg.method, view.note, report, cos, rel)
