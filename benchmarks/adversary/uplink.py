"""What the server learns from one client's upload, and the gradient-inversion attack on it.

:func:`capture_first_round` runs round 1 of a method in-process (real strategy,
ClientApp and method code) with one sample per client, batch size 1 and one
local epoch -- the setting of DLG/iDLG -- and intercepts the victim's train
message and reply on the grid.  :func:`attacker_view` turns the reply into the
gradient the server can infer, per method (``VIEWS``; documented in each
function).  :func:`uplink_attack` runs :func:`benchmarks.adversary.dlg.invert` on it.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Message

from benchmarks.adversary.dlg import AttackReport, invert, param_gradient
from benchmarks.adversary.observe import run_observed
from protocols.config import RunConfig
from protocols.task.data import client_partition, dataset_for
from protocols.task.models import build_model, get_weights, set_weights
from protocols.wire.arrays import Weights, from_record
from protocols.wire.ddpsa import ShareReceipt
from protocols.wire.niss import RelayedInbox

__all__ = ["UplinkCapture", "AttackerView", "VIEWS", "training_loss", "capture_first_round", "attacker_view",
           "true_gradient", "uplink_attack", "UplinkResult", "received_mpddp_forward", "RECEIVED_FORWARDS",
           "SIDE_CHANNELS"]

#: Training loss of each method (mpddp's theory needs the squared loss); default cross-entropy.
LOSSES = {"mpddp": "mse", "mpdp-naive": "mse", "mpcdp": "mse"}


def training_loss(method: str) -> str:
    """Loss the method's clients train with (the attacker matches gradients of that loss)."""
    return LOSSES.get(method, "ce")


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
    side: np.ndarray | None = None  # what left the victim outside the Flower grid (ddpsa: its shared vector)


@dataclass
class AttackerView:
    """The per-client gradient the server infers (original model space), or why there is none."""

    gradient: Weights | None
    note: str  # what the attacker sees for this method
    noise_scale: Weights | None = None  # per-entry noise std the attacker KNOWS (up to a common factor), if any


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
    with _side_channel(cfg.method, side):
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
    # ddpsa's side channel is keyed by the roster name the victim pushed its shares under (its reply's receipt).
    pushed = side.get(ShareReceipt.client_of(got[node].content)) if side else None
    return UplinkCapture(cfg, obs.strategy, w0, sent[node], got[node], x[0], int(y[0]), pushed)


@contextlib.contextmanager
def _side_channel(method: str, store: dict[str, np.ndarray]) -> Iterator[None]:
    """Record the uploads of ``method`` that bypass the Flower grid (its :data:`SIDE_CHANNELS` entry, if any)."""
    recorder = SIDE_CHANNELS.get(method)
    with recorder(store) if recorder is not None else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def _ddpsa_shares(store: dict[str, np.ndarray]) -> Iterator[None]:
    """Record the vector each ddpsa client secret-shares to the intermediate servers, by its roster name.

    The vector handed to ``share_and_push`` is exactly what all m intermediate servers together
    reconstruct for this client (the worst case: the server colludes with every one of them).
    """
    import client.methods.ddpsa as ddpsa_client

    original = ddpsa_client.share_and_push

    def recording(vector, codec, servers, run_id, rnd, signer, *args, **kwargs):
        store[signer.name] = np.array(vector, dtype=np.float64, copy=True)
        return original(vector, codec, servers, run_id, rnd, signer, *args, **kwargs)

    ddpsa_client.share_and_push = recording
    try:
        yield
    finally:
        ddpsa_client.share_and_push = original


#: Uploads that bypass the Flower grid, per method: a context manager recording them into a dict (roster name ->
#: vector) while round 1 runs.
SIDE_CHANNELS: dict[str, Callable[[dict[str, np.ndarray]], contextlib.AbstractContextManager]] = {
    "ddpsa": _ddpsa_shares,
}


def _defaults() -> dict:
    from server.defaults import app_defaults

    return app_defaults()


# ---------------------------------------------------------------- per-method views
def _weights_view(cap: UplinkCapture, upload: Weights, what: str) -> AttackerView:
    """One SGD step of batch size 1: ``g = (w_sent - upload) / lr`` (noise, if any, divided by lr)."""
    sent = from_record(cap.sent.content["arrays"])
    grad = OrderedDict((k, (sent[k] - upload[k]) / cap.cfg.lr) for k in sent)
    return AttackerView(grad, what)


def view_plain(cap: UplinkCapture) -> AttackerView:
    """Methods fedavg and cdp: the upload is the local model after one step; cdp's clients clip it, no noise."""
    what = {"fedavg": "local model after one SGD step: (w - upload)/lr is the exact gradient",
            "cdp": "clipped local model, noise only added by the server to the mean: exact (clipped) gradient"}
    return _weights_view(cap, from_record(cap.reply.content["arrays"]),
                         what.get(cap.cfg.method, "uploaded local model: (w - upload)/lr"))


def view_ldp(cap: UplinkCapture) -> AttackerView:
    """ldp: upload = w + clip(update) + N(0, (z clip)^2): gradient + noise/lr."""
    return _weights_view(cap, from_record(cap.reply.content["arrays"]),
                         "noisy local model (Gaussian, std z*clip per coordinate): gradient + noise/lr")


def view_ladp(cap: UplinkCapture) -> AttackerView:
    """ladp: layers above the norm threshold carry Gaussian noise, the others are exact."""
    return _weights_view(cap, from_record(cap.reply.content["arrays"]),
                         "local model with layer-wise Gaussian noise (un-noised layers exact): gradient + noise/lr")


def view_niss(cap: UplinkCapture) -> AttackerView:
    """niss: upload = p w_k + sum of own shares and distorted negated shares; the server knows p."""
    p = RelayedInbox.from_config(cap.sent.content["config"]).weight
    up = OrderedDict((k, v / p) for k, v in from_record(cap.reply.content["arrays"]).items())
    return _weights_view(cap, up, "p*w_k + own noise shares + distorted received shares; divided by the public p")


#: What the attacker sees of a nadp upload, per ``nadp-variant`` (any other: the record-level LDP comparator's).
_NADP_NOTES = {
    "nadp": "local model (per-example clipped SGD) + (residual + counteracting pairwise noise)/p_i: gradient + noise/lr",
    "record-ldp": "local model (per-example clipped SGD) + record-level LDP noise: gradient + noise/lr",
}


def view_nadp(cap: UplinkCapture) -> AttackerView:
    """Method nadp: upload = w_i + (n_i + lambda c_i) / p_i (own + pairwise noise; the pair part cancels only in the sum)."""
    what = _NADP_NOTES.get(getattr(cap.cfg, "nadp_variant", "nadp"), _NADP_NOTES["record-ldp"])
    return _weights_view(cap, from_record(cap.reply.content["arrays"]), what)


def view_ddpsa(cap: UplinkCapture) -> AttackerView:
    """Method ddpsa: alone the server sees nothing of one client; colluding, its noisy gradient.

    The uniform Z_2^64 shares sit on the intermediate servers and the reply carries
    metrics only.  Worst case -- the server colludes with all m intermediate servers --
    it reconstructs the client's L1-clipped gradient sum + Laplace noise (FedSGD, one
    sample here), which is what is attacked.
    """
    if cap.side is None:
        return AttackerView(None, "nothing: secret shares on the intermediate servers (share vector not captured)")
    sent = from_record(cap.sent.content["arrays"])
    from protocols.arrays import unflatten

    return AttackerView(unflatten(cap.side, sent),
                        "alone: nothing (uniform shares); colluding with all m intermediate servers: "
                        "L1-clipped gradient + Laplace noise (attacked here)")


#: The MP family's views: method -> (what the attacker sees, whether the recovered upload carries client noise).
_MP_VIEWS: dict[str, tuple[str, bool]] = {
    "mpddp": ("own recovery (secret R) of one upload: gradient + R o (eta_k + sum of pairwise Delta_kv)", True),
    "mpdp-naive": ("own recovery (secret R) of one upload: gradient + R o eta_k", True),
    "mpcdp": ("own recovery (secret R) of one upload: the exact gradient (noise added later by the server)", False),
}


def view_mpddp_family(cap: UplinkCapture) -> AttackerView:
    """Methods mpddp, mpdp-naive, mpcdp: the server recovers the client's own gradient with its secret R.

    The upload is the gradient at the perturbed model W-hat plus the correction
    terms Psi, Phi (unnoised, as in the paper).  The server chose R, so it runs
    the recovery of Eq. (22) on this ONE upload (instead of on the mean): it
    gets the client's true gradient + R o (eta_k + sum_v Delta_kv) for mpddp
    (the Delta's do not cancel in a single upload), + R o eta_k for mpdp-naive,
    and the exact gradient for mpcdp (noise is added by the server later).
    """
    from protocols.mpddp import aggregate, recover
    from protocols.wire.mpddp import upload_from_record
    from strategies.mpddp import weights_from_layers

    state = getattr(cap.strategy, "_state", None)
    if state is None or getattr(state, "round", None) != 1:
        return AttackerView(None, "server secret of round 1 not available")
    upload = upload_from_record(cap.reply.content["arrays"], len(state.layers))
    grads = recover(aggregate([upload]), state.secret)
    what, client_noise = _MP_VIEWS[cap.cfg.method]
    scale = None
    if client_noise:  # recovered noise on entry ij is R_ij * (i.i.d. noise): the server knows R
        scale = weights_from_layers([(rm[:, :-1].abs(), rm[:, -1].abs()) for rm in state.secret.trainable_R()])
    return AttackerView(weights_from_layers(grads), what, scale)


VIEWS: dict[str, Callable[[UplinkCapture], AttackerView]] = {
    "mpddp": view_mpddp_family,
    "mpdp-naive": view_mpddp_family,
    "mpcdp": view_mpddp_family,
    "ddpsa": view_ddpsa,
    "nadp": view_nadp,
    "fedavg": view_plain,
    "cdp": view_plain,
    "ldp": view_ldp,
    "ladp": view_ladp,
    "niss": view_niss,
}


def attacker_view(cap: UplinkCapture) -> AttackerView:
    """The gradient the server infers from the victim's upload (see ``VIEWS``)."""
    fn = VIEWS.get(cap.cfg.method)
    if fn is not None:
        return fn(cap)
    # Unknown method: if the upload looks like a model, read it as one.
    up = from_record(cap.reply.content["arrays"]) if "arrays" in cap.reply.content else {}
    if set(up) == set(cap.global_weights) and all(up[k].shape == cap.global_weights[k].shape for k in up):
        return _weights_view(cap, OrderedDict((k, up[k]) for k in cap.global_weights),
                             "upload read as a local model (no method-specific view)")
    return AttackerView(None, "no attacker view defined for this upload format")


def received_mpddp_forward(arrays: Weights, cfg: RunConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """Forward pass of the perturbed expanded model W-hat a client of the mpddp family receives."""
    from protocols.mpddp import forward_expanded
    from protocols.wire.mpddp import PerturbedModel

    mats = [torch.as_tensor(m) for m in PerturbedModel.from_arrays(arrays).matrices]
    return lambda t: forward_expanded(mats, t.double().reshape(len(t), -1))


#: The model a client receives where it is not the global model, per method family: (its forward function from
#: the train message's arrays and the run config, what it is).
RECEIVED_FORWARDS: dict[str, tuple[Callable[[Weights, RunConfig], Callable[[torch.Tensor], torch.Tensor]], str]] = {
    "mpddp": (received_mpddp_forward, "perturbed model W-hat sent by the server"),
}


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
