"""Detection to recovery, measured from a run's audit trail and metrics log: wall time from the
start of the bad step (the injected fault) to the alert, to the rollback applied, and to the
first step logged after it. Shared by the demo and the recovery benchmark."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lossguard.common.rundir.events import FAULT, ROLLBACK


@dataclass(frozen=True)
class Recovery:
    """One fault and what the monitor made of it, in wall time from the bad step."""

    bad_step: int
    from_step: int  # the step the run had reached when the rollback was applied
    to_step: int
    detected_s: float  # bad step started -> the alert fired (or reached the monitor)
    applied_s: float  # -> the rollback applied by the agent
    recovered_s: float  # -> the first step logged after the restored checkpoint


def injected_fault(events: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The first ``fault`` event that perturbs training (not a mere ``slow_step``)."""
    return next(
        (e for e in events if e.get("event") == FAULT and e.get("kind") != "slow_step"), None
    )


def first_rollback(events: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    return next((e for e in events if e.get("event") == ROLLBACK), None)


def first_step_after(records: Sequence[dict[str, Any]], time: float) -> dict[str, Any] | None:
    """The first ``train`` record logged after ``time``."""
    return next((r for r in records if r.get("kind") == "train" and r["time"] > time), None)


def measure(
    events: Sequence[dict[str, Any]], records: Sequence[dict[str, Any]], fired_at: float
) -> Recovery | None:
    """The measurement, once the run has a fault, a rollback and a step logged after it
    (None before); ``fired_at``: when the alert fired."""
    fault = injected_fault(events)
    rollback = first_rollback(events)
    if fault is None or rollback is None:
        return None
    resumed = first_step_after(records, rollback["time"])
    if resumed is None:
        return None
    bad_at = fault["time"]
    return Recovery(
        bad_step=fault["step"],
        from_step=rollback["from_step"],
        to_step=rollback["to_step"],
        detected_s=fired_at - bad_at,
        applied_s=rollback["time"] - bad_at,
        recovered_s=resumed["time"] - bad_at,
    )
