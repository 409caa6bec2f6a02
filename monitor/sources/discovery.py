"""Finding agents: the ``agent.json`` every run writes into its run directory."""

from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from lossguard.common.agent_file import AGENT_FILE, AgentInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiscoveredTarget:
    """One rank's metrics endpoint of a run."""

    url: str
    run_id: str
    rank: int
    socket_path: Path | None
    run_dir: Path


def discover_agents(runs_root: Path) -> list[DiscoveredTarget]:
    """The targets of the runs under ``runs_root`` still worth scraping, the most recently
    started run first (where two ``agent.json`` name one run, the newer counts). Two runs may
    name one URL (a killed run's port reused by a new run): each is its own target.

    An ``agent.json`` that cannot be read is skipped, with one warning per content.
    """
    runs: list[tuple[float, list[DiscoveredTarget]]] = []
    for path in sorted(runs_root.glob(f"*/{AGENT_FILE}")):
        try:
            data = path.read_bytes()
        except OSError:
            continue  # removed or replaced while listing
        try:
            started_at, targets = _parse(path.parent, data)
        except ValueError as exc:
            _warn_skipped(path, hashlib.sha256(data).hexdigest(), str(exc))
            continue
        runs.append((started_at, targets))
    runs.sort(key=lambda run: -run[0])
    return [target for _, targets in runs for target in targets]


def instance_of(url: str) -> str:
    """Prometheus's ``instance`` label for a metrics URL: host and port (the scheme's default
    port when the URL names none)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # not a number, or out of range
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise ValueError(f"{redact_url(url)!r} is not an http(s) URL")
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}"


def redact_url(url: str) -> str:
    """``url`` without the password of its basic-auth credentials, fit for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host_and_port = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host_and_port}"))


def _parse(run_dir: Path, data: bytes) -> tuple[float, list[DiscoveredTarget]]:
    """``(started_at, targets)`` of one ``agent.json``; ValueError names what is wrong.

    A run that ended on purpose has no targets; one that failed, or never wrote ``exit``
    (killed), stays a target, so that "agent down" can fire."""
    info = AgentInfo.parse(data)
    for url in info.metrics_urls:
        instance_of(url)
    if info.ended_cleanly:
        return info.started_at, []
    socket_path = Path(info.socket) if info.socket else None
    targets = [
        DiscoveredTarget(url, info.run_id, rank, socket_path, run_dir)
        for rank, url in enumerate(info.metrics_urls)
    ]
    return info.started_at, targets


@functools.lru_cache(maxsize=1024)
def _warn_skipped(path: Path, digest: str, reason: str) -> None:
    """Log once per file and content (``digest``): discovery runs every scrape cycle."""
    log.warning("skipping %s: %s", path, reason)
