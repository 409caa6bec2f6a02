"""AlertStore: the monitor's SQLite database (WAL, config ``state.path``) of active alerts and
their transitions; the outbox, silences and actions stores keep their tables in it too.

Everything one evaluation changed is written in one transaction, so a monitor killed at any
moment restarts with the alerts exactly as one evaluation left them, and announces no transition
twice. Values are stored as text so NaN and infinities survive.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lossguard.monitor.rules.alerting import Alert, AlertState, Transition, TransitionKind

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS alerts (
    fingerprint TEXT NOT NULL,
    rule TEXT NOT NULL,
    labels TEXT NOT NULL,
    annotations TEXT NOT NULL,
    state TEXT NOT NULL,
    value TEXT NOT NULL,
    active_at REAL NOT NULL,
    fired_at REAL,
    keep_firing_since REAL,
    PRIMARY KEY (rule, fingerprint)
);
CREATE TABLE IF NOT EXISTS alert_events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    rule TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    labels TEXT NOT NULL,
    annotations TEXT NOT NULL,
    value TEXT NOT NULL,
    active_at REAL NOT NULL,
    fired_at REAL
);
"""


class AlertStoreError(Exception):
    """The monitor's database cannot be used (one line)."""


@dataclass(frozen=True)
class AlertEvent:
    """One recorded transition and its place in the log."""

    id: int
    transition: Transition


def value_text(value: float) -> str:
    """A float as text that ``float()`` reads back, NaN and infinities included."""
    return "NaN" if math.isnan(value) else repr(value)


class AlertStore:
    """Active alerts and alert events in the database ``path`` (created, with its folder, when
    missing); ``transaction()`` and ``reading()`` lend its connection to the other stores."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.touch(mode=0o600)  # owner-only; SQLite gives its -wal and -shm the same mode
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: safe against a killed process
            self._db.execute("PRAGMA busy_timeout=5000")  # another reader or writer: wait
            self._db.executescript(_SCHEMA)
            self._check_version()
        except (OSError, ValueError, sqlite3.Error) as exc:
            raise AlertStoreError(f"state database {path}: {exc}") from None
        # reentrant: a read inside a transaction (the dispatcher annotating the alerts it flushes
        # with their actions) uses the same connection on the same thread
        self._lock = threading.RLock()

    def _check_version(self) -> None:
        row = self._db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        if row is None:
            self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        elif int(row[0]) != SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"schema version {row[0]}, expected {SCHEMA_VERSION}")

    def load_alerts(self) -> dict[str, list[Alert]]:
        """The active alerts, by rule key."""
        by_rule: dict[str, list[Alert]] = {}
        with self._lock:
            rows = self._db.execute(
                "SELECT rule, fingerprint, labels, annotations, state, value, active_at,"
                " fired_at, keep_firing_since FROM alerts ORDER BY rule, fingerprint"
            ).fetchall()
        for row in rows:
            by_rule.setdefault(row[0], []).append(_alert(*row))
        return by_rule

    def record(
        self,
        alerts: Mapping[str, Iterable[Alert]],
        transitions: Iterable[Transition],
        *,
        evaluated_at: float | None = None,
    ) -> None:
        """Replace the active alerts of the rules in ``alerts``, append ``transitions`` and note
        the evaluation time, in one transaction."""
        with self.transaction() as db:
            for rule, current in alerts.items():
                db.execute("DELETE FROM alerts WHERE rule = ?", (rule,))
                db.executemany(
                    "INSERT INTO alerts VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [_alert_row(a) for a in current],
                )
            self.append_events(db, transitions)
            if evaluated_at is not None:
                db.execute(
                    "INSERT OR REPLACE INTO meta VALUES ('last_evaluation', ?)",
                    (repr(evaluated_at),),
                )

    @staticmethod
    def append_events(db: sqlite3.Connection, transitions: Iterable[Transition]) -> None:
        """Append ``transitions`` to the alert event log (inside the caller's transaction)."""
        db.executemany(
            "INSERT INTO alert_events (at, kind, rule, fingerprint, labels, annotations,"
            " value, active_at, fired_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [_event_row(t) for t in transitions],
        )

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """The connection inside one write transaction: all of it commits, or none of it."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    @contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        """The connection, for reads, while no other thread uses it."""
        with self._lock:
            yield self._db

    def last_evaluation(self) -> float | None:
        """When the last evaluation was recorded (None before any)."""
        value = self.get_meta("last_evaluation")
        return None if value is None else float(value)

    def get_meta(self, key: str) -> str | None:
        with self.reading() as db:
            row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def events(self, after_id: int = 0, limit: int = 1000) -> list[AlertEvent]:
        """Recorded transitions with ids above ``after_id``, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, at, kind, rule, fingerprint, labels, annotations, value, active_at,"
                " fired_at FROM alert_events WHERE id > ? ORDER BY id LIMIT ?",
                (after_id, limit),
            ).fetchall()
        return [_event(row) for row in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _alert_row(alert: Alert) -> tuple[Any, ...]:
    return (
        alert.fingerprint,
        alert.rule,
        json.dumps(alert.labels, sort_keys=True),
        json.dumps(alert.annotations, sort_keys=True),
        alert.state.value,
        value_text(alert.value),
        alert.active_at,
        alert.fired_at,
        alert.keep_firing_since,
    )


def _event_row(transition: Transition) -> tuple[Any, ...]:
    alert = transition.alert
    return (
        transition.at,
        transition.kind.value,
        alert.rule,
        alert.fingerprint,
        json.dumps(alert.labels, sort_keys=True),
        json.dumps(alert.annotations, sort_keys=True),
        value_text(alert.value),
        alert.active_at,
        alert.fired_at,
    )


def _event(row: tuple[Any, ...]) -> AlertEvent:
    id_, at, kind, rule, fp, labels, annotations, value, active_at, fired_at = row
    state = AlertState.FIRING if fired_at is not None else AlertState.PENDING
    alert = _alert(rule, fp, labels, annotations, state.value, value, active_at, fired_at, None)
    return AlertEvent(id_, Transition(TransitionKind(kind), at, alert))


def _alert(
    rule: str,
    fingerprint: str,
    labels: str,
    annotations: str,
    state: str,
    value: str,
    active_at: float,
    fired_at: float | None,
    keep_firing_since: float | None,
) -> Alert:
    """An alert from its stored columns (labels and annotations as JSON, value as text)."""
    return Alert(
        rule=rule,
        fingerprint=fingerprint,
        labels=json.loads(labels),
        annotations=json.loads(annotations),
        state=AlertState(state),
        value=float(value),
        active_at=active_at,
        fired_at=fired_at,
        keep_firing_since=keep_firing_since,
    )
