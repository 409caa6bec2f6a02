"""The RollbacksExhausted page: a critical alert the monitor raises itself when a run has used
its rollbacks and still diverges, and resolves when no rollback alert of the run fires any more.

It enters the notification pipeline as any rule's alert does, as transitions in the state
database; the open pages are kept in their own table, so a restart neither forgets nor repeats
them."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import TypedDict

from lossguard.monitor.rules.alerting import (
    ALERT_NAME,
    Alert,
    AlertState,
    Transition,
    TransitionKind,
    fingerprint,
)
from lossguard.monitor.state import StateStore

ALERT = "RollbacksExhausted"
RULE_KEY = f"lossguard-actions/{ALERT}"
RUNBOOK = "docs/runbook.md#rollbacksexhausted"
KEPT_LABELS = ("run_id", "rank", "job", "instance")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS exhausted_pages (
    run_id TEXT PRIMARY KEY,
    labels TEXT NOT NULL,
    annotations TEXT NOT NULL,
    value REAL NOT NULL,
    fired_at REAL NOT NULL
);
"""


class OpenPage(TypedDict):
    """A RollbacksExhausted page still firing."""

    labels: dict[str, str]
    annotations: dict[str, str]
    value: float
    fired_at: float


class ExhaustedPages:
    """Raises and resolves RollbacksExhausted, one per run."""

    def __init__(self, state: StateStore) -> None:
        self.state = state
        with state.reading() as db:
            db.executescript(_SCHEMA)

    def raise_page(
        self, alert_labels: dict[str, str], rollbacks: int, window: str, then: str, now: float
    ) -> bool:
        """Fire the page for the alert's run (False: it fires already)."""
        labels = {k: alert_labels[k] for k in KEPT_LABELS if k in alert_labels}
        labels.update({ALERT_NAME: ALERT, "severity": "critical"})
        run = labels.get("run_id", "")
        trigger = alert_labels.get(ALERT_NAME, "")
        afterwards = {
            "pause": "Training is paused, its process and state kept for you.",
            "stop": "Training was stopped after saving a checkpoint.",
            "none": "Training goes on as it is.",
        }[then]
        annotations = {
            "summary": f"Rollbacks exhausted in run {run}: {trigger} fired again after "
            f"{rollbacks} rollbacks in {window}",
            "description": f"{trigger} fired for run {run} after the monitor had already "
            f"rolled it back {rollbacks} times in {window} (actions.rollback.max_attempts), so "
            f"it did not roll back again. {afterwards} Look at the spike diagnosis of each "
            "attempt (lossguard-monitor status) before resuming: the data, the learning rate "
            "or the precision may need changing.",
            "runbook_url": RUNBOOK,
        }
        alert = Alert(
            rule=RULE_KEY,
            fingerprint=fingerprint(labels),
            labels=dict(sorted(labels.items())),
            annotations=annotations,
            state=AlertState.FIRING,
            value=float(rollbacks),
            active_at=now,
            fired_at=now,
        )
        with self.state.transaction() as db:
            inserted = db.execute(
                "INSERT OR IGNORE INTO exhausted_pages VALUES (?, ?, ?, ?, ?)",
                (run, json.dumps(alert.labels), json.dumps(annotations), alert.value, now),
            ).rowcount
            if inserted:
                StateStore.append_events(db, [Transition(TransitionKind.FIRING, now, alert)])
        return bool(inserted)

    def resolve_quiet(self, diverging_runs: Collection[str], now: float) -> list[str]:
        """Resolve the pages of runs with no firing rollback alert; the runs resolved."""
        with self.state.transaction() as db:
            rows = db.execute(
                "SELECT run_id, labels, annotations, value, fired_at FROM exhausted_pages"
            ).fetchall()
            ended = [row for row in rows if row[0] not in diverging_runs]
            for run, labels, annotations, value, fired_at in ended:
                parsed = json.loads(labels)
                alert = Alert(
                    rule=RULE_KEY,
                    fingerprint=fingerprint(parsed),
                    labels=parsed,
                    annotations=json.loads(annotations),
                    state=AlertState.FIRING,
                    value=value,
                    active_at=fired_at,
                    fired_at=fired_at,
                )
                StateStore.append_events(db, [Transition(TransitionKind.RESOLVED, now, alert)])
                db.execute("DELETE FROM exhausted_pages WHERE run_id = ?", (run,))
        return [row[0] for row in ended]

    def firing(self) -> list[OpenPage]:
        """The open pages: labels, annotations and when each fired."""
        with self.state.reading() as db:
            rows = db.execute(
                "SELECT labels, annotations, value, fired_at FROM exhausted_pages"
            ).fetchall()
        return [
            OpenPage(labels=json.loads(lb), annotations=json.loads(an), value=v, fired_at=at)
            for lb, an, v, at in rows
        ]
