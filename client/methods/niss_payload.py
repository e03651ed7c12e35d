"""The plaintext of a NISS payload: one neighbour's share bundle, as a seed or as its negated share vectors."""

from __future__ import annotations

import math
import struct

import numpy as np

from protocols import niss as niss_math
from protocols.wire.common import ViewError

__all__ = ["decode_payload", "encode_payload"]

_MAGIC = b"NISS\x01"
_HEADER = struct.Struct(">cId")  # encoding, count, share_std
_SIZE = struct.Struct(">I")
_ENC_BYTE = {"seed": b"S", "vector": b"V"}


def encode_payload(encoding: str, bundle: niss_math.ShareBundle, size: int) -> bytes:
    """Plaintext of one payload.

    Format (big-endian header)::

        b"NISS" | version u8 = 1 | encoding u8 (b"S" or b"V") | count u32 | share_std f64 |
        seed:   32-byte bundle seed            (both sides expand the shares with protocols.prg)
        vector: size u32 | count*size float64  (little-endian: the negated shares r = -n)

    The sealing's associated data binds (sender, receiver, round, run id, joint-view scale, encoding)
    (:func:`client.methods.niss._aad`; the relay key binds the view and sizes): the relaying server can neither read,
    alter, replay (from another round, run or request) nor redirect a payload unnoticed.  Each neighbour pair
    exchanges exactly one payload per direction holding ``SHARES_PER_NEIGHBOUR`` share(s), so a dropped payload is
    detected and all payloads of a round have the same length.
    """
    head = _MAGIC + _HEADER.pack(_ENC_BYTE[encoding], bundle.count, bundle.share_std)
    if encoding == "seed":
        return head + bundle.seed
    negated = -niss_math.bundle_shares(bundle, size) if bundle.count else np.zeros((0, size))
    return head + _SIZE.pack(size) + np.ascontiguousarray(negated, dtype="<f8").tobytes()


def decode_payload(plain: bytes, encoding: str, sender: int, receiver: int,
                   size: int) -> tuple[niss_math.ShareBundle, np.ndarray | None]:
    """Parse an opened payload: the bundle and, for ``vector``, the negated shares ``(count, size)``."""
    n_head = len(_MAGIC) + _HEADER.size
    if len(plain) < n_head or plain[:len(_MAGIC)] != _MAGIC:
        raise ViewError("not a NISS v1 payload")
    enc, count, std = _HEADER.unpack_from(plain, len(_MAGIC))
    if enc != _ENC_BYTE[encoding]:
        raise ViewError(f"payload encoding {enc!r} does not match run-config {encoding!r}")
    if count != niss_math.SHARES_PER_NEIGHBOUR:
        raise ViewError(f"payload holds {count} shares, the protocol sends {niss_math.SHARES_PER_NEIGHBOUR}")
    if not (math.isfinite(std) and std >= 0):
        raise ViewError(f"implausible payload header (share_std={std})")
    body = plain[n_head:]
    if encoding == "seed":
        if len(body) != 32:
            raise ViewError(f"seed payload body has {len(body)} bytes, expected 32")
        return niss_math.ShareBundle(sender, receiver, count, std, body), None
    if len(body) < _SIZE.size or _SIZE.unpack_from(body)[0] != size or len(body) != _SIZE.size + 8 * count * size:
        raise ViewError(f"vector payload does not hold {count} shares of size {size}")
    vectors = np.frombuffer(body, dtype="<f8", offset=_SIZE.size).reshape(count, size).astype(np.float64)
    if not np.all(np.isfinite(vectors)):
        raise ViewError("vector payload contains non-finite values")
    return niss_math.ShareBundle(sender, receiver, count, std, bytes(32)), vectors
