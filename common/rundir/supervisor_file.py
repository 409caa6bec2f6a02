"""``supervisor.json``: how a supervised run's supervisor announces itself (docs/design.md
"Supervisor").

Written by ``lossguard-supervise`` into the run directory whenever its state changes; read by
the monitor's discovery (the supervisor's exporter, its control socket, or with
``--control-tcp`` its advertised TCP address, for the ``restart`` action, and whether a dead
agent is being restarted) and by ``lossguard-ctl``. Fields a newer supervisor adds are
ignored; ``control_tcp`` is absent from an older supervisor's file (None).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lossguard.common.rundir.jsonl import parse_json_object
from lossguard.common.rundir.paths import RunPaths

RESUME_ENV = "LOSSGUARD_RESUME"
"""Set by the supervisor for a restart: the checkpoint (a name such as ``step_00000150``) that
the training command resumes from. ``lossguard-agent run`` and ``Guard`` honour it."""

SupervisorState = Literal["running", "backoff", "crash_loop", "exited"]
"""running: the training command runs; backoff: it died and is restarted after a delay;
crash_loop: the restart budget is spent, nothing is restarted; exited: the supervisor ended
(the run completed or was stopped or preempted)."""
RESTARTING: tuple[SupervisorState, ...] = ("running", "backoff")


@dataclass(frozen=True)
class SupervisorInfo:
    """One run's ``supervisor.json``."""

    run_id: str
    pid: int
    hostname: str
    started_at: float
    state: SupervisorState
    socket: str | None = None
    metrics_url: str | None = None
    child_pid: int | None = None
    restarts: int = 0
    version: str | None = None
    control_tcp: str | None = None  # HOST:PORT others reach the control at (TCP, token)

    def with_state(self, state: SupervisorState, **changes: Any) -> SupervisorInfo:
        return dataclasses.replace(self, state=state, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def parse(cls, data: bytes | str) -> SupervisorInfo:
        """The contents of a ``supervisor.json``; ValueError names what is wrong, on one line."""
        info = parse_json_object(data)
        state = info.get("state")
        if state not in ("running", "backoff", "crash_loop", "exited"):
            raise ValueError(
                f"state: expected running, backoff, crash_loop or exited, not {state!r}"
            )
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for name, value in info.items():
            if name not in fields:
                continue  # a newer supervisor's field
            values[name] = value
        try:
            parsed = cls(**values)
        except TypeError as exc:
            raise ValueError(str(exc)) from None
        for name, kind in (("run_id", str), ("pid", int), ("hostname", str)):
            value = values.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"{name}: expected a {kind.__name__}, got {json.dumps(value)}")
        return parsed

    @classmethod
    def read(cls, run_dir: Path) -> SupervisorInfo | None:
        """The run's ``supervisor.json``, or None when it has none or it cannot be read."""
        try:
            return cls.parse(RunPaths.of(run_dir).supervisor.read_bytes())
        except (OSError, ValueError):
            return None

    def alive_here(self, hostname: str) -> bool | None:
        """Whether the supervisor process lives: None when it runs on another host."""
        if hostname != self.hostname:
            return None
        return pid_alive(self.pid)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
