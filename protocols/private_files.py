"""Private key files: written readable by their owner only, whatever was at the path before."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_private"]


def write_private(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` with mode 0600, atomically replacing any file there; returns ``path``.

    The bytes go to a new file that is renamed over ``path``: an earlier file's wider mode, its hard links and
    its open readers never see them.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
