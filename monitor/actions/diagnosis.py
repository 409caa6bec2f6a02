"""The agent's diagnosis of a spike or non-finite value, for alerts about one of its detector
signals (those with a ``signal`` label): read from the run's ``events.jsonl``, where the agent
records each detection with what it knew at that step."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lossguard.common.rundir.events import DETECTIONS, RESUMED, ROLLBACK
from lossguard.common.rundir.jsonl import read_tail

TAIL_BYTES = 1 << 20
"""How much of the end of ``events.jsonl`` is read: detections are recent."""
TIMELINE_STARTS = (ROLLBACK, RESUMED)
"""Events after which the run trains from an earlier step: detections after that step belong to
an abandoned timeline."""


def latest_diagnosis(events_path: Path, signal: str) -> dict[str, Any] | None:
    """The diagnosis of the newest detection of ``signal`` in the run's current timeline; None
    when there is none (or the file cannot be read)."""
    horizon = math.inf  # detections after this step were abandoned by a later rollback
    for event in reversed(read_tail(events_path, TAIL_BYTES)):
        kind = event.get("event")
        if kind in TIMELINE_STARTS and isinstance(event.get("step"), int):
            horizon = min(horizon, event["step"])
        diagnosis = event.get("diagnosis")
        if kind in DETECTIONS and event.get("signal") == signal and isinstance(diagnosis, dict):
            step = diagnosis.get("step", event.get("step"))
            if isinstance(step, int) and step <= horizon:
                return diagnosis
    return None
