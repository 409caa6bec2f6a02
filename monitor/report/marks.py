"""What a run's audit trail (``events.jsonl``) and checkpoint folder say happened, as the marks
a report draws: spikes and non-finite values, rollbacks and resumes, checkpoints, control
commands, crashes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lossguard.common.rundir.checkpoints import CheckpointMeta
from lossguard.common.rundir.events import (
    CHECKPOINT,
    COMMAND,
    CRASH,
    DETECTIONS,
    NONFINITE,
    RESUMED,
    ROLLBACK,
)
from lossguard.common.rundir.targets import is_superseded, ordered

READ_ONLY_COMMANDS = ("status", "checkpoints")
"""Commands that change nothing: not marked."""


@dataclass(frozen=True)
class Spike:
    """A spike episode or a non-finite value the agent's detectors reported."""

    step: int  # the step it was seen at
    signal: str  # loss | grad_norm
    nonfinite: bool
    zscore: float | None


@dataclass(frozen=True)
class Restore:
    """Training went back to a checkpoint: a rollback, or a resume (after a restart)."""

    kind: Literal["rollback", "resume"]
    from_step: int | None  # the step left (None: nothing logged before it)
    to_step: int
    checkpoint: str | None
    time: float | None


@dataclass(frozen=True)
class Checkpoint:
    """One save, or a checkpoint on disk whose save the audit trail does not record."""

    name: str
    step: int
    healthy: bool
    reason: str
    on_disk: bool  # this save is the one in checkpoints/ now
    last_good: bool  # what ``last_good`` resolves to now


@dataclass(frozen=True)
class Command:
    """A control command that was applied or refused (the monitor's actions among them)."""

    step: int | None
    time: float | None
    cmd: str
    request_id: str
    ok: bool
    source: str  # agent | supervisor


@dataclass(frozen=True)
class Crash:
    """The training process died and its supervisor saw it."""

    step: int | None
    time: float | None
    exit: str


def integer(value: Any) -> int | None:
    """``value`` if it is an int (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def number(value: Any) -> float | None:
    """``value`` as a float if it is a number (not a bool), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def spikes(events: Sequence[dict[str, Any]]) -> list[Spike]:
    """The ``spike`` and ``nonfinite`` events, at the step their diagnosis names."""
    found = []
    for event in events:
        if event.get("event") not in DETECTIONS:
            continue
        diagnosis = event.get("diagnosis")
        seen = integer(diagnosis.get("step")) if isinstance(diagnosis, dict) else None
        step = seen if seen is not None else integer(event.get("step"))
        if step is None:
            continue
        found.append(
            Spike(
                step=step,
                signal=str(event.get("signal", "?")),
                nonfinite=event["event"] == NONFINITE,
                zscore=number(event.get("zscore")),
            )
        )
    return found


def restores(
    events: Sequence[dict[str, Any]], logged: Sequence[tuple[float, int]]
) -> list[Restore]:
    """The ``rollback`` and ``resumed`` events. ``logged``: (time, step) of each train record,
    in time order, for the step a resume left (the last one logged before it)."""
    found = []
    for event in events:
        kind, time = event.get("event"), number(event.get("time"))
        if kind == ROLLBACK:
            to_step = integer(event.get("to_step"))
            if to_step is not None:
                found.append(
                    Restore(
                        "rollback",
                        integer(event.get("from_step")),
                        to_step,
                        _text(event.get("checkpoint")),
                        time,
                    )
                )
        elif kind == RESUMED:
            to_step = integer(event.get("step"))
            if to_step is not None:
                before = [step for at, step in logged if time is None or at < time]
                from_step = before[-1] if before else None
                checkpoint = _text(event.get("checkpoint"))
                found.append(Restore("resume", from_step, to_step, checkpoint, time))
    return found


def checkpoints(
    events: Sequence[dict[str, Any]], on_disk: Sequence[CheckpointMeta]
) -> list[Checkpoint]:
    """Every save the audit trail records, and the checkpoints on disk it does not; the last
    save of each name on disk is that checkpoint (its health and ``last_good`` from disk)."""
    metas = {meta.name: meta for meta in on_disk if not is_superseded(meta)}
    good = ordered(list(on_disk), "last_good")
    last_good = good[0].name if good else None
    saves = [e for e in events if e.get("event") == CHECKPOINT and isinstance(e.get("name"), str)]
    last_save = {e["name"]: i for i, e in enumerate(saves)}
    found = []
    for i, event in enumerate(saves):
        step = integer(event.get("checkpoint_step"))
        step = step if step is not None else integer(event.get("step"))
        if step is None:
            continue
        current = last_save[event["name"]] == i and event["name"] in metas
        found.append(
            Checkpoint(
                name=event["name"],
                step=step,
                healthy=bool(event.get("healthy")),
                reason=str(event.get("reason", "")),
                on_disk=current,
                last_good=current and event["name"] == last_good,
            )
        )
    for meta in metas.values():
        if meta.name not in last_save:
            found.append(
                Checkpoint(
                    meta.name, meta.step, meta.healthy, meta.reason, True, meta.name == last_good
                )
            )
    return sorted(found, key=lambda c: c.step)


def commands(events: Sequence[dict[str, Any]]) -> list[Command]:
    """The ``command`` events of commands that change something."""
    found = []
    for event in events:
        cmd = event.get("cmd")
        if event.get("event") != COMMAND or not isinstance(cmd, str):
            continue
        if cmd in READ_ONLY_COMMANDS:
            continue
        found.append(
            Command(
                step=integer(event.get("step")),
                time=number(event.get("time")),
                cmd=cmd,
                request_id=str(event.get("id", "")),
                ok=event.get("ok") is True,
                source=str(event.get("source", "agent")),
            )
        )
    return found


def crashes(events: Sequence[dict[str, Any]]) -> list[Crash]:
    """The supervisor's ``crash`` events."""
    return [
        Crash(integer(e.get("step")), number(e.get("time")), str(e.get("exit", "?")))
        for e in events
        if e.get("event") == CRASH
    ]


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
