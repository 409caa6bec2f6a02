"""A run's ``metrics.jsonl`` read from its end, without torch: what the run last logged, for
the monitor's account of a dead run (and anything else that must know how far a run got)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lossguard.common.rundir.jsonl import read_tail
from lossguard.common.rundir.paths import RunPaths

TAIL_BYTES = 64 * 1024


@dataclass(frozen=True)
class LastLogged:
    """The end of a run's metrics log."""

    step: int | None  # of the last ``train`` record
    time: float | None  # of the last record of any kind (Unix seconds)


def last_logged(run_dir: Path) -> LastLogged:
    """The step of the last ``train`` record and the time of the last record in
    ``run_dir/metrics.jsonl``, read from its last 64 KiB; a line torn by a crash is skipped, a
    missing file is nothing logged."""
    step: int | None = None
    time: float | None = None
    for record in reversed(read_tail(RunPaths.of(run_dir).metrics, TAIL_BYTES)):
        if time is None and _number(record.get("time")):
            time = float(record["time"])
        if step is None and record.get("kind") == "train" and _integer(record.get("step")):
            step = record["step"]
        if step is not None and time is not None:
            break
    return LastLogged(step, time)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
