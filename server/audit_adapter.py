"""What a method's audit adapter declares: :class:`AuditAdapter` (the default: an honest-but-curious server).

A method becomes auditable by naming an adapter on its card (``MethodSpec(..., audit=...)``, a subclass, an
instance or a ``"module:attr"`` string; the built-in ones live in :mod:`server.audits`).  The generic engine
(:mod:`server.audit`, :mod:`server.audit_release`) runs the method's registered strategy and client handlers and
asks the adapter only what differs by method: the canaries it is audited with, the faults planted in its release
code, its federation and run config, services its releases need, and the adversary's view of one release.
The attacks benchmark asks it too: what the server infers of one client's gradient from its upload
(:meth:`AuditAdapter.gradient_view`), the loss its clients train with and the model they receive.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
from flwr.app import Message

from protocols.arrays import Weights
from protocols.methods import method_spec
from protocols.wire.arrays import from_record
from server.audit_canaries import _AdaptiveCanaries, _Canaries
from server.audit_faults import Fault, SelfTest
from server.audit_spec import CANARY_SCALE, AuditSpec
from server.local_grid import LocalGrid

__all__ = ["AuditAdapter", "GradientView", "ReleaseView", "weights_view"]


@dataclass
class GradientView:
    """The per-client gradient the server infers from one upload (original model space), or why there is none.

    ``noise_scale``: the per-entry noise std the server knows (up to a common factor), if any.
    """

    gradient: Weights | None
    note: str
    noise_scale: Weights | None = None


def weights_view(cap: Any, upload: Weights, note: str) -> GradientView:
    """An upload read as the local model after one SGD step of batch size 1: ``g = (w_sent - upload) / lr``.

    ``cap``: the round-1 capture (:class:`benchmarks.adversary.uplink.UplinkCapture`: ``cfg``, ``sent``).
    """
    sent = from_record(cap.sent.content["arrays"])
    return GradientView(OrderedDict((k, (sent[k] - upload[k]) / cap.cfg.lr) for k in sent), note)


@dataclass
class ReleaseView:
    """One finished release as the server holds it; an adapter's :meth:`AuditAdapter.view` reads it.

    ``part``: node id -> partition (the canaries' client index); ``victim``: the node a per-client fault hits;
    ``audited``: bool per canary, part of the audit (an adapter may narrow it, e.g. to the non-colluders').
    """

    spec: AuditSpec
    strategy: Any
    grid: LocalGrid
    replies: list[Message]
    aggregate: Any
    canaries: _Canaries | _AdaptiveCanaries
    part: dict[int, int]
    victim: int
    audited: np.ndarray

    def uploads(self) -> dict[int, np.ndarray]:
        """Every client's upload (the canary model's weight, float64) with the self-masks the strategy rebuilt removed.

        Pair noise is left in: it is correlated across the uploads, and the audit reads all of them together.
        """
        uploads = {r.metadata.src_node_id: np.array(from_record(r.content["arrays"])["linear.weight"], dtype=np.float64)
                   for r in self.replies}
        strategy = self.strategy
        if getattr(strategy, "remove_masks", None) is not None and strategy._state is not None:
            flat = {n: u.ravel() for n, u in uploads.items()}
            strategy.remove_masks(strategy._state, flat)
            uploads = {n: u.reshape(uploads[n].shape) for n, u in flat.items()}
        return uploads

    def colluders(self) -> list[int]:
        """The ``spec.colluders`` nodes that hand the server their round's material (the last in node order).

        Their canaries leave the audit (``audited``): the audit is of the other clients.
        """
        k = self.spec.colluders
        nodes = sorted(self.part)[-k:] if k else []
        self.audited = self.audited & ~np.isin(self.canaries.owner(), [self.part[c] for c in nodes])
        return nodes

    def material_of(self, colluder: int) -> dict[int, bytes]:
        """The pair material ``colluder`` holds for this round, by neighbour (its :class:`client.recovery.RecoveryStore`).

        Raises:
            RuntimeError: the client kept no material (it did not upload in this round).
        """
        from client.api import client_env
        from client.recovery import RecoveryStore
        from server.audit_canaries import CanaryModel

        ctx = self.grid.contexts[colluder]
        x, y = self.canaries.data(int(ctx.node_config["partition-id"]))
        store = RecoveryStore.load(client_env(ctx, CanaryModel(self.canaries.dim), x, y))
        if store is None:
            raise RuntimeError(f"colluder {colluder} holds no pair material for this round")
        return dict(store.material)

    def features_of(self, uploads: dict[int, np.ndarray]) -> np.ndarray:
        """The canaries' features in ``uploads`` (node -> canary-model weight), in partition order."""
        return self.canaries.features([{"linear.weight": uploads[n]} for n in sorted(uploads, key=self.part.get)])


class AuditAdapter:
    """A method's audit knowledge; the defaults fit a method whose server sees each client's noised upload.

    Attributes:
        canaries: the canary kinds it is audited with (:data:`server.audit_spec.CANARIES`); the first is the default.
        fault_canaries: the canary a fault is audited with when none is named (by fault; else the default).
        faults: the faults planted in its release code, by ``--fault`` name (:class:`server.audit_faults.Fault`).
        colluders: the upload view may include peers handing the server their pair material (``--colluders``);
            :meth:`tolerated_colluders` says how many of them the claim covers.
        canary_scale: a gradient canary's input, in units of clip (:data:`server.audit_spec.CANARY_SCALE`).
        mlp_canaries: gradient canaries train the MLP (:func:`server.audit_canaries.canary_mlp`), not the linear model.
        mlp_zero_output: that MLP's output layer starts at zero in the view read with the secret (``secret_view``).
        one_trial_per_release: the canaries of one release share a secret noise scale, so the threshold and the
            bound count one canary per release (unless the view is given that secret, ``secret_view``).
        secret_view: ``--given-secret``: its model view can be read with the release's secret, which makes the
            canaries of a release independent (every one is counted).
        secret_claim: its claim's argument holds for every value of that secret (then a bound above the claim
            given the secret is a violation; else it is outside the claim).
        nominal_claim: its card states its claim as nominal, not a guarantee (a bound above it is reported, not
            counted as a violation).
        self_tests: the planted-fault rows ``cancelfl-bench audit`` adds to the method's rows, each in the view whose
            claim its fault breaks (:class:`server.audit_faults.SelfTest`); they must be flagged.
        variants: ``(label, rounds, settings, trials)`` upload rows ``cancelfl-bench audit`` adds: the run's first
            round with ``rounds`` in its schedule and the run-config ``settings`` (another accounting, say); ``trials``
            ``None`` = the row's default.
        training_loss: the loss its clients train with (``ce`` or ``mse``, :func:`protocols.task.training.loss_fn`).
    """

    canaries: tuple[str, ...] = ("gradient",)
    faults: Mapping[str, Fault] = MappingProxyType({})
    fault_canaries: Mapping[str, str] = MappingProxyType({})
    colluders: bool = False
    mlp_canaries: bool = False
    mlp_zero_output: bool = False
    one_trial_per_release: bool = False
    secret_view: bool = False
    secret_claim: bool = False
    nominal_claim: bool = False
    canary_scale: float = CANARY_SCALE
    self_tests: tuple[SelfTest, ...] = ()
    variants: tuple[tuple[str, int, Mapping[str, Any], int | None], ...] = ()
    training_loss: str = "ce"

    def federation(self, direction: str, canary: str, *, given_secret: bool = False) -> dict[str, int]:
        """Default ``trials``, ``clients`` and ``per_client``: about a minute on 2 shared cores.

        Gradient canaries give ``clients x per_client`` trials per release; adaptive canaries one per client
        (``upload``) or one per release (``model``).
        """
        if canary == "adaptive":
            return {"trials": 3_200, "clients": 16, "per_client": 2} if direction == "upload" else \
                {"trials": 400, "clients": 2, "per_client": 2}
        return {"trials": AuditSpec.trials, "clients": AuditSpec.clients, "per_client": AuditSpec.per_client}

    def fault_view(self, fault: str) -> str:
        """The view ``fault`` is audited in: its self-test row's direction (:attr:`self_tests`), else ``upload``."""
        return next((t.view for t in self.self_tests if t.fault == fault), "upload")

    def run_config(self, spec: AuditSpec) -> dict[str, Any]:
        """Run-config keys the method's releases set beyond :meth:`AuditSpec.run_config`'s (none by default)."""
        return {}

    def claim_account(self, spec: AuditSpec) -> str:
        """The ledger account whose epsilon is the claim for ``spec``'s view (:data:`server.audit_spec.CLAIMS`).

        Default: ``uplink`` for the ``upload`` view, ``downlink`` for ``model``.
        """
        return "uplink" if spec.direction == "upload" else "downlink"

    def tolerated_colluders(self, spec: AuditSpec) -> int:
        """Colluding peers of an audited client that the method's claim covers (its threat model's c; 0 by default).

        A bound above the claim with at most this many colluders is a violation; with more it is outside the claim.
        """
        return 0

    @contextlib.contextmanager
    def services(self, spec: AuditSpec, raw: dict) -> Iterator[dict]:
        """Start what every release needs for the audit's duration; yield the nodes' run config (``raw`` itself)."""
        yield raw

    def plant_canaries(self, spec: AuditSpec) -> contextlib.AbstractContextManager:
        """Context of one release in which the canary records reach the release code (nothing to patch by default).

        A white-box adapter may patch the per-example computation so that a canary record is the gradient an
        adversary plants; the release code's own clipping and noise still act on it.
        """
        return contextlib.nullcontext()

    def notes(self, spec: AuditSpec) -> list[str]:
        """Lines the report adds after its claim (what a reader must know about this method's bound)."""
        return []

    def view(self, rel: ReleaseView) -> np.ndarray:
        """(trials, f) features of one release in the adversary's view of ``rel.spec.direction``."""
        return self.model_view(rel) if rel.spec.direction == "model" else self.upload_view(rel)

    def model_view(self, rel: ReleaseView) -> np.ndarray:
        """The published aggregate."""
        return rel.canaries.features([from_record(rel.aggregate)])

    def upload_view(self, rel: ReleaseView) -> np.ndarray:
        """What the server holds of the uploads: all of them, self-masks removed (:meth:`ReleaseView.uploads`).

        Adaptive canaries: one trial per client, read from its own upload.
        """
        if isinstance(rel.canaries, _AdaptiveCanaries):
            by_part = {rel.part[r.metadata.src_node_id]: from_record(r.content["arrays"]) for r in rel.replies}
            return np.concatenate([rel.canaries.features([by_part[c]]) for c in range(rel.spec.clients)])
        return rel.features_of(rel.uploads())

    def gradient_view(self, cap: Any) -> GradientView:
        """What the server infers of the victim's gradient from its round-1 upload (one record, batch size 1).

        ``cap``: :class:`benchmarks.adversary.uplink.UplinkCapture` (``cfg``, ``strategy``, ``sent``, ``reply``,
        ``side``).  Default: an upload shaped like the model read as the local model after one SGD step
        (:func:`weights_view`; the exact gradient for a method without DP), else no view.
        """
        up = from_record(cap.reply.content["arrays"]) if "arrays" in cap.reply.content else {}
        model = cap.global_weights
        if set(up) != set(model) or any(up[k].shape != model[k].shape for k in up):
            return GradientView(None, "no attacker view defined for this upload format")
        note = ("local model after one SGD step: (w - upload)/lr is the exact gradient"
                if not method_spec(cap.cfg.method).units else "upload read as a local model (no method-specific view)")
        return weights_view(cap, OrderedDict((k, up[k]) for k in model), note)

    def uplink_side_channel(self, store: dict[str, np.ndarray]) -> AbstractContextManager:
        """Record into ``store`` (roster name -> vector) what leaves a client outside the Flower grid in round 1.

        Nothing by default.
        """
        return contextlib.nullcontext()

    def received_forward(self, arrays: Weights, cfg: Any) -> tuple[Callable, str] | None:
        """The model a client receives in a train message's ``arrays``: (forward function, what it is).

        ``None`` (default): the global model itself.
        """
        return None
