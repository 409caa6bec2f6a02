"""Prometheus ``file_sd`` targets from the monitor's discovery: every rank of every live run
(``job`` = ``scrape.job``, with ``run_id`` and ``rank``) and every live supervisor (``job`` =
``lossguard-supervisor``, with ``run_id``), written atomically to ``scrape.file_sd_path``
whenever what discovery finds changes. Runs whose process died on this host are left out (the
monitor reports them as ``lossguard_run_exited_timestamp_seconds``), as the scraper does.

A Prometheus ``file_sd_configs`` entry on that file (with ``honor_labels: true``, see
``deploy/prometheus.yml``) then scrapes exactly what the monitor scrapes.

The other way round, :func:`read_file_sd` takes the targets of the file_sd files a job writes
(``scrape.file_sd_files``, deploy/slurm/) as the scraper's, as Prometheus reads them."""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from lossguard.common.rundir.files import write_atomically
from lossguard.monitor.sources.discovery import SUPERVISOR_JOB, Discovery, discover, instance_of

log = logging.getLogger(__name__)

AGENT_JOB = "lossguard-agent"


def _entry(url: str, labels: dict[str, str]) -> dict[str, Any]:
    """One target group; a path other than /metrics and https go into Prometheus's
    ``__metrics_path__`` and ``__scheme__`` labels."""
    parts = urlsplit(url)
    labels = dict(labels)
    if parts.path and parts.path != "/metrics":
        labels["__metrics_path__"] = parts.path
    if parts.scheme == "https":
        labels["__scheme__"] = "https"
    return {"targets": [instance_of(url)], "labels": labels}


def file_sd_groups(found: Discovery, *, job: str = AGENT_JOB) -> list[dict[str, Any]]:
    """The ``file_sd`` target groups of one discovery: one per rank of a run (the newest run's,
    where two name the same run and rank) and one per supervisor, in a stable order."""
    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
    for agent in found.agents:
        key = (job, agent.run_id, str(agent.rank))
        if key not in groups:
            labels = {"job": job, "run_id": agent.run_id, "rank": str(agent.rank)}
            groups[key] = _entry(agent.url, labels)
    for supervisor in found.supervisors:
        key = (SUPERVISOR_JOB, supervisor.run_id, "")
        groups[key] = _entry(supervisor.url, {"job": SUPERVISOR_JOB, "run_id": supervisor.run_id})
    return [groups[key] for key in sorted(groups)]


def read_file_sd(patterns: Iterable[str]) -> list[str]:
    """The metrics URLs of every target group in the files matching ``patterns`` (globs), in
    file order: ``http://HOST:PORT/metrics``, or the group's ``__scheme__`` and
    ``__metrics_path__``. A file that cannot be read or is not file_sd JSON is skipped, with
    one warning per file and content."""
    urls: list[str] = []
    for path in sorted({p for pattern in patterns for p in glob.glob(pattern)}):
        try:
            data = Path(path).read_bytes()
        except OSError:
            continue  # removed while listing: its job ended
        try:
            urls += _urls(json.loads(data))
        except (ValueError, TypeError, KeyError) as exc:
            _warn_unreadable(path, hashlib.sha256(data).hexdigest(), str(exc))
    return list(dict.fromkeys(urls))


def _urls(groups: Any) -> list[str]:
    """The URLs of file_sd target groups; ValueError names what is not file_sd."""
    if not isinstance(groups, list):
        raise ValueError("not a list of target groups")
    urls = []
    for group in groups:
        labels = group.get("labels") or {}
        targets = group["targets"]
        if not isinstance(targets, list) or not isinstance(labels, dict):
            raise ValueError("a group's targets must be a list and its labels a mapping")
        scheme = labels.get("__scheme__", "http")
        path = labels.get("__metrics_path__", "/metrics")
        for target in targets:
            url = f"{scheme}://{target}{path}"
            instance_of(url)  # ValueError: not HOST:PORT
            urls.append(url)
    return urls


@functools.lru_cache(maxsize=1024)
def _warn_unreadable(path: str, digest: str, reason: str) -> None:
    log.warning("file_sd: skipping %s: %s", path, reason)


class FileSdWriter:
    """Looks at ``runs_root`` every ``interval_s`` and rewrites ``path`` when the targets
    changed (and once at start, so the file exists even with no runs: ``[]``)."""

    def __init__(
        self,
        path: Path,
        runs_root: Path,
        *,
        interval_s: float,
        forget_dead_after_s: float,
        job: str = AGENT_JOB,
    ) -> None:
        self.path = path
        self.runs_root = runs_root
        self.interval_s = interval_s
        self.forget_dead_after_s = forget_dead_after_s
        self.job = job
        self._written: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def write_once(self, now: float | None = None) -> bool:
        """One look; True when the file was (re)written."""
        t = time.time() if now is None else now
        found = discover(self.runs_root, now=t, forget_after_s=self.forget_dead_after_s)
        text = json.dumps(file_sd_groups(found, job=self.job), indent=2, sort_keys=True) + "\n"
        if text == self._written and self.path.exists():
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, text, mode=0o644)  # Prometheus may run as another user
        self._written = text
        log.info("file_sd: %d targets written to %s", text.count('"targets"'), self.path)
        return True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="file-sd", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.write_once()
            except Exception:  # the daemon outlives any one look
                log.exception("file_sd: writing %s failed", self.path)
            self._stop.wait(self.interval_s)
