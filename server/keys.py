"""``cancelfl keys``: make node identities and the roster every client trusts.

    cancelfl keys gen --out DIR --node NAME [--node NAME ...]   # DIR/NAME.key (private, 0600) + DIR/NAME.pub
    cancelfl keys roster --out roster.json DIR/*.pub             # the roster, distributed out of band
    cancelfl keys fab-hash --app APP_DIR                         # the FAB hash a node pins (trusted-fab)

Each node keeps its ``NAME.key`` and the roster; its node config points at both
(``identity-key="/path/NAME.key" roster="/path/roster.json"``, see :mod:`client.identity`).
Only the ``.pub`` files travel to whoever builds the roster; the private key never leaves the node.
:func:`make_identities` does both steps for a set of nodes on one machine (``cancelfl deploy``, the
in-process engine, tests).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocols.identity import (
    Identity,
    IdentityError,
    generate_identity,
    public_identity_json,
    roster_from_public_files,
)
from protocols.private_files import write_private


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Sub-commands of ``cancelfl keys``."""
    sub = p.add_subparsers(dest="keys_command", required=True)
    gen = sub.add_parser("gen", help="make a node's Ed25519 identity: NAME.key (private) and NAME.pub")
    gen.add_argument("--out", required=True, help="folder for the key files")
    gen.add_argument("--node", action="append", required=True, help="node name (repeat for several nodes)")
    gen.add_argument("--force", action="store_true", help="overwrite existing key files")
    auth = sub.add_parser("auth", help="make a SuperNode's Flower authentication key: NAME.auth (private) and "
                          "NAME.auth-pub (register it with `flwr supernode register`)")
    auth.add_argument("--out", required=True, help="folder for the key files")
    auth.add_argument("--node", action="append", required=True, help="node name (repeat for several nodes)")
    auth.add_argument("--force", action="store_true", help="overwrite existing key files")
    ros = sub.add_parser("roster", help="build the roster from public identity files (NAME.pub)")
    ros.add_argument("--out", required=True, help="roster file to write (JSON)")
    ros.add_argument("pub", nargs="+", help="public identity files")
    fab = sub.add_parser("fab-hash", help="SHA-256 of the FAB `flwr run` builds of an app: what a node pins in its "
                         "node config 'trusted-fab'")
    fab.add_argument("--app", default=".", help="the app's folder (its pyproject.toml; default: the current one)")


def generate(folder: Path, name: str, *, force: bool = False, seed: int | None = None) -> tuple[Path, Path]:
    """Write ``folder/NAME.key`` (PKCS#8 PEM, mode 0600) and ``folder/NAME.pub``; returns both paths.

    ``seed``: derive the key from this seed and the name instead of the OS CSPRNG (the in-process engine only,
    where nothing separates the nodes from the server anyway: its runs then sample the same clients for the
    same run seed, the roster being the sample's only randomness).
    """
    identity = generate_identity(name) if seed is None else seeded_identity(seed, name)
    if "/" in name or name.startswith("."):
        raise IdentityError(f"node name {name!r} cannot be a file name")
    folder.mkdir(parents=True, exist_ok=True)
    key, pub = folder / f"{name}.key", folder / f"{name}.pub"
    if not force and (key.exists() or pub.exists()):
        raise IdentityError(f"{key} or {pub} exists already (use --force to replace the identity)")
    write_private(key, identity.private_pem())
    pub.write_text(public_identity_json(identity))
    return key, pub


def build_roster(out: Path, pub_files: list[Path]) -> Path:
    """Write the roster of the nodes whose public identity files are given."""
    roster = roster_from_public_files([p.read_text() for p in pub_files])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(roster.to_json())
    return out


def seeded_identity(seed: int, name: str) -> Identity:
    """An identity derived from ``seed`` and ``name`` (see :func:`generate`; anyone knowing both can sign as it)."""
    raw = hashlib.sha256(b"cancelfl/in-process-identity/v1" + int(seed).to_bytes(8, "big", signed=True)
                         + name.encode()).digest()
    return Identity(name, Ed25519PrivateKey.from_private_bytes(raw))


def node_name(index: int) -> str:
    """Roster name of node ``index`` of the nodes the launcher starts (in-process grid, ``cancelfl deploy``)."""
    return f"node-{int(index)}"


def make_identities(folder: Path, names: list[str], *, seed: int | None = None) -> tuple[dict[str, Path], Path]:
    """``keys gen`` for every name plus ``keys roster``: (name -> private key path, roster path).

    ``seed``: derive the keys from it (see :func:`generate`).
    """
    made = {name: generate(folder, name, force=True, seed=seed) for name in names}
    roster = build_roster(folder / "roster.json", [pub for _, pub in made.values()])
    return {name: key for name, (key, _) in made.items()}, roster


def run(args: argparse.Namespace) -> int:
    """Entry point of ``cancelfl keys``."""
    try:
        if args.keys_command == "gen":
            for name in args.node:
                key, pub = generate(Path(args.out), name, force=args.force)
                print(f"{name}: private key {key} (keep it on the node), public identity {pub}")
        elif args.keys_command == "auth":
            from server.node_auth import make_auth_keys

            for name, (private, public) in make_auth_keys(Path(args.out), args.node, force=args.force).items():
                print(f"{name}: SuperNode key {private} (--auth-supernode-private-key), public key {public}")
        elif args.keys_command == "fab-hash":
            from server.fab_pin import fab_hash

            print(fab_hash(Path(args.app)))
        else:
            out = build_roster(Path(args.out), [Path(p) for p in args.pub])
            print(f"roster with {len(args.pub)} node(s) written to {out}")
    except (IdentityError, OSError, ValueError) as err:
        print(f"cancelfl keys: {err}", file=sys.stderr)
        return 2
    return 0
