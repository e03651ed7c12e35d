"""The NADP-FL round plan: the public values every participant needs to compute its noise.

The server sends one :class:`NadpPlan` (identical for all participants, so both
ends of every pair derive the same ``sigma_ij``) with the train message, next
to :class:`protocols.wire.common.TrainIns` and the participant's
:class:`protocols.wire.keys.PeerKeys`.  The client rebuilds the allocation
(Alg. 2, or the sparse-graph rule over :func:`protocols.graphs.round_graph`)
from it; nothing secret travels here.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from protocols.methods.nadp import VARIANTS as NADP_VARIANTS
from protocols.wire.common import node_id_strings, read_float, read_list, read_node_ids, read_str

_VARIANT = "nadp-variant"
_IDS = "nadp-ids"
_SIZES = "nadp-sizes"
_SIGMA_UP = "nadp-sigma-up"
_SIGMA_DOWN = "nadp-sigma-down"
_LAMBDA = "nadp-lambda"
_LDP_STDS = "nadp-ldp-stds"
_NOISE_SCALE = "nadp-noise-scale"


@dataclass(frozen=True)
class NadpPlan:
    """Public per-round plan of NADP-FL.

    Attributes:
        variant: ``"nadp"`` (pairwise counteracting noise) or ``"record-ldp"`` (independent noise only).
        ids: the round's participants (ascending node ids).
        sizes: ``|D_i|`` of each participant (the allocation's weights).
        sigma_up, sigma_down: Eq. 3 stds of one upload and of the aggregate (0 for record-ldp).
        lam: compensation factor ``lambda >= 1`` (Eq. 8 or run-config ``nadp-lambda``).
        ldp_stds: record-ldp only: each participant's upload noise std.
        noise_scale: factor on every std of the round's calibration (>= 1 for a client to accept it): the
            server raises the noise when the run's epsilon budget left needs it (:mod:`strategies.run.budget`).
            Sent only when not 1.
    """

    variant: str
    ids: tuple[int, ...]
    sizes: dict[int, int]
    sigma_up: float
    sigma_down: float
    lam: float
    ldp_stds: dict[int, float] = field(default_factory=dict)
    noise_scale: float = 1.0

    def pair_view(self) -> bytes:
        """SHA-256 of what fixes every pair's std at both ends besides the graph: the sizes and the noise scale.

        Bound into the pair seeds (:func:`client.pairwise_phase.pair_seeds`' ``view_extra``): two clients shown
        different sizes or scales derive no common pair noise, so a server cannot give the two ends of a pair
        different stds and weight the uploads to cancel one client's pair noise alone.
        """
        h = hashlib.sha256(b"cancelfl/nadp-pair-view/v1" + struct.pack(">d", float(self.noise_scale)))
        for n in sorted(self.sizes):
            h.update(int(n).to_bytes(8, "big") + int(self.sizes[n]).to_bytes(8, "big"))
        return h.digest()

    def to_config(self) -> dict[str, Any]:
        rec = {
            _VARIANT: self.variant,
            _IDS: node_id_strings(self.ids),
            _SIZES: [int(self.sizes[n]) for n in self.ids],
            _SIGMA_UP: float(self.sigma_up),
            _SIGMA_DOWN: float(self.sigma_down),
            _LAMBDA: float(self.lam),
        }
        if self.ldp_stds:
            rec[_LDP_STDS] = [float(self.ldp_stds[n]) for n in self.ids]
        if self.noise_scale != 1.0:
            rec[_NOISE_SCALE] = float(self.noise_scale)
        return rec

    @classmethod
    def from_config(cls, rec: Mapping[str, Any]) -> NadpPlan:
        variant = read_str(rec, _VARIANT)
        if variant not in NADP_VARIANTS:
            raise ValueError(f"'{_VARIANT}' = {variant!r} is not one of {NADP_VARIANTS}")
        ids = read_node_ids(rec, _IDS)
        sizes = read_list(rec, _SIZES, int)
        if len(sizes) != len(ids) or len(set(ids)) != len(ids):
            raise ValueError(f"'{_IDS}' and '{_SIZES}' must be equally long, ids distinct")
        if any(s < 1 for s in sizes):
            raise ValueError(f"'{_SIZES}' must be positive")
        sigma_up, sigma_down = read_float(rec, _SIGMA_UP), read_float(rec, _SIGMA_DOWN)
        if sigma_up < 0 or sigma_down < 0:
            raise ValueError(f"'{_SIGMA_UP}' and '{_SIGMA_DOWN}' must be >= 0")
        lam = read_float(rec, _LAMBDA)
        if lam < 1.0:
            raise ValueError(f"'{_LAMBDA}' must be >= 1, got {lam}")
        ldp = [float(s) for s in read_list(rec, _LDP_STDS, (int, float), default=[])]
        if variant == "record-ldp" and len(ldp) != len(ids):
            raise ValueError(f"'{_LDP_STDS}' must hold one std per participant")
        if any(not (math.isfinite(s) and s >= 0) for s in ldp):
            raise ValueError(f"'{_LDP_STDS}' must be finite and >= 0")
        scale = read_float(rec, _NOISE_SCALE, default=1.0)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"'{_NOISE_SCALE}' must be finite and > 0, got {scale}")
        return cls(variant, ids, dict(zip(ids, sizes, strict=True)), sigma_up, sigma_down, lam,
                   dict(zip(ids, ldp, strict=True)) if ldp else {}, scale)
