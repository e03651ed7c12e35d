"""One record's move of the MP family's clipped upload, on perturbed models W-hat a malicious server crafts.

:func:`protocols.mpddp.clipped_client_gradients` (what the mpddp, mpcdp and mpdp-naive clients run) weighs example b
by ``min(1, clip / N_b) / B``, ``N_b = ||g^_b|| + rho s_b + rho^2 ||Phi_b||``.  Replacing one of the B records moves
the uploaded gradient by at most ``2 clip / B``, and, given R with ``||r|| = rho`` (``kappa = 1``), the recovered
gradient divided by R (``g^ - r^T Psi + v Phi``, ``v = ||r||^2``) by at most ``2 clip / B``.  Checked on W-hats with
huge, tiny, cancelling and saturating entries, a tiny or huge rho and ill-conditioned Psi, in float32 and float64,
with adversarial records, and through the real clients.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord

from client.app import app as client_app
from protocols.config import RunConfig
from protocols.mpddp import clipped_client_gradients, keeps_records, mask_reference
from protocols.mpddp.gradients import ClientUpload
from protocols.privacy import smallest_resolvable
from protocols.task.data import dataset_for
from protocols.task.models import build_model, get_weights
from protocols.wire.common import TrainIns
from protocols.wire.mpddp import PerturbedModel, upload_from_record
from server.defaults import app_defaults
from server.local_grid import LocalGrid
from strategies.mpddp import MpcdpStrategy, MpddpStrategy
from strategies.records import to_record
from tests.test_nonfinite_records import _patch_data

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = [torch.float32, torch.float64]


def _flat(ts) -> torch.Tensor:
    return torch.cat([t.double().reshape(-1) for t in ts])


def _recovered(up: ClientUpload, r: torch.Tensor, *, side_only: bool = False) -> torch.Tensor:
    """The upload's ``g^ - r^T Psi + v Phi`` over every block (``- r^T Psi + v Phi`` with ``side_only``), float64."""
    v = float(r @ r)
    return torch.cat([((0.0 if side_only else g.double()) - torch.einsum("k,kij->ij", r, p.double())
                       + v * f.double()).reshape(-1) for g, p, f in zip(up.grads, up.psi, up.phi, strict=True)])


def _ratios(ups: tuple[ClientUpload, ClientUpload], rho: float, bound: float, gen: torch.Generator, *,
            side_only: bool = False) -> tuple[float, float]:
    """(uploaded gradient's move, largest given-R move) over ``bound``, for ``||r|| = rho``.

    The directions of r: two random ones and both signs of the top left singular vector of the move of Psi.
    """
    up = float((_flat(ups[0].grads) - _flat(ups[1].grads)).norm()) / bound
    dpsi = torch.cat([(a.double() - b.double()).reshape(a.shape[0], -1) for a, b in zip(ups[0].psi, ups[1].psi,
                                                                                      strict=True)], dim=1)
    dirs = [torch.randn(dpsi.shape[0], generator=gen, dtype=torch.float64) for _ in range(2)]
    if float(dpsi.abs().max()) > 0:
        top = torch.linalg.svd(dpsi / dpsi.abs().max(), full_matrices=False)[0][:, 0]
        dirs += [top, -top]
    given_r = 0.0
    for d in dirs:
        r = d / d.norm() * rho
        moved = _recovered(ups[0], r, side_only=side_only) - _recovered(ups[1], r, side_only=side_only)
        given_r = max(given_r, float(moved.norm()) / bound)
    return up, given_r


def _moves(mats, x, y, xr, yr, clip: float, gen: torch.Generator) -> tuple[float, float]:
    """:func:`_ratios` of the clipped uploads of the neighbours ``(x, y)`` and ``(xr, yr)`` (B records each)."""
    rho = mask_reference(mats[-1].double().numpy())
    ups = tuple(clipped_client_gradients(mats, a, b, clip, rho=rho)[0] for a, b in ((x, y), (xr, yr)))
    return _ratios(ups, rho, 2 * clip / x.shape[0], gen)


def _smallest_clip(dtype: torch.dtype) -> float:
    """The smallest clip the clients compute in ``dtype`` (:func:`client.env.full_batch_dtype`)."""
    info = torch.finfo(dtype)
    return smallest_resolvable(info.max, info.tiny) * 1.001


def _crafted(kind: str, dtype: torch.dtype, dims: list[int], gen: torch.Generator, p: float) -> list[torch.Tensor]:
    """A W-hat (2L-1 matrices) for the MLP ``dims``, of family ``kind`` at strength ``p`` in [-1, 1]."""
    info = torch.finfo(dtype)
    shapes = []
    for i in range(len(dims) - 1):
        rows = dims[i + 1] + (1 if i < len(dims) - 2 else 0)
        shapes.append((rows, dims[i] + 1))
        if i < len(dims) - 2:
            shapes.append((rows, rows))
    mats = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    lo, hi = math.log2(info.tiny), math.log2(info.max)
    if kind == "scaled":  # each matrix its own power of two, over the dtype's range
        mats = [m * 2.0 ** float(torch.randint(int(lo / 2), int(hi / 2), (1,), generator=gen)) for m in mats]
    elif kind == "huge":  # all entries positive: every unit on, activations up to the top of the range
        mats = [m.abs() * 2.0 ** (hi / len(mats) * abs(p)) for m in mats]
    elif kind == "tiny":  # activations down to the smallest normal number
        mats = [m.abs() * 2.0 ** (lo / len(mats) * abs(p)) for m in mats]
    elif kind == "alternating":  # +a, -a columns: every sum cancels
        for m in mats[:-1]:
            m[:, 0::2], m[:, 1::2] = 2.0 ** (hi * 0.3 * p), -(2.0 ** (hi * 0.3 * p))
            m[:, -1] += 1.0
    elif kind == "rho":  # the last matrix alone scaled: a tiny or huge rho
        mats[-1] = mats[-1] * 2.0 ** (p * hi / 2.2)
    elif kind == "rank-one-psi":  # nearly equal rows of the last matrix: Psi_b's Gram matrix close to rank one
        mats[-1][:] = mats[-1][0] * 2.0 ** (p * hi / 4)
        mats[-1][1:] += 1e-7 * torch.randn(mats[-1][1:].shape, generator=gen, dtype=torch.float64)
    elif kind == "equal-eigenvalues":  # orthonormal rows: Psi_b's Gram matrix with equal eigenvalues
        q = torch.linalg.qr(torch.randn(shapes[-1][1], shapes[-1][1], generator=gen, dtype=torch.float64))[0]
        mats[-1] = q[: shapes[-1][0]] * 2.0 ** (p * hi / 4)
    elif kind == "saturating":  # every hidden unit on, activations at a quarter of the range's exponent
        mats = [m.abs() + 1.0 for m in mats]
        mats[0] = mats[0] * 2.0 ** (hi / 4 * abs(p))
    return [m.clamp(-info.max, info.max).to(dtype) for m in mats]


def _neighbours(kind: str, dtype: torch.dtype, batch: int, n_in: int, n_out: int, gen: torch.Generator):
    """``(x, y, xr, yr)``: ``batch`` records and the same with record 0 replaced by a record of kind ``kind``."""
    x = torch.randn(batch, n_in, generator=gen, dtype=torch.float64)
    y = torch.eye(n_out, dtype=torch.float64)[torch.randint(0, n_out, (batch,), generator=gen)]
    xr, yr = x.clone(), y.clone()
    if kind == "random":
        xr[0], yr[0] = torch.randn(n_in, generator=gen, dtype=torch.float64), y[0].roll(1)
    elif kind == "huge":
        xr[0] = torch.randn(n_in, generator=gen, dtype=torch.float64) * math.sqrt(torch.finfo(dtype).max) / 4
    elif kind == "zeros":
        xr[0] = 0.0
    elif kind == "one-hot":
        xr[0], yr[0] = torch.eye(n_in, dtype=torch.float64)[0], torch.eye(n_out, dtype=torch.float64)[0]
    elif kind == "garbage":  # a target far from one-hot
        yr[0] = torch.randn(n_out, generator=gen, dtype=torch.float64) * 1e6
    return x.to(dtype), y.to(dtype), xr.to(dtype), yr.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_record_moves_the_clipped_upload_within_its_bounds_on_crafted_models(dtype: torch.dtype) -> None:
    """Crafted W-hats of every family: one record moves the upload and the given-R recovery by at most ``2 clip / B``.

    Five kinds of replaced record, batches of 1 to 200, clips from the smallest the dtype resolves to 1e6 (smaller
    ones are refused by the clients, :func:`client.env.full_batch_dtype`).  Worst ratios measured: 0.9997 for the
    upload and for given R, in float32 and float64.
    """
    gen = torch.Generator().manual_seed(0)
    kinds = ["scaled", "huge", "tiny", "alternating", "rho", "rank-one-psi", "equal-eigenvalues", "saturating"]
    settings = [(1, _smallest_clip(dtype)), (7, 1e-6), (200, 1.0), (7, 1e6)]
    worst, near = [0.0, 0.0], 0
    for kind in kinds:
        for p in (-1.0, 0.5):
            for dims in ([3, 4, 2], [5, 4, 3, 3]):
                mats = _crafted(kind, dtype, dims, gen, p)
                for i, record in enumerate(("random", "huge", "zeros", "one-hot", "garbage")):
                    for batch, clip in settings[i % 2 :: 2] if kind != "rho" else settings:
                        x, y, xr, yr = _neighbours(record, dtype, batch, dims[0], dims[-1], gen)
                        moved = _moves(mats, x, y, xr, yr, clip, gen)
                        assert all(math.isfinite(m) for m in moved)
                        worst = [max(w, m) for w, m in zip(worst, moved, strict=True)]
                        near += moved[1] > 0.5
    assert worst[0] <= 1.0 + 1e-4 and worst[1] <= 1.0 + 1e-4, worst
    assert near >= 50  # the bound is approached, not met by dropping every record


def _underflowing_side_terms(dtype: torch.dtype, n_in: int = 1, n_out: int = 2, hidden: int = 1,
                             batch: int = 9) -> tuple[list[np.ndarray], float, float]:
    """``(mats, rho, clip)``: a W-hat on which a class-0 record's Psi and Phi have squares below the dtype's range.

    L = 2: hidden unit 0 is ``2^-c`` for every record (from the constant input), output 0 is ``2^c`` times it, exactly
    1, the other outputs 0: a class-0 record has no error and no gradient, while its Psi_0 is ``2^b (x, 1)`` with
    ``2^b`` below the square root of the dtype's smallest subnormal number (for ``||(x, 1)|| <= 8``) and ``rho ~ 2^c``
    large enough that the last matrix's Psi term (``rho 2^-2c``) stays below it.  ``clip``: the smallest at which the
    Phi terms of a batch of ``batch`` resolve (:func:`protocols.mpddp.gradients._multipliers`).
    """
    info = torch.finfo(dtype)
    b = math.floor(math.log2(math.sqrt(float(info.smallest_normal) * info.eps))) - 4
    c = 1 - b // 2
    mats = [np.zeros((hidden + 1, n_in + 1)), np.zeros((hidden + 1, hidden + 1)), np.zeros((n_out, hidden + 1))]
    mats[0][0, -1], mats[1][0, 0], mats[2][0, 0] = 2.0 ** (-c - b), 2.0 ** b, 2.0 ** c
    rho = mask_reference(mats[2])
    return mats, rho, 4 * float(info.tiny) * batch * rho * rho * 1.01


@pytest.mark.parametrize("dtype", DTYPES)
def test_psi_and_phi_whose_squares_underflow_count_in_the_clip(dtype: torch.dtype) -> None:
    """A record's ``rho s_b`` and ``rho^2 ||Phi_b||`` far above the clip while ``||Psi_b||^2`` and ``||Phi_b||^2`` round to 0.

    A class-0 record at ``x`` replaced by one at ``-x`` (B = 1).  Measured with the squares formed at their own size
    (the record's N_b came out 0: it entered unclipped): the given-R recovery moved by 5.6 (float32) and 7e61
    (float64) times ``2 clip``; the upload stayed within.
    """
    mats, rho, clip = _underflowing_side_terms(dtype)
    mats = [torch.from_numpy(m).to(dtype) for m in mats]
    x, y = torch.tensor([[1.0]], dtype=dtype), torch.tensor([[1.0, 0.0]], dtype=dtype)
    up, clipped = clipped_client_gradients(mats, x, y, clip, rho=rho)
    assert clipped == 1.0 and float(_flat(up.psi).abs().max()) > 0  # clipped, not dropped
    upload, given_r = _moves(mats, x, y, -x, y, clip, torch.Generator().manual_seed(0))
    assert upload <= 1.0 + 1e-4 and given_r <= 1.0 + 1e-4, (upload, given_r)


def test_phi_rounded_on_the_subnormal_grid_moves_the_given_r_recovery_within_the_clip() -> None:
    """float32, W-hats whose ``v = rho^2`` (1e36 to 1e38) times the subnormal grid's step (1.4e-45) nears a clip of 1e-8 to 1e-6.

    L = 2, one hidden unit ``h = m``, output 0 ``m / (2m) = 1/2``: a class-1 record's Phi_b is ``m^2 (x, 1)``, its
    weighted Phi term of a fraction of the grid's step rounds to one step, ``v Phi`` up to twice what the clip
    allowed.  Such a record is dropped (its multipliers count ``rho^2``).  Measured with the multipliers unscaled: 6% of
    the 150 draws moved the given-R recovery by more than 1.01 times ``2 clip`` (worst 1.07).
    """
    rs, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(150):
        m, clip, xv = 10.0 ** rs.uniform(-19.5, -18.5), 10.0 ** rs.uniform(-8, -6), rs.uniform(1, 8)
        mats = [torch.zeros(2, 2, dtype=torch.float64) for _ in range(3)]
        mats[0][0, 1], mats[1][0, 0], mats[2][0, 0] = 1.0, m, 1 / (2 * m)
        x, y = torch.tensor([[xv]]), torch.tensor([[0.0, 1.0]])
        worst = max(worst, _moves([t.float() for t in mats], x, y, -x, y, clip, gen)[1])
    assert worst <= 1.0 + 1e-4, worst


def _crafting(base: type, mats: list[np.ndarray]) -> type:
    """A strategy of class ``base`` that sends ``mats`` as W-hat (a malicious server's plan stage)."""

    class Crafting(base):
        def plan(self, grid, st):
            state = super().plan(grid, st)
            state.model = to_record(PerturbedModel(tuple(mats)).to_arrays(), np.float64)
            return state

    return Crafting


def _raw(method: str, clip: float) -> dict:
    return {**app_defaults(), "method": method, "dataset": "digits", "hidden": "4", "num-clients": 3, "num-rounds": 1,
            "clip": clip, "mask-corruption-rate": 0.0}


def _nine_digits():
    """``(rows, other, labels, dataset)``: three digits records of each class 0-2, and one of class 3."""
    ds = dataset_for(RunConfig.from_mapping(_raw("mpcdp", 1.0)))
    labels = np.asarray(ds.y_train)
    pick = np.concatenate([np.flatnonzero(labels == k)[:3] for k in (0, 1, 2)])
    return pick, int(np.flatnonzero(labels == 3)[0]), labels, ds


def _real_replies(method: str, mats: list[np.ndarray], clip: float) -> list:
    """Round 1 of the real ``method`` clients (digits, hidden 4, 3 nodes) given ``mats`` as W-hat: their replies."""
    raw = _raw(method, clip)
    cfg = RunConfig.from_mapping(raw)
    ds = dataset_for(cfg)
    grid = LocalGrid(client_app, cfg.num_clients, raw)
    strategy = _crafting({"mpddp": MpddpStrategy, "mpcdp": MpcdpStrategy}[method], mats)(cfg)
    model = build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.hidden_sizes, cfg.seed)
    msgs = list(strategy.configure_train(1, to_record(get_weights(model), np.float64),
                                         ConfigRecord(TrainIns(1).to_config()), grid))
    assert all(np.array_equal(m, w) for m, w in zip(PerturbedModel.from_record(msgs[0].content["arrays"]).matrices,
                                                    mats, strict=True))
    return list(grid.send_and_receive(msgs))


@pytest.mark.parametrize("method", ["mpcdp", "mpddp"])
def test_the_real_clients_keep_both_bounds_on_a_crafted_w_hat(method: str, monkeypatch) -> None:
    """The mpcdp and mpddp clients (float32) on nine digits records, one of class 0 replaced by one of class 3.

    W-hat as :func:`_underflowing_side_terms` on 64 inputs, hidden 4, 10 classes (rho ``6e11``, clip ``1.7e-13``): the
    class-0 records' Psi and Phi are below float32's squares.  mpcdp uploads without noise: its gradient and the
    given-R recovery move by at most ``2 clip / B``; mpddp's gradient carries noise, so its unnoised side terms
    ``- r^T Psi + v Phi`` are checked (at most ``2 clip / B`` as well).  Measured with the squares formed at their own
    size: the given-R recovery moved by 14.4 (mpcdp) and the side terms by 14.8 (mpddp) times ``2 clip / B``.
    """
    mats, rho, clip = _underflowing_side_terms(torch.float32, n_in=64, n_out=10, hidden=4)
    data: list = []
    _patch_data(monkeypatch, data)
    pick, other, labels, ds = _nine_digits()
    uploads = []
    for rows in (pick, np.r_[other, pick[1:]]):
        data[:] = [(ds.x_train[rows], labels[rows], ds.num_classes, ds.input_shape)]
        replies = _real_replies(method, mats, clip)
        assert replies and not any(r.has_error() for r in replies), [r.error.reason for r in replies if r.has_error()]
        uploads.append(upload_from_record(replies[0].content["arrays"], 2))
    up, given_r = _ratios((uploads[0], uploads[1]), rho, 2 * clip / len(pick), torch.Generator().manual_seed(0),
                          side_only=method == "mpddp")
    assert given_r <= 1.0 + 1e-4, given_r
    if method == "mpcdp":
        assert up <= 1.0 + 1e-4, up


def test_a_mask_reference_float32_cannot_carry_computes_in_float64_and_one_float64_cannot_is_refused(monkeypatch) -> None:
    """The real mpcdp client (float32 side information) on a W-hat whose last matrix makes ``rho^2`` exceed float32's limit.

    Every record's Phi multiplier is at least ``rho^2`` (:func:`protocols.mpddp.gradients._multipliers`): in float32
    each one was dropped and the upload was a silent zero (measured: every gradient entry 0, clipped fraction 1).
    The client computes such a round in float64 and uploads the clipped gradient; a ``rho`` float64 cannot carry
    either is refused, with a reason that names it.
    """
    mats, rho, clip = _underflowing_side_terms(torch.float32, n_in=64, n_out=10, hidden=4)
    data: list = []
    _patch_data(monkeypatch, data)
    pick, _other, labels, ds = _nine_digits()
    data[:] = [(ds.x_train[pick], labels[pick], ds.num_classes, ds.input_shape)]
    wide = [*mats[:-1], mats[-1] * 1e3]
    assert not keeps_records(mask_reference(wide[-1]), clip, torch.float32)
    assert keeps_records(mask_reference(wide[-1]), clip, torch.float64)
    replies = _real_replies("mpcdp", wide, clip)
    assert replies and not any(r.has_error() for r in replies), [r.error.reason for r in replies if r.has_error()]
    for r in replies:
        up = upload_from_record(r.content["arrays"], 2)
        assert float(_flat(up.grads).abs().max()) > 0
        assert r.content["metrics"]["clipped_fraction"] == 1.0
    huge = [*mats[:-1], mats[-1] * 1e150]
    replies = _real_replies("mpcdp", huge, clip)
    assert replies and all(r.has_error() and "mask reference" in r.error.reason for r in replies)
