"""A run directory read for a report, without torch: the metrics log, the audit trail, the
checkpoints on disk, ``agent.json`` and, when given, the monitor's state database.

Whatever a run left is enough: a crashed run's last line may be torn, a user's own loop may log
no MFU, a run may have no checkpoints. Only a folder holding none of a run's records is refused.
"""

from __future__ import annotations

import bisect
import functools
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lossguard.common.rundir.agent_file import AgentInfo
from lossguard.common.rundir.checkpoints import list_checkpoints
from lossguard.common.rundir.jsonl import read_jsonl
from lossguard.common.rundir.names import (
    AGENT_FILE,
    EVENTS_LOG,
    METRICS_LOG,
)
from lossguard.common.rundir.paths import RunPaths
from lossguard.common.rundir.supervisor_file import pid_alive
from lossguard.monitor.actions.model import ActionRecord
from lossguard.monitor.report import marks
from lossguard.monitor.report.history import AlertSpan, HistoryError, monitor_history
from lossguard.monitor.report.marks import number

RUN_RECORDS = (METRICS_LOG, EVENTS_LOG, AGENT_FILE)
"""A folder with none of these is not a run directory."""


class ReportError(Exception):
    """A report that cannot be written (one line naming the problem)."""


@dataclass(frozen=True)
class Point:
    """One metrics record: its numbers by field (the nested memory figures as
    ``memory.allocated`` and so on). ``abandoned``: on a timeline that a rollback or resume
    left."""

    step: int
    time: float | None
    values: Mapping[str, float]
    abandoned: bool = False


@dataclass(frozen=True)
class RunRecord:
    """Everything a report shows of one run."""

    run_dir: Path
    run_id: str
    outcome: str  # completed | stopped | failed | running | crashed (...) | unknown (...)
    agent: AgentInfo | None
    train: tuple[Point, ...]
    evals: tuple[Point, ...]
    events: tuple[dict[str, Any], ...]
    spikes: tuple[marks.Spike, ...]
    restores: tuple[marks.Restore, ...]
    checkpoints: tuple[marks.Checkpoint, ...]
    commands: tuple[marks.Command, ...]
    crashes: tuple[marks.Crash, ...]
    alerts: tuple[AlertSpan, ...] = ()
    actions: tuple[ActionRecord, ...] = ()
    state_db: Path | None = None
    unreadable: Mapping[str, int] = field(default_factory=dict)  # log file -> lines skipped
    spike_zscore: float | None = None  # the detector's threshold, in z-score mode

    @property
    def last_step(self) -> int | None:
        steps = [p.step for p in self.train + self.evals]
        steps += [c.step for c in self.checkpoints]
        return max(steps, default=None)

    @property
    def current_last_step(self) -> int | None:
        """The last step logged on the timeline training went on with (not an abandoned one)."""
        return max((p.step for p in self.train + self.evals if not p.abandoned), default=None)

    @functools.cached_property
    def _timed(self) -> list[tuple[float, int]]:
        return sorted((p.time, p.step) for p in self.train if p.time is not None)

    def step_at(self, time: float) -> int:
        """The step training was at, at ``time``: interpolated between the train records
        around it (the earlier one's step where a rollback lies between them); 0 before the
        first."""
        timed = self._timed
        if not timed:
            return 0
        i = bisect.bisect_right(timed, (time, float("inf")))
        if i == 0:
            return 0
        if i == len(timed):
            return timed[-1][1]
        (t0, s0), (t1, s1) = timed[i - 1], timed[i]
        if s1 <= s0 or t1 <= t0:
            return s0
        return round(s0 + (s1 - s0) * (time - t0) / (t1 - t0))


def read_run(run_dir: Path, state_db: Path | None = None) -> RunRecord:
    """The run in ``run_dir``; ``state_db``: a monitor state database to take the run's
    alerts and actions from. ReportError when ``run_dir`` is no run directory or the database
    cannot be read."""
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such directory")
    if not any((run_dir / name).is_file() for name in RUN_RECORDS):
        names = ", ".join(RUN_RECORDS)
        raise ReportError(f"{run_dir}: not a run directory (none of {names} in it)")
    paths = RunPaths.of(run_dir)
    agent, outcome = _agent(paths)
    run_id = agent.run_id if agent is not None else run_dir.name
    metrics = read_jsonl(paths.metrics)
    audit = read_jsonl(paths.events)
    events = audit.records
    train = _points(metrics.records, "train")
    logged = sorted((p.time, p.step) for p in train if p.time is not None)
    restores = marks.restores(events, logged)
    history = None
    if state_db is not None:
        try:
            history = monitor_history(state_db, run_id)
        except HistoryError as exc:
            raise ReportError(str(exc)) from None
    unreadable = {METRICS_LOG: metrics.unreadable, EVENTS_LOG: audit.unreadable}
    return RunRecord(
        run_dir=run_dir,
        run_id=run_id,
        outcome=outcome,
        agent=agent,
        train=_abandon(train, restores),
        evals=_abandon(_points(metrics.records, "eval"), restores),
        events=events,
        spikes=tuple(marks.spikes(events)),
        restores=tuple(restores),
        checkpoints=tuple(marks.checkpoints(events, list_checkpoints(paths.checkpoints))),
        commands=tuple(marks.commands(events)),
        crashes=tuple(marks.crashes(events)),
        alerts=history.alerts if history else (),
        actions=history.actions if history else (),
        state_db=state_db,
        unreadable={name: count for name, count in unreadable.items() if count},
        spike_zscore=_spike_zscore(paths.config),
    )


def _agent(paths: RunPaths) -> tuple[AgentInfo | None, str]:
    """``agent.json`` and how the run ended by it: its ``exit``; else running or crashed when
    its pid is of this host; else unknown."""
    try:
        agent = AgentInfo.parse(paths.agent.read_bytes())
    except FileNotFoundError:
        return None, f"unknown (no {AGENT_FILE})"
    except (OSError, ValueError) as exc:
        return None, f"unknown ({AGENT_FILE}: {exc})"
    if agent.exit is not None:
        return agent, agent.exit
    if agent.pid is None or agent.hostname != socket.gethostname():
        return agent, f"unknown (no exit recorded; it ran on {agent.hostname or 'another host'})"
    if pid_alive(agent.pid):
        return agent, "running"
    return agent, "crashed (no exit recorded, its process is gone)"


def _points(records: Sequence[dict[str, Any]], kind: str) -> list[Point]:
    points = []
    for record in records:
        step = marks.integer(record.get("step"))
        if record.get("kind", "train") != kind or step is None:
            continue
        values = {k: n for k, v in record.items() if (n := number(v)) is not None}
        values.pop("step", None)
        values.pop("time", None)
        memory = record.get("memory")
        if isinstance(memory, dict):
            values.update(
                {f"memory.{k}": n for k, v in memory.items() if (n := number(v)) is not None}
            )
        points.append(Point(step, number(record.get("time")), values))
    return points


def _abandon(points: list[Point], restores: Sequence[marks.Restore]) -> tuple[Point, ...]:
    """Mark the points a later restore went back before: logged before it, past its step."""
    return tuple(
        Point(p.step, p.time, p.values, abandoned=True)
        if any(
            r.time is not None and p.time is not None and p.time < r.time and p.step > r.to_step
            for r in restores
        )
        else p
        for p in points
    )


def _spike_zscore(config_path: Path) -> float | None:
    """The spike detector's z-score threshold from the run's resolved ``config.yaml``."""
    try:
        config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
        spikes = config["telemetry"]["spikes"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    if not isinstance(spikes, dict) or spikes.get("mode") != "zscore":
        return None
    return number(spikes.get("zscore"))
