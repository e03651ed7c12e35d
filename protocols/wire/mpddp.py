"""Message vocabulary of the mpddp family (``mpddp``, ``mpdp-naive``, ``mpcdp``).

Every key of these protocols lives here, as a private constant; the strategies
(:mod:`strategies.mpddp`) and the client (:mod:`client.methods.mpddp`) only use
the classes and functions below.

Messages of one round:

* ``train`` server -> client: arrays = :class:`PerturbedModel` (the 2L-1 float64
  matrices W-hat, never the true model); config = :class:`~protocols.wire.common.TrainIns`
  plus, for ``mpddp``, :class:`~protocols.wire.keys.PeerKeys` and :class:`DdpNoise`
  (sigma_eta, sigma_Delta), for ``mpdp-naive`` :class:`NaiveNoise` (sigma), for
  ``mpcdp`` nothing else (the server adds the noise).
* ``train`` client -> server: arrays = the :class:`~protocols.mpddp.ClientUpload`
  written by :func:`upload_arrays` (3L arrays: gradients, Psi, Phi), read back by
  :func:`upload_from_record` or, summed straight from the wire, by :func:`mean_upload`.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocols.mpddp import ClientUpload
from protocols.wire.arrays import NpyArray, Weights, array_view, from_record
from protocols.wire.common import read_float, read_list

_W_HAT = "w_hat.{}"
_UP = "up.{}"
_SIGMA_ETA = "sigma-eta"
_SIGMA_DELTA = "sigma-delta"
_SIGMA = "sigma"
_SIZES = "mpddp-sizes"


def _names(template: str, count: int) -> list[str]:
    return [template.format(i) for i in range(count)]


def _check_scale(key: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"'{key}' must be a finite number >= 0, got {value!r}")


# ------------------------------------------------------------------------------ train (server -> client)
@dataclass(frozen=True)
class PerturbedModel:
    """``train`` arrays: the perturbed expanded model W-hat, 2L-1 >= 3 matrices in layer order (float64 on the wire)."""

    matrices: tuple[np.ndarray, ...]

    def __post_init__(self) -> None:
        n = len(self.matrices)
        if n < 3 or n % 2 == 0:
            raise ValueError(f"expected an expanded model {_W_HAT.format(0)}..{_W_HAT.format('(2L-2)')} with L >= 2, "
                             f"got {n} matrices")
        for key, m in zip(_names(_W_HAT, n), self.matrices, strict=True):
            if m.ndim != 2:
                raise ValueError(f"'{key}' must be a matrix, got shape {m.shape}")

    @property
    def num_layers(self) -> int:
        """L, the number of layers of the original MLP."""
        return (len(self.matrices) + 1) // 2

    def to_arrays(self) -> Weights:
        """The named float64 matrices (for an ``ArrayRecord``, :mod:`protocols.wire.arrays`)."""
        return OrderedDict((k, np.asarray(m, dtype=np.float64))
                           for k, m in zip(_names(_W_HAT, len(self.matrices)), self.matrices, strict=True))

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> PerturbedModel:
        """Decode named arrays (``protocols.wire.arrays.from_record`` of the train message's record)."""
        names = _names(_W_HAT, len(arrays))
        if list(arrays) != names:
            raise ValueError(f"expected arrays {_W_HAT.format(0)}..{_W_HAT.format('(2L-2)')} in order, got {list(arrays)}")
        return cls(tuple(np.asarray(arrays[k], dtype=np.float64) for k in names))

    @classmethod
    def from_record(cls, record: Mapping[str, NpyArray]) -> PerturbedModel:
        return cls.from_arrays(from_record(record))


@dataclass(frozen=True)
class DdpNoise:
    """``train`` config (``mpddp``): DN(sigma_eta, 1) for eta_k (Eq. 16) and DN(sigma_Delta, 1) for each Delta_kv (Eq. 19).

    ``sizes``: ``|D_i|`` of the round's participants, in the order of
    :attr:`protocols.wire.keys.PeerKeys.participants` (from the key phase); every client recomputes
    the scales from the smallest (the record sensitivity, :func:`protocols.floor.mpddp_floor`) and
    checks its own entry.  The server's sigmas are only checked against that floor.
    """

    sigma_eta: float
    sigma_delta: float
    sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_scale(_SIGMA_ETA, self.sigma_eta)
        _check_scale(_SIGMA_DELTA, self.sigma_delta)
        if any(isinstance(n, bool) or int(n) != n or n < 1 for n in self.sizes):
            raise ValueError(f"'{_SIZES}' must hold integers >= 1")

    def pair_view(self) -> bytes:
        """SHA-256 of what fixes a client's pair std and its floor besides the graph: both sigmas and the sizes.

        Bound into the pair seeds (:func:`client.pairwise_phase.pair_seeds`' ``view_extra``): two clients shown
        different sizes or scales derive no common pair noise, so a server cannot calibrate each client's eta for
        its own size list while one sigma_Delta keeps the Delta's cancelling.  The sizes are in the order of the
        participant list, which the view digest binds.
        """
        h = hashlib.sha256(b"cancelfl/mpddp-pair-view/v1"
                           + struct.pack(">dd", float(self.sigma_eta), float(self.sigma_delta)))
        h.update(len(self.sizes).to_bytes(8, "big"))
        for n in self.sizes:
            h.update(int(n).to_bytes(8, "big"))
        return h.digest()

    def to_config(self) -> dict[str, Any]:
        rec = {_SIGMA_ETA: float(self.sigma_eta), _SIGMA_DELTA: float(self.sigma_delta)}
        if self.sizes:  # Flower cannot serialise empty lists
            rec[_SIZES] = [int(n) for n in self.sizes]
        return rec

    @classmethod
    def from_config(cls, rec: Mapping[str, Any]) -> DdpNoise:
        return cls(read_float(rec, _SIGMA_ETA), read_float(rec, _SIGMA_DELTA),
                   tuple(read_list(rec, _SIZES, int, default=[])))


@dataclass(frozen=True)
class NaiveNoise:
    """``train`` config (``mpdp-naive``): the noise MULTIPLIER z (std / record sensitivity) of the N(0, (z S_k)^2) noise.

    Record level: each client's sensitivity ``S_k = 2 clip / |D_k|`` is its own (the server need not
    know the sizes), so the server announces the multiplier; the client refuses one below its own.
    """

    sigma: float

    def __post_init__(self) -> None:
        _check_scale(_SIGMA, self.sigma)

    def to_config(self) -> dict[str, Any]:
        return {_SIGMA: float(self.sigma)}

    @classmethod
    def from_config(cls, rec: Mapping[str, Any]) -> NaiveNoise:
        return cls(read_float(rec, _SIGMA))


# ------------------------------------------------------------------------------ upload (client -> server)
def upload_arrays(upload: ClientUpload, side_dtype: type | np.dtype | str = np.float64) -> Weights:
    """``train`` reply arrays: 3L named arrays [gradients..., Psi..., Phi...], each in its wire dtype.

    Gradients always go as float64 (the pairwise Delta's must cancel to round-off in the server's sum);
    Psi and Phi, unnoised side information, go as ``side_dtype`` (float32 halves the upload).
    """
    big_l = upload.num_layers
    dtypes = [np.dtype(np.float64)] * big_l + [np.dtype(side_dtype)] * (2 * big_l)
    arrays = upload.to_arrays()
    return OrderedDict((k, np.asarray(a, dtype=dt)) for k, a, dt in
                       zip(_names(_UP, len(arrays)), arrays, dtypes, strict=True))


def _upload_views(record: Mapping[str, NpyArray], num_layers: int) -> list[np.ndarray]:
    """Zero-copy, read-only views of one upload's 3L arrays, in order (ValueError if malformed)."""
    names = _names(_UP, 3 * num_layers)
    if list(record) != names:
        raise ValueError(f"expected arrays {names[0]}..{names[-1]}, got {list(record)[:4]}...")
    views = [array_view(record[k]) for k in names]
    if any(v.dtype.kind != "f" for v in views):
        raise ValueError("upload arrays must be floating point")
    return views


def upload_from_record(record: Mapping[str, NpyArray], num_layers: int) -> ClientUpload:
    """Decode one upload (float64 copies; ValueError if malformed)."""
    return ClientUpload.from_arrays([np.array(v, dtype=np.float64) for v in _upload_views(record, num_layers)])


def mean_upload(records: Sequence[tuple[int, Mapping[str, NpyArray]]], num_layers: int) -> ClientUpload:
    """Eqs. (20), (21) straight from the wire: the unweighted mean of ``(node id, upload record)`` pairs.

    Sums zero-copy views of the received bytes into one float64 accumulator (in upload order, the
    same float operations as :func:`protocols.mpddp.aggregate`), so the server never holds a second
    copy of K uploads (K x 2.4 MB on the MNIST MLP).  ValueError names the first malformed upload.
    """
    if not records:
        raise ValueError("no uploads to aggregate")
    names = _names(_UP, 3 * num_layers)
    acc: list[np.ndarray] = []
    for node, record in records:
        try:
            views = _upload_views(record, num_layers)
        except ValueError as err:
            raise ValueError(f"node {node}: {err}") from err
        if not acc:
            acc = [np.array(v, dtype=np.float64) for v in views]
            continue
        for a, v, k in zip(acc, views, names, strict=True):
            if v.shape != a.shape:
                raise ValueError(f"node {node}: {k} has shape {v.shape}, the first upload {a.shape}")
            np.add(a, v, out=a)
    for a in acc:
        a /= len(records)
    return ClientUpload.from_arrays(acc)
