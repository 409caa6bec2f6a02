"""Durable file operations: the one atomic replace of a file (``write_atomically``), writes
that are fsynced before they return, directory fsync, sha256 of a file, removal of a file or
folder."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
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


def write_synced(path: Path, write: Callable[[IO[bytes]], object], *, mode: int = 0o666) -> None:
    """Create ``path`` (with ``mode``, less the umask: readable by no one else for a moment
    either), fill it with ``write`` and fsync it."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())


def write_json_synced(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON to ``path`` and fsync it."""
    blob = (json.dumps(data, indent=2) + "\n").encode("utf-8")
    write_synced(path, lambda fh: fh.write(blob))


def write_atomically(path: Path, data: str | bytes, *, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` (text as UTF-8) so that readers see the old or the new
    file, whole, and the new one survives a crash once this returns: a temporary file of its
    own beside ``path`` (so concurrent writers never share one), fsynced, renamed over ``path``,
    then the folder fsynced. ``mode``: the file's permissions (default: as ``open`` makes
    them). A failed write leaves ``path`` as it was and no temporary file."""
    blob = data.encode("utf-8") if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        write_synced(tmp, lambda fh: fh.write(blob), mode=0o666 if mode is None else mode)
        if mode is not None:
            os.chmod(tmp, mode)  # exactly, whatever the umask
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


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
