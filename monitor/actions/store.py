"""Actions in the monitor's state database: each one recorded before it is sent, so a monitor
killed at any moment sends it again, with the same request id, when it restarts."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from lossguard.monitor.actions.model import ActionRecord, ActionState, dumps
from lossguard.monitor.alert_store import AlertStore

_SCHEMA = """
CREATE TABLE IF NOT EXISTS actions (
    id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    alertname TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    labels TEXT NOT NULL,
    origin TEXT NOT NULL,
    args TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    attempt INTEGER,
    of_attempts INTEGER,
    reason TEXT NOT NULL,
    result TEXT NOT NULL,
    tries INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS actions_by_run ON actions (run_id, kind, created_at);
CREATE INDEX IF NOT EXISTS actions_by_fingerprint ON actions (fingerprint);
"""
_COLUMNS = (
    "id, run_id, kind, alertname, fingerprint, labels, origin, args, state, created_at, "
    "updated_at, attempt, of_attempts, reason, result, tries"
)


class ActionStore:
    """The ``actions`` table, on the state database's connection."""

    def __init__(self, state: AlertStore) -> None:
        self.state = state
        with state.reading() as db:
            db.executescript(_SCHEMA)

    def add(self, record: ActionRecord) -> bool:
        """Record a new action, or decide one a silence held back; False when its id is
        recorded already otherwise (nothing changed)."""
        updates = ", ".join(f"{c} = excluded.{c}" for c in _COLUMNS.split(", ") if c != "id")
        with self.state.transaction() as db:
            cursor = db.execute(
                f"INSERT INTO actions ({_COLUMNS}) VALUES"
                " (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                f" ON CONFLICT (id) DO UPDATE SET {updates} WHERE actions.state = 'held'",
                _row(record),
            )
            return cursor.rowcount == 1

    def update(
        self,
        action_id: str,
        state: ActionState,
        at: float,
        *,
        reason: str | None = None,
        result: dict[str, Any] | None = None,
        tried: bool = False,
    ) -> None:
        with self.state.transaction() as db:
            db.execute(
                "UPDATE actions SET state = ?, updated_at = ?, reason = COALESCE(?, reason),"
                " result = COALESCE(?, result), tries = tries + ? WHERE id = ?",
                (
                    state,
                    at,
                    reason,
                    None if result is None else dumps(result),
                    int(tried),
                    action_id,
                ),
            )

    def get(self, action_id: str) -> ActionRecord | None:
        found = self._select("WHERE id = ?", (action_id,))
        return found[0] if found else None

    def open(self) -> list[ActionRecord]:
        """Actions held back or waiting to be sent, oldest first."""
        return self._select("WHERE state IN ('held', 'pending') ORDER BY created_at, rowid", ())

    def of_run(self, run_id: str, since: float, kind: str | None = None) -> list[ActionRecord]:
        """The run's actions (of ``kind``) created at ``since`` or later, oldest first."""
        if kind is None:
            return self._select(
                "WHERE run_id = ? AND created_at >= ? ORDER BY created_at, rowid", (run_id, since)
            )
        return self._select(
            "WHERE run_id = ? AND kind = ? AND created_at >= ? ORDER BY created_at, rowid",
            (run_id, kind, since),
        )

    def of_alert(self, fingerprint: str) -> list[ActionRecord]:
        """Every action taken for alerts with this fingerprint, oldest first."""
        return self._select("WHERE fingerprint = ? ORDER BY created_at, rowid", (fingerprint,))

    def recent(self, limit: int = 50) -> list[ActionRecord]:
        """The newest actions, newest first."""
        return self._select("ORDER BY created_at DESC, rowid DESC LIMIT ?", (limit,))

    def _select(self, where: str, params: tuple[Any, ...]) -> list[ActionRecord]:
        with self.state.reading() as db:
            rows = db.execute(f"SELECT {_COLUMNS} FROM actions {where}", params).fetchall()
        return [_record(row) for row in rows]

    @staticmethod
    def prune(db: sqlite3.Connection, before: float) -> None:
        """Forget finished actions last changed before ``before``."""
        db.execute(
            "DELETE FROM actions WHERE state NOT IN ('held', 'pending') AND updated_at < ?",
            (before,),
        )


def _row(record: ActionRecord) -> tuple[Any, ...]:
    return (
        record.id,
        record.run_id,
        record.kind,
        record.alertname,
        record.fingerprint,
        dumps(record.labels),
        record.origin,
        dumps(record.args),
        record.state,
        record.created_at,
        record.updated_at,
        record.attempt,
        record.of_attempts,
        record.reason,
        dumps(record.result),
        record.tries,
    )


def _record(row: tuple[Any, ...]) -> ActionRecord:
    (id_, run_id, kind, alertname, fingerprint, labels, origin, args, state) = row[:9]
    created_at, updated_at, attempt, of_attempts, reason, result, tries = row[9:]
    return ActionRecord(
        id=id_,
        run_id=run_id,
        kind=kind,
        alertname=alertname,
        fingerprint=fingerprint,
        labels=json.loads(labels),
        origin=origin,
        args=json.loads(args),
        state=state,
        created_at=created_at,
        updated_at=updated_at,
        attempt=attempt,
        of_attempts=of_attempts,
        reason=reason,
        result=json.loads(result),
        tries=tries,
    )
