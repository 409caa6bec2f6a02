"""What the monitor knows of each run, for its HTTP API: the run's ``agent.json`` (where its
directory is, whether its process lives), its scrape targets, its latest numbers from the
source, its alerts and its supervisor's ``supervisor.json``."""

from __future__ import annotations

import dataclasses
import logging
import math
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lossguard.common.catalogue import STEP, exposed_name
from lossguard.common.control.address import join_address
from lossguard.common.rundir.agent_file import AgentInfo
from lossguard.common.rundir.supervisor_file import RESTARTING, SupervisorInfo, pid_alive
from lossguard.monitor.alert_store import AlertStore
from lossguard.monitor.notify.model import RUN_LABEL
from lossguard.monitor.promql import PromQLError
from lossguard.monitor.promql.model import label_value
from lossguard.monitor.sources import Source, SourceError, TargetStatus
from lossguard.monitor.sources.announced import AnnouncedRun, AnnouncedRuns
from lossguard.monitor.sources.discovery import announced_runs
from lossguard.monitor.views import active_alerts

log = logging.getLogger("lossguard.monitor")

RUN_METRICS = {
    "step": STEP,
    "last_step_time": exposed_name("last_step_timestamp_seconds"),
    "train_loss": exposed_name("train_loss"),
    "paused": exposed_name("paused"),
}
"""The series each run's numbers come from (the scrape source keeps them whatever the rules)."""

RunStatus = Literal[
    "running",
    "paused",
    "restarting",
    "completed",
    "stopped",
    "failed",
    "crashed",
    "down",
    "unknown",
]
HEALTHY: tuple[RunStatus, ...] = ("running", "paused", "completed", "stopped")
RunSeries = dict[str, dict[str, float]]  # field of RUN_METRICS -> rank -> latest value


@dataclass(frozen=True)
class RunFiles:
    """A run directory under the runs root and its ``agent.json``."""

    run_dir: Path
    agent: AgentInfo


def read_runs(runs_root: Path | None) -> dict[str, RunFiles]:
    """Every run under ``runs_root`` that discovery believes, ended ones included (one per run
    id, as discovery picks it)."""
    if runs_root is None:
        return {}
    return {run.info.run_id: RunFiles(run.run_dir, run.info) for run in announced_runs(runs_root)}


class RunsView:
    """Builds the API's view of runs from the runs root, the source and the state database."""

    def __init__(
        self,
        runs_root: Path | None,
        source: Source,
        state: AlertStore,
        announced: AnnouncedRuns | None = None,
    ) -> None:
        self.runs_root = runs_root
        self.source = source
        self.state = state
        self.announced = announced

    def runs(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """Every run known from discovery or from its series (only ``run_id`` when given),
        sorted by run id."""
        files = read_runs(self.runs_root)
        # the ranks of runs (a supervisor's exporter, also a target of the run, is no rank)
        targets = [t for t in self.source.targets() if t.run_id and t.rank is not None]
        series = self._series(time.time())
        announced = self.announced.run_ids() if self.announced else []
        known = set(files) | {t.run_id for t in targets if t.run_id} | set(series) | set(announced)
        alerts = [a for a in active_alerts(self.state) if a["labels"].get(RUN_LABEL)]
        hostname = socket.gethostname()
        return [
            _run(
                run,
                files.get(run),
                [t for t in targets if t.run_id == run],
                series.get(run, {}),
                [a for a in alerts if a["labels"][RUN_LABEL] == run],
                hostname,
                self.announced.get(run) if self.announced else None,
            )
            for run in sorted(known)
            if run_id is None or run == run_id
        ]

    def _series(self, t: float) -> dict[str, RunSeries]:
        """The latest value of each run metric, by run (none where the source fails)."""
        found: dict[str, RunSeries] = {}
        for name, metric in RUN_METRICS.items():
            try:
                result = self.source.query(f'{metric}{{run_id!=""}}', t)
            except (PromQLError, SourceError) as exc:
                log.debug("runs: %s: %s", metric, exc)
                continue
            for sample in result if isinstance(result, list) else []:
                run = found.setdefault(label_value(sample.labels, RUN_LABEL), {})
                run.setdefault(name, {})[label_value(sample.labels, "rank")] = sample.value
        return found


def _run(
    run_id: str,
    files: RunFiles | None,
    targets: list[TargetStatus],
    series: RunSeries,
    alerts: list[dict[str, Any]],
    hostname: str,
    announced: AnnouncedRun | None,
) -> dict[str, Any]:
    """One run as the API shows it."""
    ranks = _ranks(targets, series)
    agent = files.agent if files else None
    process = None if agent is None else _process(agent, hostname)
    supervisor = None if files is None else SupervisorInfo.read(files.run_dir)
    supervised = None
    if supervisor is not None:
        supervised = {**dataclasses.asdict(supervisor), "alive": supervisor.alive_here(hostname)}
    paused = _lowest_rank(series.get("paused", {}))
    alive = None if process is None else process["alive"]
    status = _status(agent, alive, ranks, paused == 1, supervised)
    firing = any(a["state"] == "firing" for a in alerts)
    return {
        "run_id": run_id,
        "status": status,
        "run_dir": None if files is None else str(files.run_dir),
        "step": _number(max(series.get("step", {}).values(), default=None), int),
        "last_step_time": _number(max(series.get("last_step_time", {}).values(), default=None)),
        "train_loss": _number(_lowest_rank(series.get("train_loss", {}))),
        "paused": None if paused is None else paused == 1,
        "targets": ranks,
        "health": {
            "ok": status in HEALTHY and not firing and all(r["up"] is not False for r in ranks),
            "alerts": alerts,
            "process": process,
        },
        "supervisor": supervised,
        "announced": None if announced is None else _announcement(announced),
    }


def _announcement(run: AnnouncedRun) -> dict[str, Any]:
    """Where the run said it is reached (``lossguard_agent_info``), and when it last said so."""
    return {
        "host": run.host,
        "control": None if run.control is None else join_address(*run.control),
        "supervisor": None if run.supervisor is None else join_address(*run.supervisor),
        "last_seen": run.last_seen,
    }


def _ranks(targets: list[TargetStatus], series: RunSeries) -> list[dict[str, Any]]:
    """Each rank seen as a target or in the series, with how its last scrape went."""
    by_rank = {t.rank or "": t for t in targets}
    steps, times = series.get("step", {}), series.get("last_step_time", {})
    names = set(by_rank) | {rank for values in series.values() for rank in values}
    ranks = []
    for rank in sorted(names, key=_rank_order):
        target = by_rank.get(rank)
        ranks.append(
            {
                "rank": int(rank) if rank.isdigit() else None,
                "url": target.url if target else None,
                "up": target.up if target else None,
                "last_scrape": target.last_scrape if target else None,
                "last_error": target.last_error if target else None,
                "step": _number(steps.get(rank), int),
                "last_step_time": _number(times.get(rank)),
            }
        )
    return ranks


def _process(agent: AgentInfo, hostname: str) -> dict[str, Any]:
    """The run's process as its ``agent.json`` tells: ``alive`` is False once it wrote its
    ``exit``, None on another host."""
    alive = None
    if agent.exit is not None:
        alive = False
    elif agent.pid is not None and agent.hostname == hostname:
        alive = pid_alive(agent.pid)
    return {
        "pid": agent.pid,
        "hostname": agent.hostname,
        "alive": alive,
        "started_at": agent.started_at,
        "finished_at": agent.finished_at,
        "exit": agent.exit,
        "world_size": agent.world_size,
        "version": agent.version,
    }


def _status(
    agent: AgentInfo | None,
    alive: bool | None,
    ranks: list[dict[str, Any]],
    paused: bool,
    supervisor: dict[str, Any] | None,
) -> RunStatus:
    """One word for the run: how it ended, or whether it trains."""
    if agent is not None and agent.ended_cleanly:
        return "completed" if agent.exit == "completed" else "stopped"
    if agent is not None and (agent.exit == "failed" or alive is False):
        if supervisor and supervisor["state"] in RESTARTING and supervisor["alive"] is not False:
            return "restarting"
        return "failed" if agent.exit == "failed" else "crashed"
    if paused:
        return "paused"
    if alive or any(r["up"] for r in ranks):
        return "running"
    return "down" if any(r["up"] is False for r in ranks) else "unknown"


def _rank_order(rank: str) -> tuple[int, str]:
    return len(rank), rank  # "2" before "10"


def _lowest_rank(values: dict[str, float]) -> float | None:
    return values[min(values, key=_rank_order)] if values else None


def _number(value: float | None, kind: type = float) -> Any:
    """A sample value for JSON: None when absent or not finite."""
    if value is None or not math.isfinite(value):
        return None
    return kind(value)
