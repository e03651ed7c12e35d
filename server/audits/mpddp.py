"""The MP family's audit adapter (mpddp, mpdp-naive, mpcdp): an MLP canary and the server's recovery with R.

FedSGD on :func:`server.audit_canaries.canary_mlp` with the paper's xi step (SGD), so the model is linear in the
release.  Model view: the round's secret R scales the noise and the signal of every canary of a release alike
(layer 1 is ``R^(1) o`` the perturbed-space step, one positive scale per hidden unit), so the canaries of one
release are not independent and the threshold and the bound count one canary per release.  ``given_secret``:
the published first layer divided by R^(1), the perturbed-space mean step plus its noise; given R the canaries
of a release are independent and each is counted.  Upload view: each upload recovered alone with R (Eq. 22), as
the server can.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import numpy as np

from protocols.arrays import Weights
from protocols.wire.arrays import from_record
from server.audit_adapter import AuditAdapter, GradientView, ReleaseView
from server.audit_canaries import MLP_HIDDEN
from server.audit_faults import HALVE_GAUSSIAN, HALVE_NOISE
from server.audit_spec import AuditSpec

__all__ = ["MpAudit", "MpddpAudit"]

#: What the server reads from one upload recovered alone, per method: (the attacks benchmark's note, whether the
#: recovered upload carries client noise).
_UPLOADS: dict[str, tuple[str, bool]] = {
    "mpddp": ("own recovery (secret R) of one upload: gradient + R o (eta_k + sum of pairwise Delta_kv)", True),
    "mpdp-naive": ("own recovery (secret R) of one upload: gradient + R o eta_k", True),
    "mpcdp": ("own recovery (secret R) of one upload: the exact gradient (noise added later by the server)", False),
}


class MpAudit(AuditAdapter):
    """mpdp-naive and mpcdp: Gaussian noise on the perturbed-space step, so their claim's argument holds per R.

    Their Gaussian std halved is the planted fault (caught given the secret).
    """

    mlp_canaries = True
    training_loss = "mse"  # the paper's 1/2 ||y - onehot||^2
    one_trial_per_release = True
    secret_view = True
    secret_claim = True
    nominal_claim = True  # MODEL_NOMINAL: clipping bounds the perturbed-space gradient, not the recovered one
    #: The canary's column then carries nearly all of its clipped gradient (the shared bias and output-layer parts
    #: do not grow with the input).
    canary_scale = 1000.0
    faults = MappingProxyType({HALVE_NOISE: HALVE_GAUSSIAN})

    def federation(self, direction: str, canary: str, *, given_secret: bool = False) -> dict[str, int]:
        if canary == "adaptive":
            return super().federation(direction, canary)
        if given_secret:
            return {"trials": 200_000, "clients": 4, "per_client": 500}
        return {"trials": 12_000, "clients": 3, "per_client": 10}

    def run_config(self, spec: AuditSpec) -> dict[str, Any]:
        """FedSGD on the canary MLP with the paper's xi step (SGD), float64 sides, no self-mask.

        Self-mask off: the server removes the self-mask of every upload it holds, so its view is the same
        without it, and the recovery reads the uploads as they stand.
        """
        return {"hidden": str(MLP_HIDDEN), "server-optimizer": "sgd", "mpddp-server-lr": spec.lr,
                "mpddp-side-dtype": "float64", "self-mask": False}

    def notes(self, spec: AuditSpec) -> list[str]:
        if spec.given_secret:
            return ["MP family, given the secret: the published first layer divided by R^(1) (the perturbed-space "
                    "step and its noise); a release's canaries are independent given R, each is counted, the "
                    "discriminant is fitted on half of each release's canaries and tested on the other half"]
        return ["MP family: the release's secret R scales the noise of all its canaries, so the threshold and the "
                "bound count one canary per release (the others fit the test)"]

    def model_view(self, rel: ReleaseView) -> np.ndarray:
        """The published model; ``given_secret``: its first layer divided entrywise by the round's R^(1).

        The canaries' columns of the published first layer are ``-xi R^(1) o (g + r^T Psi - v Phi + noise)`` (the
        mean over the clients); divided by R^(1), each canary's column depends on its own record and noise only.
        """
        if not rel.spec.given_secret:
            return super().model_view(rel)
        w = dict(from_record(rel.aggregate))
        r1 = rel.strategy._state.secret.trainable_R()[0].numpy()  # (hidden, inputs + 1): [W, b] of layer 1
        w["layers.0.weight"] = np.asarray(w["layers.0.weight"], dtype=np.float64) / r1[:, :-1]
        return rel.canaries.features([w])

    def upload_view(self, rel: ReleaseView) -> np.ndarray:
        """Every upload recovered alone with the round's secret R (the server holds both), in partition order.

        Eq. (22) on one client's gradient, Psi and Phi gives that client's true-space gradient plus ``R o`` its
        noise (mpddp: eta and its uncancelled Delta's).
        """
        from protocols.mpddp import recover
        from protocols.wire.mpddp import mean_upload

        st = rel.strategy._state
        out = []
        for r in sorted(rel.replies, key=lambda r: rel.part[r.metadata.src_node_id]):
            up = mean_upload([(r.metadata.src_node_id, r.content["arrays"])], len(st.layers))
            out.append({f"layers.{i}.weight": w.numpy() for i, (w, _) in enumerate(recover(up, st.secret))})
        return rel.canaries.features(out)

    def gradient_view(self, cap: Any) -> GradientView:
        """The server recovers the client's own gradient with its secret R (Eq. 22 on this one upload).

        The upload is the gradient at the perturbed model W-hat plus the un-noised Psi, Phi: the server gets the
        client's true gradient + R o (eta_k + sum_v Delta_kv) for mpddp (the Delta's do not cancel in one upload),
        + R o eta_k for mpdp-naive, the exact gradient for mpcdp (its noise is added by the server later).
        """
        from protocols.mpddp import aggregate, recover
        from protocols.wire.mpddp import upload_from_record
        from strategies.mpddp import weights_from_layers

        state = getattr(cap.strategy, "_state", None)
        if state is None or getattr(state, "round", None) != 1:
            return GradientView(None, "server secret of round 1 not available")
        upload = upload_from_record(cap.reply.content["arrays"], len(state.layers))
        grads = recover(aggregate([upload]), state.secret)
        what, client_noise = _UPLOADS[cap.cfg.method]
        scale = None
        if client_noise:  # recovered noise on entry ij is R_ij * (i.i.d. noise): the server knows R
            scale = weights_from_layers([(rm[:, :-1].abs(), rm[:, -1].abs()) for rm in state.secret.trainable_R()])
        return GradientView(weights_from_layers(grads), what, scale)

    def received_forward(self, arrays: Weights, cfg: Any) -> tuple[Callable, str]:
        """Forward pass of the perturbed expanded model W-hat a client of the family receives."""
        import torch

        from protocols.mpddp import forward_expanded
        from protocols.wire.mpddp import PerturbedModel

        mats = [torch.as_tensor(m) for m in PerturbedModel.from_arrays(arrays).matrices]
        return (lambda t: forward_expanded(mats, t.double().reshape(len(t), -1))), \
            "perturbed model W-hat sent by the server"


class MpddpAudit(MpAudit):
    """mpddp: no planted fault; its claim is marginal over R (Theorems 5, 6), so given R it is not its argument.

    DN(sigma_eta, 1) is uniform: R o eta is Gaussian only over R's draw, and given R the noise is bounded.
    """

    secret_claim = False
    faults = MappingProxyType({})
