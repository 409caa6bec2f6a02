"""The notification tables of the state database: alert groups waiting to be flushed, what each
receiver was last told of each group (Alertmanager's notification log), and the outbox.

Every change the dispatcher makes in one step (events consumed, groups updated, notifications
queued) is one transaction, so a monitor killed at any moment neither loses nor repeats one."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lossguard.monitor.alert_store import AlertStore
from lossguard.monitor.notify.model import AlertInfo, Notification

_SCHEMA = """
CREATE TABLE IF NOT EXISTS notify_groups (
    group_id TEXT PRIMARY KEY,
    group_key TEXT NOT NULL,
    route TEXT NOT NULL,
    receiver TEXT NOT NULL,
    group_labels TEXT NOT NULL,
    created_at REAL NOT NULL,
    next_flush REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS notify_group_alerts (
    group_id TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    alert TEXT NOT NULL,
    PRIMARY KEY (group_id, fingerprint)
);
CREATE TABLE IF NOT EXISTS notify_log (
    group_id TEXT NOT NULL,
    lane TEXT NOT NULL,
    firing TEXT NOT NULL,
    at REAL NOT NULL,
    PRIMARY KEY (group_id, lane)
);
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at REAL NOT NULL,
    lane TEXT NOT NULL,
    notification TEXT NOT NULL,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt REAL NOT NULL,
    last_error TEXT,
    finished_at REAL
);
CREATE INDEX IF NOT EXISTS outbox_by_state ON outbox (state, lane, id);
"""
PENDING, DELIVERED, DEAD = "pending", "delivered", "dead"


@dataclass(frozen=True)
class Group:
    """An alert group waiting for its next flush: the alerts one route's group labels put
    together (``key`` is Alertmanager's group key; ``id`` tells apart sibling routes with the
    same matchers, as Alertmanager keeps a route's groups apart)."""

    id: str
    key: str
    route: str
    receiver: str
    labels: dict[str, str]
    next_flush: float


@dataclass(frozen=True)
class OutboxEntry:
    """One queued notification and how its delivery is going."""

    id: int
    created_at: float
    lane: str
    notification: Notification
    state: str
    attempts: int
    next_attempt: float
    last_error: str | None
    finished_at: float | None


class NotifyStore:
    """The notification tables, on the state database's connection."""

    def __init__(self, state: AlertStore) -> None:
        self.state = state
        with state.reading() as db:
            db.executescript(_SCHEMA)
            # start after the transitions of a database that predates notifications
            db.execute(
                "INSERT OR IGNORE INTO meta SELECT 'notify_cursor', COALESCE(MAX(id), 0)"
                " FROM alert_events"
            )

    # ------------------------------------------------------------------ the dispatcher's side

    @staticmethod
    def cursor(db: sqlite3.Connection) -> int:
        """The id of the last alert event the dispatcher consumed."""
        return int(db.execute("SELECT value FROM meta WHERE key = 'notify_cursor'").fetchone()[0])

    @staticmethod
    def set_cursor(db: sqlite3.Connection, event_id: int) -> None:
        db.execute("UPDATE meta SET value = ? WHERE key = 'notify_cursor'", (str(event_id),))

    @staticmethod
    def add_to_group(db: sqlite3.Connection, group: Group, alert: AlertInfo) -> None:
        """Put ``alert`` into ``group`` (created, flushing at ``group.next_flush``, if new)."""
        db.execute(
            "INSERT OR IGNORE INTO notify_groups VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                group.id,
                group.key,
                group.route,
                group.receiver,
                json.dumps(group.labels, sort_keys=True),
                group.next_flush,
                group.next_flush,
            ),
        )
        db.execute(
            "INSERT OR REPLACE INTO notify_group_alerts VALUES (?, ?, ?)",
            (group.id, alert.fingerprint, json.dumps(alert.to_json(), sort_keys=True)),
        )

    @staticmethod
    def resolve_everywhere(db: sqlite3.Connection, alert: AlertInfo) -> None:
        """Mark ``alert`` resolved in every group that holds it."""
        db.execute(
            "UPDATE notify_group_alerts SET alert = ? WHERE fingerprint = ?",
            (json.dumps(alert.to_json(), sort_keys=True), alert.fingerprint),
        )

    @staticmethod
    def due_groups(db: sqlite3.Connection, now: float) -> list[Group]:
        rows = db.execute(
            "SELECT group_id, group_key, route, receiver, group_labels, next_flush"
            " FROM notify_groups WHERE next_flush <= ? ORDER BY next_flush, group_id",
            (now,),
        ).fetchall()
        return [Group(i, k, r, rc, json.loads(gl), nf) for i, k, r, rc, gl, nf in rows]

    @staticmethod
    def next_flush(db: sqlite3.Connection) -> float | None:
        value = db.execute("SELECT MIN(next_flush) FROM notify_groups").fetchone()[0]
        return None if value is None else float(value)

    @staticmethod
    def group_alerts(db: sqlite3.Connection, group_id: str) -> list[AlertInfo]:
        rows = db.execute(
            "SELECT alert FROM notify_group_alerts WHERE group_id = ?", (group_id,)
        ).fetchall()
        alerts = [AlertInfo.from_json(json.loads(r[0])) for r in rows]
        return sorted(alerts, key=lambda a: (a.starts_at, a.fingerprint))

    @staticmethod
    def told(db: sqlite3.Connection, group_id: str, lane: str) -> tuple[set[str], float] | None:
        """The fingerprints ``lane`` was last told are firing in the group, and when."""
        row = db.execute(
            "SELECT firing, at FROM notify_log WHERE group_id = ? AND lane = ?", (group_id, lane)
        ).fetchone()
        return None if row is None else (set(json.loads(row[0])), float(row[1]))

    @staticmethod
    def set_told(
        db: sqlite3.Connection, group_id: str, lane: str, firing: Iterable[str], at: float
    ) -> None:
        db.execute(
            "INSERT OR REPLACE INTO notify_log VALUES (?, ?, ?, ?)",
            (group_id, lane, json.dumps(sorted(firing)), at),
        )

    @staticmethod
    def queue(db: sqlite3.Connection, notification: Notification) -> int:
        """Write ``notification`` to the outbox; its id."""
        cur = db.execute(
            "INSERT INTO outbox (created_at, lane, notification, state, next_attempt)"
            " VALUES (?, ?, ?, ?, ?)",
            (
                notification.created_at,
                notification.lane,
                notification.to_json(),
                PENDING,
                notification.created_at,
            ),
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    @staticmethod
    def finish_flush(
        db: sqlite3.Connection, group: Group, resolved: Iterable[str], next_flush: float
    ) -> None:
        """Drop the group's resolved alerts (told or not, they are done); drop the group once
        empty, else schedule its next flush."""
        db.executemany(
            "DELETE FROM notify_group_alerts WHERE group_id = ? AND fingerprint = ?",
            [(group.id, fp) for fp in resolved],
        )
        left = db.execute(
            "SELECT COUNT(*) FROM notify_group_alerts WHERE group_id = ?", (group.id,)
        ).fetchone()[0]
        if left:
            db.execute(
                "UPDATE notify_groups SET next_flush = ? WHERE group_id = ?",
                (next_flush, group.id),
            )
        else:
            NotifyStore.drop_group(db, group.id)

    @staticmethod
    def drop_group(db: sqlite3.Connection, group_id: str) -> None:
        for table in ("notify_groups", "notify_group_alerts", "notify_log"):
            db.execute(f"DELETE FROM {table} WHERE group_id = ?", (group_id,))

    @staticmethod
    def prune(db: sqlite3.Connection, before: float) -> None:
        """Forget notifications delivered before ``before``, and alert events from then that
        were consumed; dead letters stay for the operator."""
        db.execute("DELETE FROM outbox WHERE state = ? AND finished_at < ?", (DELIVERED, before))
        db.execute(
            "DELETE FROM alert_events WHERE at < ? AND id <= ?", (before, NotifyStore.cursor(db))
        )

    # ------------------------------------------------------------------ the delivery side

    def next_pending(self, lane: str) -> OutboxEntry | None:
        """The oldest undelivered notification of ``lane``: lanes deliver in order."""
        with self.state.reading() as db:
            row = db.execute(
                f"SELECT {_ENTRY_COLUMNS} FROM outbox WHERE state = ? AND lane = ?"
                " ORDER BY id LIMIT 1",
                (PENDING, lane),
            ).fetchone()
        return None if row is None else _entry(row)

    def pending_lanes(self) -> set[str]:
        with self.state.reading() as db:
            rows = db.execute("SELECT DISTINCT lane FROM outbox WHERE state = ?", (PENDING,))
            return {r[0] for r in rows.fetchall()}

    def delivered(self, entry_id: int, at: float) -> None:
        with self.state.transaction() as db:
            db.execute(
                "UPDATE outbox SET state = ?, attempts = attempts + 1, finished_at = ?,"
                " last_error = NULL WHERE id = ?",
                (DELIVERED, at, entry_id),
            )

    def failed(self, entry_id: int, error: str, retry_at: float | None, at: float) -> None:
        """A failed attempt: retried at ``retry_at``, or dead (``retry_at`` None)."""
        with self.state.transaction() as db:
            if retry_at is None:
                db.execute(
                    "UPDATE outbox SET state = ?, attempts = attempts + 1, last_error = ?,"
                    " finished_at = ? WHERE id = ?",
                    (DEAD, error, at, entry_id),
                )
            else:
                db.execute(
                    "UPDATE outbox SET attempts = attempts + 1, last_error = ?, next_attempt = ?"
                    " WHERE id = ?",
                    (error, retry_at, entry_id),
                )

    def requeue(self, entry_ids: list[int], now: float) -> dict[int, int]:
        """Dead letters back to the end of the outbox, to be tried now: old id -> new id, for
        the ids that were dead (a new id: it goes after what is already waiting)."""
        moved: dict[int, int] = {}
        with self.state.transaction() as db:
            for entry_id in entry_ids:
                cur = db.execute(
                    "INSERT INTO outbox (created_at, lane, notification, state, next_attempt)"
                    " SELECT created_at, lane, notification, ?, ? FROM outbox"
                    " WHERE id = ? AND state = ?",
                    (PENDING, now, entry_id, DEAD),
                )
                if cur.rowcount and cur.lastrowid is not None:
                    db.execute("DELETE FROM outbox WHERE id = ?", (entry_id,))
                    moved[entry_id] = cur.lastrowid
        return moved

    def drop(self, entry_ids: list[int]) -> list[int]:
        """Forget dead letters; the ids that were dead."""
        with self.state.transaction() as db:
            return [
                entry_id
                for entry_id in entry_ids
                if db.execute(
                    "DELETE FROM outbox WHERE id = ? AND state = ?", (entry_id, DEAD)
                ).rowcount
            ]

    def entries(self, state: str, limit: int = 100) -> list[OutboxEntry]:
        """Outbox entries in ``state``, newest first."""
        with self.state.reading() as db:
            rows = db.execute(
                f"SELECT {_ENTRY_COLUMNS} FROM outbox WHERE state = ? ORDER BY id DESC LIMIT ?",
                (state, limit),
            ).fetchall()
        return [_entry(r) for r in rows]

    def counts(self) -> dict[str, int]:
        """Outbox entries by state."""
        with self.state.reading() as db:
            rows = db.execute("SELECT state, COUNT(*) FROM outbox GROUP BY state").fetchall()
        return {PENDING: 0, DELIVERED: 0, DEAD: 0, **{s: n for s, n in rows}}


_ENTRY_COLUMNS = (
    "id, created_at, lane, notification, state, attempts, next_attempt, last_error, finished_at"
)


def _entry(row: tuple[Any, ...]) -> OutboxEntry:
    id_, created, lane, notification, state, attempts, next_attempt, error, finished = row
    return OutboxEntry(
        id_,
        created,
        lane,
        Notification.from_json(notification),
        state,
        attempts,
        next_attempt,
        error,
        finished,
    )
