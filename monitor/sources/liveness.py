"""Whether a run's training process still lives, and what the page about a dead one says.

A run whose ``agent.json`` names this host and a pid that no longer runs is dead: it ended
without ending cleanly (``exit`` failed, or no ``exit`` at all: killed, a segfault, the OOM
killer). A run on another host is judged from what the monitor scrapes, on the monitor's own
clock, never from file times: it recorded a failure, or its rank 0, which answered the
monitor's scrapes before, has not answered for :data:`REMOTE_DEAD_AFTER_S`. Its ranks are not
scraped; instead the monitor writes one series per dead run, :data:`RUN_EXITED`, on its own
scrape path and on its ``/metrics`` (docs/monitor.md).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lossguard.common.rundir.agent_file import AgentInfo
from lossguard.common.rundir.checkpoints import list_checkpoints
from lossguard.common.rundir.metrics_log import LastLogged, last_logged
from lossguard.common.rundir.paths import RunPaths
from lossguard.common.rundir.supervisor_file import RESTARTING, SupervisorInfo, pid_alive
from lossguard.common.rundir.targets import ordered

RUN_EXITED = "lossguard_run_exited_timestamp_seconds"
LAST_STEP_LABEL = "last_step"
RUN_EXITED_LABELS = ("run_id", "host", "exit", LAST_STEP_LABEL, "last_checkpoint", "supervisor")
RUN_EXITED_HELP = (
    "Present while a run's training process is known dead without having ended cleanly (on the "
    "monitor's host: its pid is gone; on another: it failed, or its rank 0 stopped answering "
    "the monitor's scrapes): when "
    "it was last alive (Unix seconds). host: the host it ran on; exit: "
    "crashed (no exit in agent.json) or agent.json's exit; last_step: its last logged step; "
    "last_checkpoint: its newest checkpoint and whether it is healthy; supervisor: "
    "restarting, crash_loop or none."
)
CRASHED = "crashed"
SUPERVISOR_RESTARTING = "restarting"
SUPERVISOR_CRASH_LOOP = "crash_loop"
NO_SUPERVISOR = "none"
DEFAULT_FORGET_AFTER_S = 24 * 3600.0
REMOTE_DEAD_AFTER_S = 60.0
"""A run on another host whose rank 0 stopped answering scrapes this long ago is dead."""

Incarnation = tuple[str, str | None, int | None]
"""One process of a run: its run id, host and pid, as its ``agent.json`` names them."""
AnsweredAt = Callable[[Incarnation], float | None]
"""When the monitor last scraped the incarnation's rank 0 (its clock; None: never)."""


def never_answered(incarnation: Incarnation) -> None:
    """For a caller that does not scrape: no run on another host is judged by its scrapes."""
    return None


def incarnation_of(info: AgentInfo) -> Incarnation:
    return (info.run_id, info.hostname, info.pid)


@dataclass(frozen=True)
class DeadRun:
    """A run whose process died on this host and was not replaced."""

    run_id: str
    run_dir: Path
    pid: int
    host: str
    metrics_urls: tuple[str, ...]
    exit: str  # crashed, or agent.json's exit (failed)
    last_seen: float  # its last sign of life, Unix seconds
    last_step: int | None
    last_checkpoint: str | None  # "step_00000150 (healthy)"
    supervisor: str  # restarting | crash_loop | none

    def labels(self) -> dict[str, str]:
        """The :data:`RUN_EXITED` labels (an unknown value is empty: the label is absent)."""
        return {
            "run_id": self.run_id,
            "host": self.host,
            "exit": self.exit,
            LAST_STEP_LABEL: "" if self.last_step is None else str(self.last_step),
            "last_checkpoint": self.last_checkpoint or "",
            "supervisor": self.supervisor,
        }

    def describe(self) -> str:
        """One line for the monitor's status: how it ended and what is left of it."""
        how = "crashed (no exit in agent.json)" if self.exit == CRASHED else f"exited ({self.exit})"
        step = "no step logged" if self.last_step is None else f"last step {self.last_step}"
        checkpoint = self.last_checkpoint or "none"
        return (
            f"process {self.pid} {how}, not scraped: {step}, last checkpoint {checkpoint}, "
            f"supervisor {self.supervisor}"
        )


def dead_run(
    info: AgentInfo,
    run_dir: Path,
    hostname: str,
    answered_at: AnsweredAt = never_answered,
    now: float | None = None,
) -> DeadRun | None:
    """The run of ``info`` if its process is known dead: on this host (``hostname``), its pid
    no longer runs; on another host (its pid is never probed here), it recorded a failure or
    its scrapes stopped answering (``remote_dead``). None while it lives, or when this host
    cannot tell (no pid; a remote run never scraped by this monitor)."""
    if info.pid is None:
        return None
    now = time.time() if now is None else now
    remote = info.hostname != hostname
    answered = answered_at(incarnation_of(info)) if remote else None
    if remote:
        if not remote_dead(info, answered, now):
            return None
    elif pid_alive(info.pid):
        return None
    try:
        stat = os.stat(RunPaths.of(run_dir).agent)
    except OSError:
        return None  # removed meanwhile
    logged, checkpoint = _what_is_left(run_dir, (stat.st_ino, stat.st_size, stat.st_mtime_ns))
    # a remote run's signs of life are what the monitor saw, not its files' times
    signs = (
        (info.finished_at, answered) if remote else (info.finished_at, logged.time, stat.st_mtime)
    )
    return DeadRun(
        run_id=info.run_id,
        run_dir=run_dir,
        pid=info.pid,
        host=info.hostname or hostname,
        metrics_urls=info.metrics_urls,
        exit=info.exit or CRASHED,
        last_seen=max(s for s in signs if s is not None),
        last_step=logged.step,
        last_checkpoint=checkpoint,
        supervisor=supervisor_state(run_dir, hostname),
    )


def remote_dead(info: AgentInfo, answered: float | None, now: float) -> bool:
    """Whether the process of an ``agent.json`` written on another host is dead: it recorded
    that it failed, or its rank 0, last answering the monitor's scrape at ``answered``, has
    not answered for longer than ``REMOTE_DEAD_AFTER_S`` (both on the monitor's clock)."""
    if info.finished_at is not None:
        return True  # discovery keeps only runs that did not end on purpose: a failure
    return answered is not None and now - answered > REMOTE_DEAD_AFTER_S


@functools.lru_cache(maxsize=1024)
def _what_is_left(run_dir: Path, agent_file: tuple[int, int, int]) -> tuple[LastLogged, str | None]:
    """The end of the metrics log and the newest checkpoint, read once per ``agent.json``
    version (``agent_file``): a dead process writes nothing more, and listing checkpoints warns
    about each broken one."""
    return last_logged(run_dir), newest_checkpoint(run_dir)


def newest_checkpoint(run_dir: Path) -> str | None:
    """``step_00000150 (healthy)``, or ``step_00000150 (not healthy; last good
    step_00000100)``: the checkpoint a resume would take first, and whether it is good."""
    metas = list_checkpoints(RunPaths.of(run_dir).checkpoints)
    newest = next(iter(ordered(metas, "latest")), None)
    if newest is None:
        return None
    if newest.healthy:
        return f"{newest.name} (healthy)"
    good = next(iter(ordered(metas, "last_good")), None)
    return f"{newest.name} (not healthy; last good {good.name if good else 'none'})"


def supervisor_state(run_dir: Path, hostname: str) -> str:
    """What the run's live supervisor does about it: restarting (running or in backoff),
    crash_loop (gave up), or none (no supervisor, or it is not running here)."""
    info = SupervisorInfo.read(run_dir)
    if info is None or not info.alive_here(hostname):
        return NO_SUPERVISOR
    if info.state in RESTARTING:
        return SUPERVISOR_RESTARTING
    return SUPERVISOR_CRASH_LOOP if info.state == "crash_loop" else NO_SUPERVISOR
