"""Finding runs: the ``agent.json`` every run writes into its run directory, and the
``supervisor.json`` of a supervised one. Which of them to scrape, and which runs are dead."""

from __future__ import annotations

import functools
import hashlib
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from lossguard.common.rundir.agent_file import AgentInfo
from lossguard.common.rundir.names import AGENT_FILE, SUPERVISOR_FILE
from lossguard.common.rundir.supervisor_file import SupervisorInfo
from lossguard.monitor.sources.liveness import DeadRun, dead_run

log = logging.getLogger(__name__)

SUPERVISOR_JOB = "lossguard-supervisor"
"""The ``job`` label of a supervisor's series (its exporter is a target of its own)."""


@dataclass(frozen=True)
class DiscoveredTarget:
    """One rank's metrics endpoint of a run."""

    url: str
    run_id: str
    rank: int
    socket_path: Path | None
    run_dir: Path


@dataclass(frozen=True)
class SupervisorTarget:
    """The exporter of a run's live supervisor."""

    url: str
    run_id: str
    run_dir: Path


@dataclass(frozen=True)
class Discovery:
    """What one look at the runs directory found."""

    agents: list[DiscoveredTarget]  # the ranks of runs alive or on another host, newest first
    supervisors: list[SupervisorTarget]
    dead: list[DeadRun]  # runs whose process died here, less those forgotten


@dataclass(frozen=True)
class _Run:
    info: AgentInfo
    run_dir: Path
    targets: list[DiscoveredTarget]


def discover_agents(runs_root: Path) -> list[DiscoveredTarget]:
    """The targets of the runs under ``runs_root`` that did not end on purpose, the most
    recently started run first (where two ``agent.json`` name one run, the newer counts). Two
    runs may name one URL (a killed run's port reused by a new run): each is its own target.

    An ``agent.json`` that cannot be read is skipped, with one warning per content.
    """
    return [target for run in _runs(runs_root) for target in run.targets]


def discover(runs_root: Path, *, now: float, forget_after_s: float) -> Discovery:
    """The runs under ``runs_root`` as the scraper sees them: the ranks to scrape, the live
    supervisors' exporters, and the runs whose process is known dead on this host (the newest
    ``agent.json`` of a run decides). A dead run is forgotten ``forget_after_s`` after its
    last sign of life (at ``now``)."""
    hostname = socket.gethostname()
    agents: list[DiscoveredTarget] = []
    dead: list[DeadRun] = []
    seen: set[str] = set()
    for run in _runs(runs_root):
        if run.info.run_id in seen:
            continue
        seen.add(run.info.run_id)
        gone = dead_run(run.info, run.run_dir, hostname)
        if gone is None:
            agents.extend(run.targets)
        elif now - gone.last_seen <= forget_after_s:
            dead.append(gone)
        else:
            _note_forgotten(gone.run_dir, gone.last_seen, forget_after_s)
    return Discovery(agents, _supervisors(runs_root, hostname), dead)


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


def _runs(runs_root: Path) -> list[_Run]:
    """Every readable ``agent.json`` of a run that did not end on purpose, newest first."""
    runs: list[_Run] = []
    for path in sorted(runs_root.glob(f"*/{AGENT_FILE}")):
        try:
            data = path.read_bytes()
        except OSError:
            continue  # removed or replaced while listing
        try:
            run = _parse(path.parent, data)
        except ValueError as exc:
            _warn_skipped(path, hashlib.sha256(data).hexdigest(), str(exc))
            continue
        if not run.info.ended_cleanly:
            runs.append(run)
    runs.sort(key=lambda run: -run.info.started_at)
    return runs


def _parse(run_dir: Path, data: bytes) -> _Run:
    """One ``agent.json``; ValueError names what is wrong."""
    info = AgentInfo.parse(data)
    for url in info.metrics_urls:
        instance_of(url)
    socket_path = Path(info.socket) if info.socket else None
    targets = [
        DiscoveredTarget(url, info.run_id, rank, socket_path, run_dir)
        for rank, url in enumerate(info.metrics_urls)
    ]
    return _Run(info, run_dir, targets)


def _supervisors(runs_root: Path, hostname: str) -> list[SupervisorTarget]:
    """The exporters of the supervisors that run: alive on this host, or on another host and
    not ``exited``."""
    found = []
    for path in sorted(runs_root.glob(f"*/{SUPERVISOR_FILE}")):
        info = SupervisorInfo.read(path.parent)
        if info is None or not isinstance(info.metrics_url, str) or not info.metrics_url:
            continue
        alive = info.alive_here(hostname)
        if alive is False or (alive is None and info.state == "exited"):
            continue
        try:
            instance_of(info.metrics_url)
        except ValueError as exc:
            _warn_skipped(path, info.metrics_url, str(exc))
            continue
        found.append(SupervisorTarget(info.metrics_url, info.run_id, path.parent))
    return found


@functools.lru_cache(maxsize=1024)
def _warn_skipped(path: Path, digest: str, reason: str) -> None:
    """Log once per file and content (``digest``): discovery runs every scrape cycle."""
    log.warning("skipping %s: %s", path, reason)


@functools.lru_cache(maxsize=1024)
def _note_forgotten(run_dir: Path, last_seen: float, forget_after_s: float) -> None:
    """Log once per dead run that it is no longer watched."""
    log.info(
        "%s: its process died over %g s ago (scrape.forget_dead_runs_after): no longer watched",
        run_dir,
        forget_after_s,
    )
