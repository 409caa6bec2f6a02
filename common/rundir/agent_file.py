"""``agent.json``: how a run announces itself (docs/design.md "Run directory").

Written by the agent's rank 0 when a run starts and again when it ends; read by the monitor's
discovery and by anything else that must find a run's process, exporters and control socket.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

from lossguard.common.rundir.jsonl import parse_json_object

RunExit = Literal["completed", "stopped", "preempted", "failed"]
"""How a run ended: completed its steps, stopped on purpose (command or signal), preempted (the
preempt signal, SIGUSR1: state saved, to be requeued), or failed."""
ENDED_CLEANLY: tuple[RunExit, ...] = ("completed", "stopped", "preempted")
"""Runs that ended on purpose. A run that failed, or never wrote ``exit`` (killed), did not."""


@dataclass(frozen=True)
class AgentInfo:
    """One run's ``agent.json``."""

    run_id: str
    metrics_urls: tuple[str, ...]  # one exporter per rank, rank order
    socket: str | None  # the control socket's path
    started_at: float = 0.0
    pid: int | None = None
    hostname: str | None = None
    world_size: int = 1
    version: str | None = None
    finished_at: float | None = None
    exit: str | None = None  # a RunExit from this agent; another version may write others

    @property
    def ended_cleanly(self) -> bool:
        return self.exit in ENDED_CLEANLY

    def finished(self, exit: RunExit, at: float) -> AgentInfo:
        return dataclasses.replace(self, exit=exit, finished_at=at)

    def to_json(self) -> str:
        info: dict[str, Any] = {
            "run_id": self.run_id,
            "pid": self.pid,
            "hostname": self.hostname,
            "metrics_url": self.metrics_urls[0] if self.metrics_urls else None,
            "metrics_urls": list(self.metrics_urls),
            "socket": self.socket,
            "world_size": self.world_size,
            "started_at": self.started_at,
            "version": self.version,
        }
        if self.exit is not None:
            info.update(finished_at=self.finished_at, exit=self.exit)
        return json.dumps(info, indent=2) + "\n"

    @classmethod
    def parse(cls, data: bytes | str) -> AgentInfo:
        """The contents of an ``agent.json``; ValueError names what is wrong, on one line."""
        info = parse_json_object(data)
        urls = _field(info, "metrics_urls", list)
        if not all(isinstance(url, str) for url in urls):
            raise ValueError("metrics_urls: expected a list of URLs")
        socket = info.get("socket")
        if socket is not None and not isinstance(socket, str):
            raise ValueError("socket: expected a path or null")
        started_at = info.get("started_at", 0.0)
        if not isinstance(started_at, int | float):
            raise ValueError("started_at: expected a number")
        return cls(
            run_id=_field(info, "run_id", str),
            metrics_urls=tuple(urls),
            socket=socket,
            started_at=float(started_at),
            pid=_optional(info, "pid", int),
            hostname=_optional(info, "hostname", str),
            world_size=_optional(info, "world_size", int) or 1,
            version=_optional(info, "version", str),
            finished_at=_optional(info, "finished_at", float),
            exit=_optional(info, "exit", str),
        )


def _field(info: dict[str, Any], name: str, kind: type) -> Any:
    value = info.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{name}: expected a {kind.__name__}, got {json.dumps(value)}")
    return value


def _optional(info: dict[str, Any], name: str, kind: type) -> Any:
    """A field discovery does not need: absent or of another type, it is None (a run is
    watched whatever else its agent.json holds)."""
    value = info.get(name)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value if isinstance(value, kind) and not isinstance(value, bool) else None
