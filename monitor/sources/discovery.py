"""Finding agents: the ``agent.json`` every run writes into its run directory."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger(__name__)

ENDED_CLEANLY = ("completed", "stopped")
"""``exit`` values of runs that ended on purpose: their targets are dropped. A run that failed,
or never wrote ``exit`` (killed), stays a target, so that "agent down" can fire."""


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
    started run first (so that where two runs name one URL, the newer wins).

    An ``agent.json`` that cannot be read is skipped, with one warning per content.
    """
    runs: list[tuple[float, list[DiscoveredTarget]]] = []
    for path in sorted(runs_root.glob("*/agent.json")):
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
    """``(started_at, targets)`` of one ``agent.json``; ValueError names what is wrong."""
    try:
        info = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(info, dict):
        raise ValueError("not a JSON object")
    run_id = _field(info, "run_id", str)
    urls = _field(info, "metrics_urls", list)
    if not all(isinstance(url, str) for url in urls):
        raise ValueError("metrics_urls: expected a list of URLs")
    for url in urls:
        instance_of(url)
    socket = info.get("socket")
    if socket is not None and not isinstance(socket, str):
        raise ValueError("socket: expected a path or null")
    started_at = info.get("started_at", 0.0)
    if not isinstance(started_at, int | float):
        raise ValueError("started_at: expected a number")
    if info.get("exit") in ENDED_CLEANLY:
        return started_at, []
    socket_path = Path(socket) if socket else None
    targets = [
        DiscoveredTarget(url, run_id, rank, socket_path, run_dir) for rank, url in enumerate(urls)
    ]
    return started_at, targets


def _field(info: dict[str, Any], name: str, kind: type) -> Any:
    value = info.get(name)
    if not isinstance(value, kind):
        raise ValueError(f"{name}: expected a {kind.__name__}, got {json.dumps(value)}")
    return value


@functools.lru_cache(maxsize=1024)
def _warn_skipped(path: Path, digest: str, reason: str) -> None:
    """Log once per file and content (``digest``): discovery runs every scrape cycle."""
    log.warning("skipping %s: %s", path, reason)
