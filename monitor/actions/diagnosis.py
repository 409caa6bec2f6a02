"""The agent's diagnosis of a spike or non-finite value, for alerts about one of its detector
signals (those with a ``signal`` label): read from the run's ``events.jsonl``, where the agent
records each detection with what it knew at that step."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

TAIL_BYTES = 1 << 20
"""How much of the end of ``events.jsonl`` is read: detections are recent."""
DETECTIONS = ("spike", "nonfinite")
TIMELINE_STARTS = ("rollback", "resumed")
"""Events after which the run trains from an earlier step: detections after that step belong to
an abandoned timeline."""


def latest_diagnosis(events_path: Path, signal: str) -> dict[str, Any] | None:
    """The diagnosis of the newest detection of ``signal`` in the run's current timeline; None
    when there is none (or the file cannot be read)."""
    horizon = math.inf  # detections after this step were abandoned by a later rollback
    for event in reversed(_tail(events_path)):
        kind = event.get("event")
        if kind in TIMELINE_STARTS and isinstance(event.get("step"), int):
            horizon = min(horizon, event["step"])
        diagnosis = event.get("diagnosis")
        if kind in DETECTIONS and event.get("signal") == signal and isinstance(diagnosis, dict):
            step = diagnosis.get("step", event.get("step"))
            if isinstance(step, int) and step <= horizon:
                return diagnosis
    return None


def _tail(path: Path) -> list[dict[str, Any]]:
    """The JSON objects on the whole lines of the end of ``path``."""
    try:
        with path.open("rb") as file:
            size = file.seek(0, 2)
            file.seek(max(0, size - TAIL_BYTES))
            lines = file.read().split(b"\n")
    except OSError:
        return []
    if size > TAIL_BYTES:
        lines = lines[1:]  # the first may be cut
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line being written, or not JSON
        if isinstance(event, dict):
            events.append(event)
    return events
