"""The MP family's card (MP_Server + DDP_Client and its two ablations): options, regime, guarantee, registry entries.

Formulas: :mod:`protocols.mpddp`.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocols.methods.common import FULL_BATCH_GRADIENT, MODEL_GIVEN_R, ROUND_GOALS
from protocols.methods.nadp import CONSISTENCY, KEYS, RECOVER
from protocols.methods.pairwise import PairwiseOptions
from protocols.methods.registry import register
from protocols.methods.spec import Guarantee, MethodSpec
from protocols.options import MethodOptions, option

#: FedSGD on the squared loss (lr unused), each example's perturbed gradient clipped to 1 on
#: W-hat; the server steps with Adam (post-processing of the recovered gradient: the squared-loss MLP is badly
#: conditioned for the paper's plain xi step, whose right size differs by dataset).
MP_REGIME = {"small": {"hidden": "16", "num-rounds": 30, "clip": 1.0, "server-optimizer": "adam",
                       "mpddp-server-lr": 0.01},
             "large": {"mpddp-server-lr": 0.003, "num-rounds": 60}}


#: ``mpddp-eta``: mpddp's eta_k, N(0, sigma_eta^2) (Gaussian given R) or the paper's DN(sigma_eta, 1) (Eq. 16).
ETA_DISTRIBUTIONS: tuple[str, ...] = ("gaussian", "uniform")


@dataclass(frozen=True)
class MpddpOptions(MethodOptions):
    """The MP family's server step xi, the dtype of its un-noised sides Psi/Phi and mpddp's eta distribution."""

    prefix = "mpddp"
    title = "MP_Server + DDP_Client (mpddp, mpdp-naive, mpcdp)"

    server_lr: float = option(1.0, "xi: server learning rate", low=0.0, low_open=True)
    side_dtype: str = option("float32", "dtype of Psi/Phi (compute + wire); float64 = exact recovery, 2x the cost",
                             choices=("float64", "float32"))
    eta: str = option("gaussian", "mpddp's eta_k: gaussian N(0, sigma_eta^2), counted in the model's guarantee given R "
                                  "(the server adds only the rest) | uniform (the paper's DN(sigma_eta, 1), Eq. 16: "
                                  "uniform given R, not counted)", choices=ETA_DISTRIBUTIONS)


@dataclass(frozen=True)
class Ablation:
    """The family's ablation study (``cancelfl-bench mpddp``): which member plays which part.

    Attributes:
        method: the method under test, whose pairwise noise cancels in the aggregate.
        trusted: its ablation with a trusted server (noise added to the mean): the accuracy ``method`` should match.
        naive: its ablation without cancellation (each client's own noise): the accuracy ``method`` should beat.
    """

    method: str
    trusted: str
    naive: str


ABLATION = Ablation(method="mpddp", trusted="mpcdp", naive="mpdp-naive")

#: What the whole family shares: one full-batch gradient per round (:data:`FULL_BATCH_GRADIENT`), the server steps with
#: it (xi = ``mpddp-server-lr``), and on the small datasets the squared-loss MLP is not held to the defaults benchmark's
#: accuracy floor.
_FAMILY = dict(family="mpddp", regime=MP_REGIME, fixed=FULL_BATCH_GRADIENT, server_step_lr="mpddp-server-lr",
               floor_exempt=("small",))
#: The ablations' shared entries (uplink: no guarantee), their audit adapter included.
_NO_UPLINK = dict(_FAMILY, options=(MpddpOptions,), audit="server.audits.mpddp:MpAudit")
register(MethodSpec("mpddp", "strategies.mpddp:MpddpStrategy", "client.methods.mpddp:train",
                    queries={"keys": KEYS, "consistency": CONSISTENCY, "recover": RECOVER},
                    paper="MP_Server + DDP_Client", options=(PairwiseOptions, MpddpOptions), **_FAMILY,
                    privacy=Guarantee("record", None, MODEL_GIVEN_R), min_per_round=2,
                    recovery_charge="client.methods.mpddp:price_recovery",
                    audit="server.audits.mpddp:MpddpAudit", **ROUND_GOALS))
register(MethodSpec("mpdp-naive", "strategies.mpddp:MpdpNaiveStrategy", "client.methods.mpddp:train",
                    paper="MP_Server + DDP_Client (ablation)", privacy=Guarantee("record", None, MODEL_GIVEN_R),
                    **_NO_UPLINK))
register(MethodSpec("mpcdp", "strategies.mpddp:MpcdpStrategy", "client.methods.mpddp:train",
                    paper="MP_Server + DDP_Client (ablation)",
                    privacy=Guarantee("record", None, MODEL_GIVEN_R + " (the server is trusted with the uploads)"),
                    **_NO_UPLINK))
