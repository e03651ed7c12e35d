"""Long-term Ed25519 node identities, the roster, signed key-epoch X25519 keys and the round's view digest.

* A node's identity is an Ed25519 key (``cancelfl keys gen``, PKCS#8 PEM named by node config); the
  :class:`Roster` (JSON ``{"format": "cancelfl-roster/v1", "nodes": {name: hex public key}}``, distributed out of
  band) is what every client trusts.
* Each key-epoch X25519 key is signed over :func:`key_statement` (run id, key epoch, roster name, Flower node id,
  key; domain-separated), so a signature cannot be replayed elsewhere; :func:`verify_key` raises
  :class:`IdentityError` naming an unknown, unsigned or wrongly signed node.  A server holding no roster
  identity cannot make a client use its own keys.
* :func:`roster_digest` hashes a roster; :func:`roster_round_seed` (roster digest, round number) is the round's
  public seed, from which its sample of roster names and its pairing graph follow
  (:func:`protocols.graphs.roster_round`); nothing the server chooses enters it.
* :func:`view_digest` hashes the round's view (run id, round, key epoch, graph rule and seed, sorted
  participants with their roster names, and the run's settings: :func:`settings_digest`), which clients bind into
  every pair seed (:mod:`client.pairwise_phase`).

Simulation only: :func:`derived_identity` and :class:`DerivedRoster` derive identities from the run's public seed,
so anyone knowing the run config can sign as any node; deployments use ``cancelfl keys`` and node config.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocols.keyagreement import _lp, _u64

if TYPE_CHECKING:
    from protocols.config import RunConfig

__all__ = [
    "PUBLIC_BYTES",
    "SIGNATURE_BYTES",
    "ROSTER_FORMAT",
    "IdentityError",
    "Identity",
    "Roster",
    "DerivedRoster",
    "generate_identity",
    "identity_from_pem",
    "derived_identity",
    "public_identity_json",
    "roster_from_public_files",
    "key_statement",
    "verify_key",
    "view_digest",
    "settings_digest",
    "roster_digest",
    "roster_round_seed",
]

PUBLIC_BYTES = 32
SIGNATURE_BYTES = 64
ROSTER_FORMAT = "cancelfl-roster/v1"
IDENTITY_FORMAT = "cancelfl-identity/v1"
_STATEMENT = b"cancelfl/key-statement/v1"
_VIEW = b"cancelfl/round-view/v1"
_ROSTER = b"cancelfl/roster/v1"
_ROSTER_ROUND = b"cancelfl/roster-round/v1"
_DERIVED = b"cancelfl/simulation-identity/v1"
_SETTINGS = b"cancelfl/run-settings/v1"
#: Run-config keys a node may see differently without changing anything a peer relies on (where it writes, reads
#: its data from, trains on; whether and how long the server waits): left out of :func:`settings_digest`.
LOCAL_KEYS = frozenset({"out-dir", "data-dir", "device", "resume", "round-timeout"})


class IdentityError(ValueError):
    """A node's key cannot be authenticated against the roster (the message names the node)."""


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclass(frozen=True)
class Identity:
    """A node's long-term signing key and its roster name."""

    name: str
    private: Ed25519PrivateKey

    @property
    def public_bytes(self) -> bytes:
        """The raw 32-byte Ed25519 public key (the roster entry)."""
        return _raw_public(self.private.public_key())

    def sign(self, message: bytes) -> bytes:
        """64-byte Ed25519 signature of ``message``."""
        return self.private.sign(message)

    def private_pem(self) -> bytes:
        """The private key as unencrypted PKCS#8 PEM (``cancelfl keys gen`` writes it with mode 0600)."""
        return self.private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption())

    def __repr__(self) -> str:  # never print the private key
        return f"Identity(name={self.name!r}, public={self.public_bytes.hex()})"


def generate_identity(name: str) -> Identity:
    """A fresh identity from the OS CSPRNG."""
    return Identity(_check_name(name), Ed25519PrivateKey.generate())


@functools.lru_cache(maxsize=4096)
def derived_identity(seed: int, name: str) -> Identity:
    """SIMULATION/TEST CONVENIENCE: an identity derived from the public run seed (anyone can recompute it).

    Kept per process (a handler looks up its own and its neighbours' entries several times per message).
    """
    raw = hashlib.sha256(_DERIVED + _u64(seed, "seed") + _lp(_check_name(name).encode())).digest()
    return Identity(name, Ed25519PrivateKey.from_private_bytes(raw))


def identity_from_pem(pem: bytes, roster: Mapping[str, bytes]) -> Identity:
    """Load a PEM private key and find its name in ``roster`` (IdentityError if it is not listed)."""
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as err:
        raise IdentityError(f"identity key is not an unencrypted PEM private key ({err})") from err
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"identity key must be Ed25519, got {type(key).__name__}")
    public = _raw_public(key.public_key())
    names = [n for n, pk in roster.items() if pk == public]
    if not names:
        raise IdentityError(f"this node's identity (public key {public.hex()}) is not in the roster")
    return Identity(names[0], key)


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name or len(name) > 256 or not name.isprintable():
        raise IdentityError(f"node name must be a non-empty printable string of at most 256 characters, got {name!r}")
    return name


def _public_from_hex(name: str, text: object) -> bytes:
    try:
        raw = bytes.fromhex(str(text))
        Ed25519PublicKey.from_public_bytes(raw)
    except ValueError as err:
        raise IdentityError(f"roster entry {name!r}: not a {PUBLIC_BYTES}-byte hex Ed25519 public key") from err
    return raw


class Roster(Mapping[str, bytes]):
    """Node name -> raw Ed25519 public key: the identities a client trusts (names and keys unique)."""

    def __init__(self, nodes: Mapping[str, bytes]) -> None:
        self._nodes = {_check_name(n): bytes(k) for n, k in nodes.items()}
        seen: dict[bytes, str] = {}
        for name, key in self._nodes.items():
            if len(key) != PUBLIC_BYTES:
                raise IdentityError(f"roster entry {name!r}: public key must be {PUBLIC_BYTES} bytes, got {len(key)}")
            if key in seen:
                raise IdentityError(f"roster lists one public key twice ({seen[key]!r} and {name!r})")
            seen[key] = name

    def __getitem__(self, name: str) -> bytes:
        return self._nodes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def digest(self) -> bytes:
        """:func:`roster_digest` of this roster (computed once)."""
        if getattr(self, "_digest", None) is None:
            self._digest = _digest_of(self)
        return self._digest

    def to_json(self) -> str:
        """The roster file's text (names sorted)."""
        nodes = {n: self._nodes[n].hex() for n in sorted(self._nodes)}
        return json.dumps({"format": ROSTER_FORMAT, "nodes": nodes}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Roster:
        """Parse a roster file (IdentityError on any malformed part)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise IdentityError(f"roster is not valid JSON ({err})") from err
        if not isinstance(data, dict) or data.get("format") != ROSTER_FORMAT or not isinstance(data.get("nodes"), dict):
            raise IdentityError(f"roster must be a JSON object with \"format\": \"{ROSTER_FORMAT}\" and a \"nodes\" object")
        if not data["nodes"]:
            raise IdentityError("roster lists no node")
        return cls({n: _public_from_hex(n, k) for n, k in data["nodes"].items()})

    @classmethod
    def load(cls, path: str | Path) -> Roster:
        """Read a roster file."""
        return cls.from_json(Path(path).read_text())


class DerivedRoster(Mapping[str, bytes]):
    """SIMULATION/TEST CONVENIENCE: the roster of :func:`derived_identity` nodes ``partition-<i>``, i < ``count``.

    Entries are computed on demand (a client verifies only its neighbours).
    """

    def __init__(self, seed: int, count: int) -> None:
        self.seed, self.count = int(seed), int(count)

    @staticmethod
    def name(partition: int) -> str:
        """Roster name of the derived identity of ``partition``."""
        return f"partition-{int(partition)}"

    def __getitem__(self, name: str) -> bytes:
        prefix, _, num = str(name).partition("-")
        if prefix != "partition" or not num.isdigit() or int(num) >= self.count or name != self.name(int(num)):
            raise KeyError(name)
        return derived_identity(self.seed, name).public_bytes

    def __iter__(self) -> Iterator[str]:
        return (self.name(i) for i in range(self.count))

    def __len__(self) -> int:
        return self.count

    def digest(self) -> bytes:
        """:func:`roster_digest` of this roster (computed once per seed and count in a process)."""
        return _derived_digest(self.seed, self.count)


@functools.lru_cache(maxsize=8)
def _derived_digest(seed: int, count: int) -> bytes:
    return _digest_of(DerivedRoster(seed, count))


def public_identity_json(identity: Identity) -> str:
    """The public identity file ``cancelfl keys gen`` writes next to the private key (input to ``keys roster``)."""
    return json.dumps({"format": IDENTITY_FORMAT, "name": identity.name, "public-key": identity.public_bytes.hex()},
                      indent=2) + "\n"


def roster_from_public_files(texts: Sequence[str]) -> Roster:
    """A roster from public identity files (IdentityError on a malformed file or a duplicate name)."""
    nodes: dict[str, bytes] = {}
    for text in texts:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise IdentityError(f"public identity file is not valid JSON ({err})") from err
        if not isinstance(data, dict) or data.get("format") != IDENTITY_FORMAT:
            raise IdentityError(f"public identity file must have \"format\": \"{IDENTITY_FORMAT}\"")
        name = _check_name(data.get("name"))
        if name in nodes:
            raise IdentityError(f"two public identity files name node {name!r}")
        nodes[name] = _public_from_hex(name, data.get("public-key"))
    return Roster(nodes)


def key_statement(*, run_id: int, key_epoch: int, name: str, node_id: int, x25519_public: bytes) -> bytes:
    """The bytes a node signs for its key-epoch X25519 key (injective, domain-separated encoding)."""
    return (_STATEMENT + _u64(run_id, "run_id") + _u64(key_epoch, "key_epoch") + _lp(_check_name(name).encode())
            + _u64(node_id, "node_id") + _lp(bytes(x25519_public)))


def verify_key(roster: Mapping[str, bytes], *, name: str, signature: bytes | None, run_id: int, key_epoch: int,
               node_id: int, x25519_public: bytes) -> None:
    """Check ``signature`` by roster identity ``name`` over a peer's X25519 key; IdentityError naming the node."""
    who = f"node {node_id} ({name!r})" if name else f"node {node_id}"
    if not name:
        raise IdentityError(f"{who}: its X25519 key comes without a roster name (unsigned key)")
    try:
        identity = roster[name]
    except KeyError:
        raise IdentityError(f"{who}: unknown node, not in the roster") from None
    if not signature:
        raise IdentityError(f"{who}: its X25519 key is unsigned")
    statement = key_statement(run_id=run_id, key_epoch=key_epoch, name=name, node_id=node_id,
                              x25519_public=x25519_public)
    if not signature_valid(bytes(identity), bytes(signature), statement):
        raise IdentityError(f"{who}: wrong signature on its X25519 key of key epoch {key_epoch} "
                            "(not signed by the roster identity for this run, epoch and node id)")


@functools.lru_cache(maxsize=4096)
def signature_valid(identity: bytes, signature: bytes, statement: bytes) -> bool:
    """Whether ``signature`` is ``identity``'s Ed25519 signature over ``statement`` (memoised per process).

    Verification is a function of its three inputs, so its result is kept: a peer's key of a key epoch is signed
    once and shown every round, and a long-lived client process (simulation, in-process) checks it once.
    """
    if len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(identity).verify(signature, statement)
    except InvalidSignature:
        return False
    return True


def _digest_of(roster: Mapping[str, bytes]) -> bytes:
    names = sorted(roster)
    h = hashlib.sha256(_ROSTER + _u64(len(names), "count"))
    for name in names:
        h.update(_lp(name.encode()) + _lp(bytes(roster[name])))
    return h.digest()


def roster_digest(roster: Mapping[str, bytes]) -> bytes:
    """SHA-256 of a roster: its sorted names with their Ed25519 public keys (cached by :class:`Roster`)."""
    digest = getattr(roster, "digest", None)
    return digest() if callable(digest) else _digest_of(roster)


def roster_round_seed(digest: bytes, round_num: int) -> bytes:
    """The round's public seed: SHA-256 of the roster digest and the round number (the graph seed).

    Not a server choice: with a seed it could influence (a participant list, a run id, a key epoch) a
    server could retry until a target's n-out neighbours are nodes it controls.  Every client recomputes
    it from the roster it trusts and refuses another (:func:`client.pairwise_phase.check_view`).  Each round
    number is used once per run (the client ledger refuses a repeat).
    """
    if len(digest) != 32:
        raise ValueError(f"roster digest must be 32 bytes, got {len(digest)}")
    return hashlib.sha256(_ROSTER_ROUND + bytes(digest) + _u64(round_num, "round_num")).digest()


def settings_digest(cfg: RunConfig) -> bytes:
    """SHA-256 of the run's settings as this node holds them.

    Every run-config key but :data:`LOCAL_KEYS`, and the options of the run's method (not those of other
    installed methods).

    A client's floor assumes that its neighbours calibrate their noise from the same settings (epsilon, rounds,
    clip, ``niss-tau``, ``niss-rho``, ...): a server that sent them others (a larger epsilon: less noise hiding
    the negated shares they hold of this client's noise) would strip noise this client's ledger charges.  Bound
    into the view (:func:`view_digest`), other settings leave a node pair keys no peer of the run derives.
    """
    from protocols.methods import method_spec  # on use: the registry imports the run config

    own = {cfg.key_of(f.name): getattr(cfg, f.name) for f in fields(cfg) if f.name not in ("options", "regime_applied")}
    for cls in method_spec(cfg.method).options:
        own.update(cfg.options_of(cls).as_mapping())
    shown = {k: v for k, v in own.items() if k not in LOCAL_KEYS}
    return hashlib.sha256(_SETTINGS + json.dumps(shown, sort_keys=True, default=repr).encode()).digest()


def view_digest(*, run_id: int, round_num: int, key_epoch: int, graph: str, n_out: int, graph_seed: bytes,
                participants: Sequence[int], names: Sequence[str] = (), settings: bytes = b"") -> bytes:
    """SHA-256 of the round's view: what two clients must agree on for their pair seeds to match.

    ``names``: the participants' roster names, in the order of ``participants`` (empty: none); ``settings``:
    :func:`settings_digest` of the node's run config (empty: none).
    """
    h = hashlib.sha256(_VIEW + _u64(run_id, "run_id") + _u64(round_num, "round_num") + _u64(key_epoch, "key_epoch")
                       + _lp(graph.encode()) + _u64(n_out, "n_out") + _lp(bytes(graph_seed)) + _lp(bytes(settings)))
    if names and len(names) != len(participants):
        raise ValueError(f"{len(participants)} participants but {len(names)} names")
    rows = sorted(zip((int(p) for p in participants), names or [""] * len(participants), strict=True))
    h.update(_u64(len(rows), "count"))
    for p, name in rows:
        h.update(_u64(p, "participant") + _lp(name.encode()))
    return h.digest()
