"""Double masking of the pairwise-noise uploads (SecAgg+'s rule, Bell et al. 2020, applied to DP noise).

Each masked upload carries, on top of its DP and pair noise, a self-mask ``b_i = N(0, std^2)`` expanded
(:func:`protocols.prg.gaussian`) from a fresh per-round OS-CSPRNG seed ``s_i``.  ``s_i`` is Shamir-shared t-of-n
among the client's neighbours (:func:`protocols.secret_sharing.shamir_split`), each share sealed
(:func:`protocols.relay_crypto.seal`) under a pair key only that neighbour derives (purpose :data:`SHARE_PURPOSE`).
After the uploads each surviving neighbour reveals, per peer ``x``, either its share of ``s_x`` (``x``'s upload
received) or its pair material with ``x`` (dropped or excluded), never both; the server rebuilds ``s_x`` from any
``t_x`` shares and subtracts ``b_x`` exactly.  A server that holds ``k``'s upload and claims "k dropped" gets
k's pair material but no share of ``s_k``, so ``b_k`` stays in the upload.

:func:`mask_threshold`: ``t = min(d, floor((d + c) / 2) + 1)`` for degree ``d`` and ``c = ceil(corruption * d)``
colluders (``t > c`` and ``2t > d + c`` whenever ``d > c``); :attr:`MaskParameters.p_unrecoverable` is the chance
of fewer than ``t`` survivors.  A server that splits the neighbours' views (``t`` told "k received", the others
"k dropped") is stopped by the signed consistency check (:mod:`protocols.consistency`): pair material for a
dropped ``k`` needs :func:`signatures_needed` signatures of one outcome from ``k``'s neighbours.  Threat model:
``docs/robustness.md``.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from protocols.dropouts import binom_tail
from protocols.prg import gaussian, gaussian_many
from protocols.relay_crypto import make_aad, open_sealed, seal
from protocols.secret_sharing import shamir_combine, shamir_split

__all__ = ["SHARE_PURPOSE", "MaskParameters", "commitment", "mask_parameters", "mask_threshold", "new_mask_seed",
           "open_share", "rebuild_seed", "seal_shares", "self_mask", "signature_count", "signatures_needed",
           "unmaskable"]

#: Purpose of the pair key that seals a self-mask share (:func:`protocols.keyagreement.derive_pair_seed`).
SHARE_PURPOSE = "self-mask-share"
_AAD_CONTEXT = b"cancelfl/self-mask-share/v1"


def assumed_colluders(degree: int, corruption: float) -> int:
    """``c = ceil(corruption * degree)``: the colluders assumed among ``degree`` neighbours."""
    return math.ceil(corruption * degree - 1e-12)


def mask_threshold(degree: int, corruption: float) -> int:
    """Shares needed to rebuild a self-mask seed of a client with ``degree`` neighbours (see the module doc)."""
    if degree < 1:
        raise ValueError(f"a masked client needs at least one neighbour, got degree {degree}")
    if not 0.0 <= corruption < 1.0:
        raise ValueError(f"corruption rate must be in [0, 1), got {corruption}")
    return min(degree, (degree + assumed_colluders(degree, corruption)) // 2 + 1)


def signatures_needed(degree: int, roster_degree: int, corruption: float) -> int:
    """Signed outcomes from a dropped node's neighbours needed before its pair material is revealed.

    ``s = d + c - t + 1`` for its ``degree`` present neighbours, its threshold ``t = mask_threshold(degree)`` and
    ``c = ceil(corruption * roster_degree)`` colluders assumed among its roster neighbours (all may be present):
    then ``t + s > d + c``, so no split of the neighbours' views yields both ``t`` self-mask shares and ``s``
    signatures (:mod:`protocols.consistency`).  ``s <= d`` (honest recovery possible) whenever ``t > c``, which
    :func:`protocols.graphs.present_floor` makes every client require of its own present neighbourhood.
    """
    c = assumed_colluders(max(roster_degree, degree), corruption)
    return degree + c - mask_threshold(degree, corruption) + 1


def signature_count(neighbours: Sequence[int], roster_degree: int, corruption: float,
                    signed: Callable[[int], bool]) -> tuple[int, int]:
    """``(have, need)``: signed outcomes of a node not aggregated, from its present ``neighbours``, against the need.

    ``need``: :func:`signatures_needed` of ``len(neighbours)``; ``have``: the neighbours ``signed`` accepts (the node
    holding the pair material accepts itself), counted in order until ``need`` (each asked at most once).  Pair
    material of the node goes out only when ``have >= need``: the client's rule before it reveals
    (:func:`client.recovery.unsigned`) and the server's prediction of that refusal (``PairwiseRecovery.doomed``).
    """
    need = signatures_needed(len(neighbours), roster_degree, corruption)
    have = 0
    for n in neighbours:
        if have >= need:
            break
        have += bool(signed(n))
    return have, need


@dataclass(frozen=True)
class MaskParameters:
    """Degree, threshold and the two failure probabilities of Bell et al. for one neighbourhood."""

    degree: int
    threshold: int
    dropout: float
    corruption: float
    #: P[at least t of the neighbours collude] (they could rebuild the seed without the server's lie).
    p_exposed: float
    #: P[fewer than t neighbours survive] (the client's upload cannot be unmasked; the round fails).
    p_unrecoverable: float
    #: signed outcomes from the neighbours before a neighbour reveals pair material of the node (dropped).
    signatures: int = 0

    def describe(self) -> str:
        """One line for the start of a run."""
        return (f"self-mask: degree {self.degree}, threshold t = {self.threshold} "
                f"(tolerates {self.degree - self.threshold} dropped neighbours; its pair seeds need {self.signatures} "
                f"signed outcomes, t + s > d + c); at dropout {self.dropout:g} and "
                f"corruption {self.corruption:g}: P[>= t colluding neighbours] = {self.p_exposed:.2e}, "
                f"P[< t surviving neighbours] = {self.p_unrecoverable:.2e}" + self._warning())

    @property
    def colluders_rebuild(self) -> bool:
        """The assumed colluding neighbours (``c``) reach the threshold: they alone rebuild the self-mask."""
        return self.threshold <= assumed_colluders(self.degree, self.corruption)

    def _warning(self) -> str:
        if not self.colluders_rebuild:
            return ""
        c = assumed_colluders(self.degree, self.corruption)
        return (f"; with {self.degree} neighbour(s) t <= c = {c} assumed colluders: they alone rebuild the self-mask "
                "and no pair seed is ever revealed for a dropped neighbour (run-config 'mask-corruption-rate' = 0, "
                "or more neighbours per client)")


def mask_parameters(degree: int, dropout: float, corruption: float) -> MaskParameters:
    """The threshold of ``degree`` and its failure probabilities at the assumed rates (independent nodes)."""
    t = mask_threshold(degree, corruption)
    return MaskParameters(degree, t, dropout, corruption, binom_tail(degree, corruption, t),
                          binom_tail(degree, dropout, degree - t + 1), signatures_needed(degree, degree, corruption))


def new_mask_seed() -> bytes:
    """A fresh self-mask seed from the OS CSPRNG."""
    return os.urandom(32)


def commitment(seed: bytes) -> bytes:
    """SHA-256 commitment to a self-mask seed (sent with the upload; lets the server check a rebuilt seed)."""
    return hashlib.sha256(b"cancelfl/self-mask-commitment/v1" + bytes(seed)).digest()


def self_mask(seed: bytes, size: int, std: float) -> np.ndarray:
    """The self-mask vector ``b = N(0, std^2)^size`` of ``seed`` (both ends expand the same bits)."""
    return gaussian(seed, size, std)


def self_masks(masks: Sequence[tuple[bytes, float]], size: int | Sequence[int]) -> Iterable[np.ndarray]:
    """:func:`self_mask` of each ``(seed, std)``, in order and bit-identical, the PRG streams expanded together.

    ``size``: one length for every mask, or one per mask.
    """
    return gaussian_many([seed for seed, _ in masks], size, [std for _, std in masks])


def _aad(sender: int, receiver: int, round_num: int, context: bytes) -> bytes:
    return make_aad(sender=sender, receiver=receiver, round_num=round_num, context=_AAD_CONTEXT + bytes(context))


def seal_shares(seed: bytes, keys: Mapping[int, bytes], threshold: int, *, sender: int, round_num: int,
                context: bytes = b"") -> dict[int, bytes]:
    """Shamir-share ``seed`` t-of-n among the peers of ``keys`` (peer -> sealing key) and seal each share.

    Returns peer -> sealed share (bound to sender, receiver, round and ``context``).
    """
    peers = sorted(keys)
    shares = shamir_split(seed, len(peers), threshold)
    return {p: seal(keys[p], sh, aad=_aad(sender, p, round_num, context)) for p, sh in zip(peers, shares, strict=True)}


def open_share(key: bytes, blob: bytes, *, sender: int, receiver: int, round_num: int, context: bytes = b"") -> bytes:
    """The share ``sender`` sealed for ``receiver`` (:class:`protocols.relay_crypto.RelayAuthError` if tampered)."""
    return open_sealed(key, blob, aad=_aad(sender, receiver, round_num, context))


def rebuild_seed(shares: Sequence[bytes], threshold: int, expected: bytes) -> bytes | None:
    """The seed whose :func:`commitment` is ``expected`` from ``shares`` (None with fewer than ``threshold``).

    Tries the first ``threshold`` shares (any ``threshold`` honest shares suffice), then all of them, then the
    first subsets of size ``threshold`` (a neighbour may have sent a bad share).
    """
    if len(shares) < threshold:
        return None
    first = tuple(shares[:max(threshold, 1)])
    # The first combination is ``first`` itself, tried already: 256 subsets in all.
    rest = itertools.islice(itertools.combinations(shares, threshold), 1 if threshold >= 1 else 0, 256)
    candidates = itertools.chain([first, tuple(shares)], rest)
    for subset in candidates:
        try:
            seed = shamir_combine(subset)
        except ValueError:
            continue
        if commitment(seed) == expected:
            return seed
    return None


def unmaskable(neighbours: Mapping[int, Iterable[int]], candidates: Iterable[int],
               thresholds: Mapping[int, int]) -> set[int]:
    """The ``candidates`` that can be aggregated: at least ``t`` of their neighbours are aggregated too.

    A client reveals its pair seeds with every neighbour that is not aggregated, so it answers only when
    at least ``t`` are (:func:`client.recovery.answer_masked`).  Leaving out a short node may leave a
    neighbour of it short: repeated until stable.
    """
    keep = set(candidates)
    while True:
        short = {n for n in keep if len(keep & set(neighbours.get(n, ()))) < thresholds[n]}
        if not short:
            return keep
        keep -= short
