"""The run directory: resolved config, environment record and the metrics log."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import IO, Any

import yaml

from . import __version__

RECORDED_PACKAGES = ("torch", "torchao", "numpy", "pydantic", "prometheus-client", "nvidia-ml-py")


def git_commit(cwd: Path | None = None) -> str | None:
    """The commit checked out in ``cwd`` (default: the working directory), if any."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in RECORDED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see the old or the new file, whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class RunDirectory:
    """``runs/<run_id>/``: written by rank 0 only."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._metrics: IO[str] | None = None

    def write_config(self, resolved: Mapping[str, Any]) -> None:
        text = yaml.safe_dump(dict(resolved), sort_keys=False)
        write_atomically(self.path / "config.yaml", text)

    def write_env(self, device: Mapping[str, Any], world_size: int) -> None:
        env = {
            "lossguard": __version__,
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "hostname": socket.gethostname(),
            "packages": package_versions(),
            "device": dict(device),
            "world_size": world_size,
            "git_commit": git_commit(),
            "argv": sys.argv,
        }
        write_atomically(self.path / "env.json", json.dumps(env, indent=2) + "\n")

    def append_metrics(self, record: Mapping[str, Any]) -> None:
        """One JSON line per record, flushed so a crash loses at most the current line."""
        if self._metrics is None:
            self._metrics = open(self.path / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self._metrics.write(json.dumps(record, allow_nan=True) + "\n")
        self._metrics.flush()

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
