"""The run directory: resolved config, environment record, ``agent.json``, the metrics log and
the audit trail."""

from __future__ import annotations

import itertools
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from lossguard.common import __version__
from lossguard.common.config import ConfigError
from lossguard.common.ownership import PRIVATE_DIR, claim_directory
from lossguard.common.rundir.agent_file import AgentInfo, RunExit
from lossguard.common.rundir.files import fsync_dir, write_atomically
from lossguard.common.rundir.jsonl import JsonlLog, read_jsonl
from lossguard.common.rundir.names import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    ENV_FILE,
    EVENTS_LOG,
    METRICS_LOG,
)
from lossguard.common.rundir.paths import RunPaths

RECORDED_PACKAGES = ("torch", "torchao", "numpy", "pydantic", "prometheus-client", "nvidia-ml-py")
RUN_RECORDS = (CHECKPOINT_DIR, METRICS_LOG, EVENTS_LOG, CONFIG_FILE, ENV_FILE)
"""What a run leaves in its directory, beside ``agent.json`` (rewritten by the next run)."""


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


def set_aside(path: Path) -> Path | None:
    """Move the previous run's records (``RUN_RECORDS``) out of the run directory ``path`` into
    a new ``path/overwritten-<local time>/`` and return that folder; None when there was nothing
    to move. Nothing is deleted."""
    present = [path / name for name in RUN_RECORDS if (path / name).exists()]
    if not present:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path / f"overwritten-{stamp}"
    for n in itertools.count(2):
        try:
            aside.mkdir()
            break
        except FileExistsError:
            aside = path / f"overwritten-{stamp}-{n}"
    for record in present:
        os.rename(record, aside / record.name)
    fsync_dir(path)
    return aside


class RunDirectory:
    """``runs/<run_id>/``: written by rank 0 only. Private by default: the directory is 0700
    and the records written in it 0600 (``mode``: another directory mode, say 0750 to let a
    group read, whose files are then 0640). A directory another user owns, or that others may
    write, is refused (ConfigError naming it): its files would be theirs to forge."""

    def __init__(self, path: Path, mode: int | None = None) -> None:
        """``mode``: the directory's mode (None: 0700 when created, an existing one kept)."""
        self.path = Path(path)
        self.paths = RunPaths(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            claim_directory(self.path, mode)
        except ValueError as exc:
            raise ConfigError(f"run.dir: {exc}") from None
        self.dir_mode = PRIVATE_DIR if mode is None else mode
        """The mode of the folders a run writes (checkpoints)."""
        self.file_mode = self.dir_mode & 0o666
        self.metrics = JsonlLog(self.paths.metrics, self.file_mode)
        self.events = JsonlLog(self.paths.events, self.file_mode)

    def read_events(self) -> list[dict[str, Any]]:
        """The audit trail so far; a line torn by a crash is left out."""
        return list(read_jsonl(self.paths.events).records)

    def write_config(self, resolved: Mapping[str, Any]) -> None:
        text = yaml.safe_dump(dict(resolved), sort_keys=False)
        write_atomically(self.paths.config, text, mode=self.file_mode)

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
        write_atomically(self.paths.env, json.dumps(env, indent=2) + "\n", mode=self.file_mode)

    def write_discovery(
        self,
        *,
        run_id: str,
        socket_path: Path | None,
        metrics_urls: list[str],
        world_size: int,
    ) -> None:
        """``agent.json``: how a monitor finds this run and its ranks' exporters."""
        info = AgentInfo(
            run_id=run_id,
            metrics_urls=tuple(metrics_urls),
            socket=str(socket_path) if socket_path is not None else None,
            started_at=time.time(),
            pid=os.getpid(),
            hostname=socket.gethostname(),
            world_size=world_size,
            version=__version__,
        )
        write_atomically(self.paths.agent, info.to_json(), mode=self.file_mode)

    def mark_finished(self, exit: RunExit) -> None:
        """Record in ``agent.json`` how the run ended (completed, stopped or failed), so a
        monitor stops watching a run that ended on purpose and keeps watching one that did not."""
        path = self.paths.agent
        if not path.exists():
            return
        info = AgentInfo.parse(path.read_bytes()).finished(exit, at=time.time())
        write_atomically(path, info.to_json(), mode=self.file_mode)

    def close(self) -> None:
        self.metrics.close()
        self.events.close()
