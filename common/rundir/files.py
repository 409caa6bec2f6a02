"""Durable file operations: writes that are fsynced before they return, directory fsync,
sha256 of a file, removal of a file or folder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_synced(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Create ``path``, fill it with ``write`` and fsync it."""
    with open(path, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())


def write_json_synced(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON to ``path`` and fsync it."""
    blob = (json.dumps(data, indent=2) + "\n").encode("utf-8")
    write_synced(path, lambda fh: fh.write(blob))


def fsync_dir(path: Path) -> None:
    """Fsync a folder, making the renames and creations in it durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Remove a file, link or folder tree, ignoring what is already gone."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
