"""Executable stand-ins that ``cancelfl-supernode`` puts first on the ``PATH`` of the Flower processes it starts."""

from __future__ import annotations

from pathlib import Path


def write_executable(folder: Path, name: str, text: str) -> Path:
    """Write ``folder/name`` holding ``text`` (a script with its ``#!`` line) and make it executable; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    path.chmod(0o755)
    return path
