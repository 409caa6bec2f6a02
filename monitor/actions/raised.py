"""The alerts the monitor raises itself, not from a rule: pages that fire until their problem
ends (RollbacksExhausted, ActionFailed) and announcements that fire for a fixed time
(ActionTaken).

They enter the notification pipeline as any rule's alert does, as transitions in the state
database; the firing ones are kept in their own table, so a restart neither forgets nor repeats
them. Each has a ``key`` (one alert per key at a time) and a ``cause``: the run and the alert name
or action kind whose firing keeps a page open (announcements have none)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from lossguard.monitor.alert_store import AlertStore
from lossguard.monitor.rules.alerting import (
    ALERT_NAME,
    Alert,
    AlertState,
    Transition,
    TransitionKind,
    fingerprint,
)

RULE_GROUP = "lossguard-actions"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS raised_alerts (
    key TEXT PRIMARY KEY,
    labels TEXT NOT NULL,
    annotations TEXT NOT NULL,
    value REAL NOT NULL,
    fired_at REAL NOT NULL,
    cause TEXT NOT NULL,
    until REAL
);
"""
# RollbacksExhausted pages of a state database from before this table
_MIGRATE = """
INSERT OR IGNORE INTO raised_alerts
    SELECT 'RollbacksExhausted/' || run_id, labels, annotations, value, fired_at,
           json_object('run_id', run_id, 'action', 'rollback'), NULL
    FROM exhausted_pages;
DROP TABLE exhausted_pages;
"""


@dataclass(frozen=True)
class Cause:
    """What keeps a page open: a firing alert of ``run_id`` named ``alertname`` or asking for
    ``action`` (whichever is set)."""

    run_id: str
    alertname: str = ""
    action: str = ""

    def holds(self, firing: Iterable[Mapping[str, str]]) -> bool:
        return any(
            labels.get("run_id") == self.run_id
            and (not self.alertname or labels.get(ALERT_NAME) == self.alertname)
            and (not self.action or labels.get("action") == self.action)
            for labels in firing
        )


@dataclass(frozen=True)
class Raised:
    """One firing raised alert."""

    key: str
    alert: Alert
    cause: Cause | None
    until: float | None  # an announcement's end; None: while its cause holds


class RaisedAlerts:
    """Raises and resolves the monitor's own alerts."""

    def __init__(self, state: AlertStore) -> None:
        self.state = state
        with state.transaction() as db:
            db.execute(_SCHEMA)
            old = db.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'exhausted_pages'"
            ).fetchone()
            if old:
                for statement in filter(str.strip, _MIGRATE.split(";")):
                    db.execute(statement)

    def raise_alert(
        self,
        key: str,
        labels: Mapping[str, str],
        annotations: Mapping[str, str],
        value: float,
        now: float,
        *,
        cause: Cause | None = None,
        hold_s: float | None = None,
    ) -> bool:
        """Fire an alert under ``key``: a page until :meth:`resolve_quiet` finds its ``cause``
        gone, or an announcement for ``hold_s``. False: one fires under the key already."""
        alert = _alert(dict(labels), dict(annotations), value, now)
        until = None if hold_s is None else now + hold_s
        with self.state.transaction() as db:
            inserted = db.execute(
                "INSERT OR IGNORE INTO raised_alerts VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    key,
                    json.dumps(alert.labels),
                    json.dumps(alert.annotations),
                    value,
                    now,
                    json.dumps(None if cause is None else cause.__dict__),
                    until,
                ),
            ).rowcount
            if inserted:
                AlertStore.append_events(db, [Transition(TransitionKind.FIRING, now, alert)])
        return bool(inserted)

    def resolve_quiet(self, firing: Iterable[Mapping[str, str]], now: float) -> list[Raised]:
        """Resolve the pages whose cause no firing alert (``firing``: their labels) holds any
        more, and the announcements whose time is up; those resolved."""
        firing = list(firing)
        ended = [
            r
            for r in self.firing()
            if (r.until is not None and r.until <= now)
            or (r.cause is not None and not r.cause.holds(firing))
        ]
        if ended:
            with self.state.transaction() as db:
                for raised in ended:
                    transition = Transition(TransitionKind.RESOLVED, now, raised.alert)
                    AlertStore.append_events(db, [transition])
                    db.execute("DELETE FROM raised_alerts WHERE key = ?", (raised.key,))
        return ended

    def firing(self) -> list[Raised]:
        """The raised alerts firing now, oldest first."""
        with self.state.reading() as db:
            rows = db.execute(
                "SELECT key, labels, annotations, value, fired_at, cause, until"
                " FROM raised_alerts ORDER BY fired_at, key"
            ).fetchall()
        return [
            Raised(
                key=key,
                alert=_alert(json.loads(labels), json.loads(annotations), value, fired_at),
                cause=None if (found := json.loads(cause)) is None else Cause(**found),
                until=until,
            )
            for key, labels, annotations, value, fired_at, cause, until in rows
        ]

    def next_end(self) -> float | None:
        """When the next announcement ends (None: none fires)."""
        with self.state.reading() as db:
            (until,) = db.execute("SELECT MIN(until) FROM raised_alerts").fetchone()
        return until


def _alert(labels: dict[str, str], annotations: dict[str, str], value: float, at: float) -> Alert:
    return Alert(
        rule=f"{RULE_GROUP}/{labels.get(ALERT_NAME, '')}",
        fingerprint=fingerprint(labels),
        labels=dict(sorted(labels.items())),
        annotations=annotations,
        state=AlertState.FIRING,
        value=value,
        active_at=at,
        fired_at=at,
    )
