"""Certificates for TLS between cancelfl processes: a private CA and server certificates it signs.

One home for certificate making (``cryptography``, P-256 ECDSA): ``cancelfl deploy --tls`` makes the
SuperLink's, :mod:`server.intermediate.launcher` the DDP-SA intermediate servers' (a throwaway CA for
loopback runs).  Docker deployments make theirs with ``docker/certs/make_certs.sh`` (openssl), the same
layout: ``ca.crt`` for every party that connects, ``<name>.pem`` + ``<name>.key`` for one server.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from protocols.private_files import write_private

__all__ = ["CertificateAuthority", "ServerCertificate"]

#: Names a loopback server certificate is valid for.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1")


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


@dataclass(frozen=True)
class ServerCertificate:
    """A server's certificate and private key, PEM-encoded."""

    cert_pem: bytes
    key_pem: bytes

    def write(self, folder: Path, name: str) -> dict[str, Path]:
        """Write ``<name>.pem`` and ``<name>.key`` (mode 0600) to ``folder``; returns their paths."""
        folder.mkdir(parents=True, exist_ok=True)
        cert, key = folder / f"{name}.pem", folder / f"{name}.key"
        cert.write_bytes(self.cert_pem)
        write_private(key, self.key_pem)
        return {"cert": cert, "key": key}


class CertificateAuthority:
    """A self-signed CA (in memory) that issues server certificates."""

    def __init__(self, common_name: str = "cancelfl-ca", *, days: int = 30) -> None:
        self.days = days
        now = datetime.datetime.now(datetime.UTC)
        self._key = ec.generate_private_key(ec.SECP256R1())
        self.cert = (
            x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(self._key, hashes.SHA256())
        )

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate (give it to every party that connects)."""
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def write(self, folder: Path) -> Path:
        """Write ``ca.crt`` to ``folder`` (the CA key never leaves memory); returns its path."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "ca.crt"
        path.write_bytes(self.cert_pem)
        return path

    def issue(self, common_name: str, hosts: Sequence[str] = LOOPBACK_HOSTS) -> ServerCertificate:
        """A server certificate for ``hosts`` (DNS names or IP literals), signed by this CA."""
        if not hosts:
            raise ValueError("a server certificate needs at least one host name")
        now = datetime.datetime.now(datetime.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(self.cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=self.days))
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in dict.fromkeys(hosts)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return ServerCertificate(cert.public_bytes(serialization.Encoding.PEM), key_pem)
