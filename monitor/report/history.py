"""What the monitor's state database remembers of one run: its alerts, from firing to resolved,
and the actions taken on them."""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from lossguard.monitor.actions.model import ActionRecord
from lossguard.monitor.actions.store import ActionStore
from lossguard.monitor.alert_store import AlertStore, AlertStoreError
from lossguard.monitor.notify.model import RUN_LABEL
from lossguard.monitor.rules.alerting import ALERT_NAME, TransitionKind

PAGE = 1000


class HistoryError(Exception):
    """A state database that cannot be read (one line)."""


@dataclass(frozen=True)
class AlertSpan:
    """One alert instance of the run, from firing until resolved (None: still firing)."""

    name: str
    severity: str
    summary: str
    fired_at: float
    resolved_at: float | None


@dataclass(frozen=True)
class MonitorHistory:
    alerts: tuple[AlertSpan, ...]
    actions: tuple[ActionRecord, ...]


def monitor_history(path: Path, run_id: str) -> MonitorHistory:
    """The alerts that fired for ``run_id`` (label ``run_id``) and the actions taken on the
    run, oldest first, from the state database at ``path``."""
    if not path.is_file():
        raise HistoryError(f"--state: no state database at {path}")
    _check_is_state(path)
    try:
        state = AlertStore(path)
    except AlertStoreError as exc:
        raise HistoryError(f"--state: {exc}") from None
    try:
        alerts = _alert_spans(state, run_id)
        actions = ActionStore(state).of_run(run_id, since=0.0)
    finally:
        state.close()
    return MonitorHistory(tuple(alerts), tuple(actions))


def _check_is_state(path: Path) -> None:
    """Read-only, before the monitor's own store opens it (which would add its tables to any
    SQLite file): ``path`` must be a monitor state database."""
    try:
        with contextlib.closing(
            sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        ) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
    except sqlite3.Error as exc:
        raise HistoryError(f"--state: {path}: {exc}") from None
    if not {"meta", "alert_events"} <= tables:
        raise HistoryError(f"--state: {path} is not a lossguard monitor state database")


def _alert_spans(state: AlertStore, run_id: str) -> list[AlertSpan]:
    firing: dict[tuple[str, str], AlertSpan] = {}
    spans: list[AlertSpan] = []
    after = 0
    while batch := state.events(after, PAGE):
        after = batch[-1].id
        for recorded in batch:
            transition = recorded.transition
            alert = transition.alert
            if alert.labels.get(RUN_LABEL) != run_id:
                continue
            key = (alert.rule, alert.fingerprint)
            if transition.kind is TransitionKind.FIRING:
                firing[key] = AlertSpan(
                    name=alert.labels.get(ALERT_NAME, alert.rule),
                    severity=alert.labels.get("severity", ""),
                    summary=alert.annotations.get("summary", ""),
                    fired_at=transition.at,
                    resolved_at=None,
                )
            elif transition.kind is TransitionKind.RESOLVED and key in firing:
                spans.append(dataclasses.replace(firing.pop(key), resolved_at=transition.at))
    spans.extend(firing.values())
    return sorted(spans, key=lambda span: span.fired_at)
