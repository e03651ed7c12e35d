"""Who may do what on a DDP-SA intermediate server: signed statements checked against the roster.

Every request but ``Health`` carries an Ed25519 signature over a canonical *statement* (built here,
the one place both ends build them):

* ``PushShare`` -- signed by the client it names (a roster client identity), over the run id, the
  round, the client's name, the SHA-256 of the share and the client's terms (the
  :func:`participants_digest` of the participants it was shown, the fewest clients its share may be summed
  with): nobody can push under another's name or change its terms, and a captured push cannot be replayed
  into another run or round.  ``CheckShare`` (a push's pre-flight) likewise, over the same fields but the share's
  length for its bytes.
* ``RegisterRun``, ``GetPartialSum``, ``AbortRound``, ``Status`` -- signed by the parameter server's
  identity (its public identity file, kept apart from the clients' roster so that the server can never
  pass for a client): only the ServerApp opens runs and reads partial sums.

Statements are domain-separated and length-prefixed, so no two different requests share a statement.
The transport is TLS with the deployment's CA (:mod:`protocols.wire.intermediate.stub`), which keeps the
requests, and therefore their signatures, away from eavesdroppers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocols.identity import SIGNATURE_BYTES, Identity, Roster, roster_from_public_files

__all__ = [
    "AccessPolicy",
    "Signer",
    "load_server_identity",
    "load_signer",
    "participants_digest",
    "verify_signature",
    "abort_statement",
    "check_statement",
    "partial_sum_statement",
    "push_statement",
    "register_statement",
    "status_statement",
]

_DOMAIN = b"cancelfl/ddpsa-intermediate/v2"

#: A signing identity: a roster name plus its private key (:class:`protocols.identity.Identity`).
Signer = Identity


def _statement(kind: str, *fields: str | int | bytes) -> bytes:
    out = [_DOMAIN, kind.encode()]
    for f in fields:
        if isinstance(f, str):
            data = b"s" + f.encode()
        elif isinstance(f, int):
            data = b"i" + str(f).encode()
        else:
            data = b"b" + bytes(f)
        out.append(data)
    return b"".join(len(p).to_bytes(4, "big") + p for p in out)


def participants_digest(participants: Sequence[str]) -> bytes:
    """SHA-256 of a round's participants (order-free): what a push binds and a registration is compared with."""
    return hashlib.sha256(_statement("participants", *sorted(participants))).digest()


def push_statement(run_id: str, round_num: int, client: str, share: bytes, participants: bytes = b"",
                   min_summed: int = 0) -> bytes:
    """What a client signs to push ``share`` (wire bytes) for ``(run_id, round_num)`` under its name.

    ``participants``: the :func:`participants_digest` of the participants it was shown (empty: none);
    ``min_summed``: the fewest clients a partial sum holding the share may cover (0: no terms).
    """
    return _statement("push", run_id, int(round_num), client, len(share), hashlib.sha256(share).digest(),
                      bytes(participants), int(min_summed))


def check_statement(run_id: str, round_num: int, client: str, length: int, participants: bytes = b"",
                    min_summed: int = 0) -> bytes:
    """What a client signs to ask whether its push of ``length`` ring elements would be taken.

    :func:`push_statement`'s fields, the share's length in place of its bytes.
    """
    return _statement("check", run_id, int(round_num), client, int(length), bytes(participants), int(min_summed))


def register_statement(run_id: str, round_num: int, length: int, max_clients: int, prime_field: bool,
                       participants: Sequence[str]) -> bytes:
    """What the parameter server signs to open round ``round_num`` of run ``run_id``.

    Binds the share length, the client cap, the share field (Shamir's Z_p or the ring) and the round's
    participants (order-free).
    """
    return _statement("register", run_id, int(round_num), int(length), int(max_clients), int(bool(prime_field)),
                      *sorted(participants))


def partial_sum_statement(run_id: str, round_num: int, clients: Sequence[str]) -> bytes:
    """What the parameter server signs to read the partial sum over ``clients`` (order-free)."""
    return _statement("sum", run_id, int(round_num), *sorted(clients))


def abort_statement(run_id: str, round_num: int) -> bytes:
    """What the parameter server signs to seal a round without releasing it."""
    return _statement("abort", run_id, int(round_num))


def status_statement(nonce: str) -> bytes:
    """What the parameter server signs to read a server's status."""
    return _statement("status", nonce)


def verify_signature(public: bytes, signature: bytes, statement: bytes) -> bool:
    """True when ``signature`` is the Ed25519 signature of ``statement`` by raw public key ``public``."""
    if len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes(public)).verify(bytes(signature), statement)
    except (InvalidSignature, ValueError):
        return False
    return True


def load_server_identity(path: str | Path) -> bytes:
    """The raw public key in a public identity file (``cancelfl keys gen`` writes ``<name>.pub.json``)."""
    (key,) = roster_from_public_files([Path(path).read_text()]).values()
    return key


def load_signer(path: str | Path, name: str = "parameter-server") -> Identity:
    """The parameter server's signing identity from its private key file (``cancelfl keys gen`` writes it).

    Raises:
        ValueError: if the file is not an unencrypted PEM Ed25519 private key (OSError if unreadable).
    """
    if not str(path):
        raise ValueError("no identity key file given")
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path}: identity key must be Ed25519, got {type(key).__name__}")
    return Identity(name, key)


@dataclass(frozen=True)
class AccessPolicy:
    """The identities an intermediate server trusts: roster clients may push, the parameter server reads.

    ``clients`` maps a roster name to its raw 32-byte Ed25519 public key; ``server`` is the raw public
    key of the parameter server's identity.
    """

    clients: Mapping[str, bytes]
    server: bytes

    @classmethod
    def load(cls, roster: str | Path, server_identity: str | Path) -> AccessPolicy:
        """Read the clients' roster file and the parameter server's public identity file."""
        return cls(Roster.load(roster), load_server_identity(server_identity))

    def client_may_push(self, client: str, signature: bytes, statement: bytes) -> bool:
        """True when ``client`` is a roster client and ``signature`` is its signature of ``statement``."""
        key = self.clients.get(client)
        return key is not None and verify_signature(key, signature, statement)

    def is_server(self, signature: bytes, statement: bytes) -> bool:
        """True when ``signature`` is the parameter server's signature of ``statement``."""
        return verify_signature(self.server, signature, statement)
