"""A node's long-term identity and the roster it trusts (from its node config); signing and checking keys.

Node config (``flower-supernode --node-config 'identity-key="/keys/node-0.key" roster="/keys/roster.json"'``):
``identity-key`` is the node's Ed25519 private key (``cancelfl keys gen``), ``roster`` the roster file
(``cancelfl keys roster``, distributed out of band; the node's name is the entry holding its public key), and
``require-identity = true`` refuses to run without them (recommended for real deployments).

Without them (Flower's simulation cannot give a node files) the node uses identities derived from the run-config
``seed`` (:func:`protocols.identity.derived_identity`, names ``partition-<i>``): anyone who knows the run config,
the server included, can sign for them, so they authenticate nothing against a malicious server; a warning says so
once per run and machine (:func:`first_notice_of_run`); a node whose policy asks for a guarantee refuses to pair
with them (:func:`authenticating_identity`).  ``cancelfl deploy`` and docker-compose give every node an identity
from the OS CSPRNG; the in-process engine writes identity files whose keys derive from the run seed (server and
clients share one process there).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from logging import WARNING
from pathlib import Path

from flwr.common import log

from client.env import ClientEnv
from protocols.config import ConfigError
from protocols.floor import FloorPolicy
from protocols.identity import (
    DerivedRoster,
    Identity,
    IdentityError,
    Roster,
    derived_identity,
    identity_from_pem,
    key_statement,
    verify_key,
)
from protocols.node_config import IDENTITY_KEY
from protocols.node_config import REQUIRE_IDENTITY as REQUIRE_KEY
from protocols.node_config import ROSTER as ROSTER_KEY
from protocols.wire.keys import PeerKeys

#: Read-only cache of parsed identity files, by (paths, modification times): files, not secrets of a run.
_LOADED: dict[tuple, NodeIdentity] = {}
_WARNED: set[int] = set()  # run ids this process has warned about


@dataclass(frozen=True)
class NodeIdentity:
    """The node's identity and the roster it trusts; ``derived`` marks the simulation convenience."""

    identity: Identity
    roster: Mapping[str, bytes]
    derived: bool = False

    @property
    def name(self) -> str:
        """The node's roster name."""
        return self.identity.name


def node_identity(env: ClientEnv) -> NodeIdentity:
    """The node's identity from its node config (or the derived simulation identity; see the module doc)."""
    nc = env.context.node_config
    key_path, roster_path = nc.get(IDENTITY_KEY), nc.get(ROSTER_KEY)
    if key_path and roster_path:
        return _load(str(key_path), str(roster_path))
    if key_path or roster_path:
        raise ConfigError(f"node config sets only one of '{IDENTITY_KEY}' and '{ROSTER_KEY}'; a node needs both "
                          "(make them with `cancelfl keys gen` and `cancelfl keys roster`)")
    if str(nc.get(REQUIRE_KEY, "false")).lower() in ("true", "1", "yes"):
        raise ConfigError(f"node config sets '{REQUIRE_KEY}' but no '{IDENTITY_KEY}'/'{ROSTER_KEY}' "
                          "(make them with `cancelfl keys gen` and `cancelfl keys roster`)")
    run_id = int(env.context.run_id)
    if run_id not in _WARNED:
        _WARNED.add(run_id)
        if first_notice_of_run("simulation-identity", run_id):
            log(WARNING, "nodes without identity-key/roster in their node config (node %s, and likely the others) use "
                "SIMULATION identities derived from the public run seed, which authenticate nothing against a "
                "malicious server (said once per run)", env.partition_id)
    seed = int(env.cfg.seed)
    name = DerivedRoster.name(env.partition_id)
    return NodeIdentity(derived_identity(seed, name), DerivedRoster(seed, env.num_partitions), derived=True)


def first_notice_of_run(topic: str, run_id: int) -> bool:
    """True the first time any process on this machine asks for ``(topic, run_id)``; False afterwards.

    A marker file under the temp folder (per user), created exclusively; where it cannot be written the
    answer is True (a notice said twice rather than never).
    """
    folder = Path(tempfile.gettempdir()) / f"cancelfl-notices-{os.getuid() if hasattr(os, 'getuid') else 0}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        os.close(os.open(folder / f"{topic}-{run_id}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def _load(key_path: str, roster_path: str) -> NodeIdentity:
    try:
        stamp = (key_path, roster_path, os.stat(key_path).st_mtime_ns, os.stat(roster_path).st_mtime_ns)
        if stamp not in _LOADED:
            roster = Roster.load(roster_path)
            with open(key_path, "rb") as f:
                _LOADED[stamp] = NodeIdentity(identity_from_pem(f.read(), roster), roster)
        return _LOADED[stamp]
    except OSError as err:
        raise ConfigError(f"cannot read the node identity ({err}); node config '{IDENTITY_KEY}' = {key_path!r}, "
                          f"'{ROSTER_KEY}' = {roster_path!r}") from err


def sign_key(env: ClientEnv, key_epoch: int, x25519_public: bytes) -> tuple[str, bytes]:
    """(roster name, signature) of this node over its X25519 key of ``key_epoch`` in this run."""
    me = node_identity(env)
    statement = key_statement(run_id=int(env.context.run_id), key_epoch=key_epoch, name=me.name,
                              node_id=env.node_id, x25519_public=x25519_public)
    return me.name, me.identity.sign(statement)


def authenticating_identity(env: ClientEnv) -> NodeIdentity:
    """The node's identity where peers' identities protect its noise (pair keys, pushes a server must not forge).

    Refuses (:class:`protocols.floor.FloorViolation`, :meth:`protocols.floor.FloorPolicy.check_identity`) a
    simulation identity when the node's policy asks for a guarantee.
    """
    me = node_identity(env)
    FloorPolicy.from_node_config(env.context.node_config).check_identity(derived=me.derived)
    return me


def verify_peers(env: ClientEnv, pk: PeerKeys, indices: Sequence[int]) -> None:
    """Authenticate the peers at ``indices`` of ``pk`` against the roster (IdentityError naming the node).

    Also refuses a peer that claims this node's own name, and two peers under one name (one identity
    cannot hold two node ids of a round), and simulation identities as :func:`authenticating_identity` does.
    """
    me = authenticating_identity(env)
    names = [pk.name_of(i) for i in range(len(pk.peer_ids))]
    for i in indices:
        node, name = pk.peer_ids[i], names[i]
        verify_key(me.roster, name=name, signature=pk.signature_of(i), run_id=int(env.context.run_id),
                   key_epoch=pk.key_epoch, node_id=node, x25519_public=pk.peer_keys[i])
        if name == me.name:
            raise IdentityError(f"node {node} ({name!r}): presents this node's own identity")
        if names.count(name) > 1:
            others = [pk.peer_ids[j] for j, n in enumerate(names) if n == name]
            raise IdentityError(f"nodes {others} all claim roster identity {name!r}")
