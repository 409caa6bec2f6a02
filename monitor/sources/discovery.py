"""Finding runs: the ``agent.json`` every run writes into its run directory, and the
``supervisor.json`` of a supervised one. Which of them to scrape, and which runs are dead.

Only files the monitor can believe count (:mod:`lossguard.common.ownership`): owned, with their
run directory, by the monitor's user, root or a user of ``scrape.trusted_owners``, and writable
by no one else. The control socket is always the run directory's own ``control.sock``; rank 0's
metrics URL must name the host the run announces. Where two files name one run, the one whose
process lives on this host wins (else the newest), with a warning."""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import logging
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from lossguard.common.ownership import distrust_file, trusted_owners
from lossguard.common.rundir.agent_file import AgentInfo
from lossguard.common.rundir.names import AGENT_FILE, SOCKET_NAME, SUPERVISOR_FILE
from lossguard.common.rundir.paths import RunPaths
from lossguard.common.rundir.supervisor_file import SupervisorInfo, pid_alive
from lossguard.monitor.sources.liveness import AnsweredAt, DeadRun, dead_run, never_answered

log = logging.getLogger(__name__)

SUPERVISOR_JOB = "lossguard-supervisor"
"""The ``job`` label of a supervisor's series (its exporter is a target of its own)."""
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})

_owners = trusted_owners()


def distrusted(path: Path) -> str | None:
    """Why the run file ``path`` (or its directory) is not believed; None: it is."""
    return distrust_file(path, _owners)


def trust_owners(allowed: Iterable[int]) -> None:
    """Believe the run files of the users ``allowed`` too (``scrape.trusted_owners``), besides
    the monitor's own user and root: set once, at start."""
    global _owners
    _owners = trusted_owners(allowed)


@dataclass(frozen=True)
class DiscoveredTarget:
    """One rank's metrics endpoint of a run."""

    url: str
    run_id: str
    rank: int
    socket_path: Path | None
    run_dir: Path
    host: str | None = None  # the host and pid agent.json names
    pid: int | None = None


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


def discover(
    runs_root: Path,
    *,
    now: float,
    forget_after_s: float,
    answered_at: AnsweredAt = never_answered,
) -> Discovery:
    """The runs under ``runs_root`` as the scraper sees them: the ranks to scrape, the live
    supervisors' exporters, and the runs whose process is known dead (the newest
    ``agent.json`` of a run decides; ``answered_at``: when the scraper last reached a remote
    run's rank 0). A dead run is forgotten ``forget_after_s`` after its last sign of life (at
    ``now``)."""
    hostname = socket.gethostname()
    agents: list[DiscoveredTarget] = []
    dead: list[DeadRun] = []
    seen: set[str] = set()
    for run in _runs(runs_root):
        if run.info.run_id in seen:
            continue
        seen.add(run.info.run_id)
        gone = dead_run(run.info, run.run_dir, hostname, answered_at, now)
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


def announced_runs(runs_root: Path) -> list[_Run]:
    """One believable ``agent.json`` per run under ``runs_root`` (ended runs too), newest
    first. A file skipped is warned about once per content and reason."""
    found: dict[str, list[_Run]] = {}
    for path in sorted(runs_root.glob(f"*/{AGENT_FILE}")):
        why = distrusted(path)
        if why is not None:
            _warn_skipped(path, "", why)
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue  # removed or replaced while listing
        try:
            run = _parse(path.parent, data)
        except ValueError as exc:
            _warn_skipped(path, hashlib.sha256(data).hexdigest(), str(exc))
            continue
        found.setdefault(run.info.run_id, []).append(run)
    hostname = socket.gethostname()
    chosen = []
    for run_id, runs in found.items():
        runs.sort(key=lambda run: (_lives_here(run.info, hostname), run.info.started_at))
        chosen.append(runs[-1])
        if len(runs) > 1:
            _warn_duplicate(run_id, tuple(str(r.run_dir) for r in runs), str(runs[-1].run_dir))
    return sorted(chosen, key=lambda run: -run.info.started_at)


def _runs(runs_root: Path) -> list[_Run]:
    """The announced runs that did not end on purpose, newest first."""
    return [run for run in announced_runs(runs_root) if not run.info.ended_cleanly]


def _lives_here(info: AgentInfo, hostname: str) -> bool:
    return info.pid is not None and info.hostname == hostname and pid_alive(info.pid)


def _parse(run_dir: Path, data: bytes) -> _Run:
    """One ``agent.json``; ValueError names what is wrong."""
    info = AgentInfo.parse(data)
    for url in info.metrics_urls:
        instance_of(url)
    if info.metrics_urls and not _on_host(info.metrics_urls[0], info.hostname):
        raise ValueError(
            f"rank 0's metrics URL {redact_url(info.metrics_urls[0])!r} is not on the host "
            f"the run announces ({info.hostname!r})"
        )
    if info.socket is not None and Path(info.socket).name != SOCKET_NAME:
        raise ValueError(f"socket: {info.socket!r} is not the run directory's {SOCKET_NAME}")
    socket_path = RunPaths.of(run_dir).socket if info.socket else None
    targets = [
        DiscoveredTarget(url, info.run_id, rank, socket_path, run_dir, info.hostname, info.pid)
        for rank, url in enumerate(info.metrics_urls)
    ]
    return _Run(info, run_dir, targets)


def _on_host(url: str, hostname: str | None) -> bool:
    """Whether ``url`` names the host ``hostname`` (or this machine's loopback, or an address
    the agent was bound to)."""
    host = (urlsplit(url).hostname or "").lower()
    if host in LOOPBACK_HOSTS or host == (hostname or "").lower():
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _supervisors(runs_root: Path, hostname: str) -> list[SupervisorTarget]:
    """The exporters of the supervisors that run: alive on this host, or on another host and
    not ``exited``."""
    found = []
    for path in sorted(runs_root.glob(f"*/{SUPERVISOR_FILE}")):
        why = distrusted(path)
        if why is not None:
            _warn_skipped(path, "", why)
            continue
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
def _warn_duplicate(run_id: str, run_dirs: tuple[str, ...], chosen: str) -> None:
    """Log once per set of run directories that name one run."""
    log.warning(
        "run %r is announced by %d agent.json files (%s): watching %s, whose process lives "
        "here or started last",
        run_id,
        len(run_dirs),
        ", ".join(run_dirs),
        chosen,
    )


@functools.lru_cache(maxsize=1024)
def _note_forgotten(run_dir: Path, last_seen: float, forget_after_s: float) -> None:
    """Log once per dead run that it is no longer watched."""
    log.info(
        "%s: its process died over %g s ago (scrape.forget_dead_runs_after): no longer watched",
        run_dir,
        forget_after_s,
    )
