"""Test helper: DDP-SA run-config credentials (a CA certificate and a parameter-server key).

For strategies whose intermediate servers are never reached.
"""

from __future__ import annotations

from pathlib import Path

from protocols.tls import CertificateAuthority
from server.keys import generate


def ddpsa_credentials(folder: Path) -> dict[str, str]:
    """Run-config ``ddpsa-ca`` and ``ddpsa-server-key`` pointing at fresh files in ``folder``."""
    key, _ = generate(folder, "parameter-server", force=True)
    return {"ddpsa-ca": str(CertificateAuthority("unreached").write(folder)), "ddpsa-server-key": str(key)}
