"""Flower's SuperNode authentication, as the launcher and the compose deployment use it.

With TLS the SuperLink runs with ``--enable-supernode-auth``: it accepts only SuperNodes whose public key was
registered (``flwr supernode register``) and that prove holding the private key (``--auth-supernode-private-key``)
on every request.  Without it, anyone who reaches the SuperLink's port joins the federation as a new SuperNode
(it gets train messages, and a run that samples it waits for or trains on it).  Flower refuses node
authentication without TLS, so a plain-HTTP deployment has none.

Keys are ECDSA P-384 in OpenSSH format (what Flower 1.42 reads), one pair per SuperNode, the private one written
0600 (:func:`protocols.private_files.write_private`).
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from protocols.private_files import write_private

__all__ = ["SUPERLINK_FLAG", "make_auth_keys", "node_flag", "register_supernodes"]

#: ``flower-superlink`` flag that turns node authentication on (needs TLS).
SUPERLINK_FLAG = "--enable-supernode-auth"


def make_auth_keys(folder: Path, names: Sequence[str], *, force: bool = True) -> dict[str, tuple[Path, Path]]:
    """One fresh P-384 key pair per name: ``<folder>/<name>.auth`` (private, 0600) and ``<name>.auth-pub``.

    The public file is one OpenSSH line (``ecdsa-sha2-nistp384 ...``, newline-terminated as ``ssh-keygen`` writes it).

    Returns name -> (private key file, public key file).

    Raises:
        FileExistsError: a key file exists and ``force`` is false.
        ValueError: a name that is not a plain file name.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:  # every name checked before any key is written: all or nothing
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"node name {name!r} cannot be a file name")
        if not force and any((folder / f"{name}{ext}").exists() for ext in (".auth", ".auth-pub")):
            raise FileExistsError(f"{folder / name}.auth exists already (use --force to replace it)")
    out: dict[str, tuple[Path, Path]] = {}
    for name in names:
        key = ec.generate_private_key(ec.SECP384R1())
        private = write_private(folder / f"{name}.auth", key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
        public = folder / f"{name}.auth-pub"
        public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                         serialization.PublicFormat.OpenSSH) + b"\n")
        out[name] = (private, public)
    return out


def node_flag(private_key: Path) -> list[str]:
    """The SuperNode's arguments that authenticate it with ``private_key``."""
    return ["--auth-supernode-private-key", str(private_key)]


def register_supernodes(flwr: Path, env: Mapping[str, str], connection: str, public_keys: Mapping[str, Path],
                        *, timeout: float = 120.0) -> None:
    """Register every public key with the SuperLink of ``connection`` (``flwr supernode register``), all at once.

    ``flwr``: the ``flwr`` command; ``env``: its environment (``FLWR_HOME`` holding ``connection``).

    Raises:
        RuntimeError: a registration failed (naming the node and Flower's output), or ``flwr`` could not be run.
    """
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for name, pub in public_keys.items():
            procs[name] = subprocess.Popen([str(flwr), "supernode", "register", str(pub), connection, "--name", name],
                                           env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as err:  # e.g. no flwr command: the registrations already started are stopped, not left behind
        for proc in procs.values():
            proc.kill()
            proc.communicate()
        raise RuntimeError(f"cannot run `{flwr} supernode register`: {err}") from err
    failed = []
    for name, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        if proc.returncode != 0:
            failed.append(f"{name}: {out.strip()[-400:]}")
    if failed:
        raise RuntimeError("cannot register the SuperNodes' authentication keys with the SuperLink:\n"
                           + "\n".join(failed))
