"""Process checks shared by the tests that start servers and clusters (is a process really gone)."""

from __future__ import annotations

import os
from pathlib import Path


def pid_gone(pid: int) -> bool:
    """True if ``pid`` has exited (an exited, not yet reaped zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True
