"""Silences, as Alertmanager's: label matchers and a time window during which matching alerts
are not sent. Created, listed and expired with ``lossguard-monitor silence``; kept in the state
database, so they survive restarts and the running monitor sees them at its next flush."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lossguard.monitor.alert_store import AlertStore
from lossguard.monitor.notify.matchers import Matcher, matches_all, parse_matchers

_SCHEMA = """
CREATE TABLE IF NOT EXISTS silences (
    id TEXT PRIMARY KEY,
    matchers TEXT NOT NULL,
    starts_at REAL NOT NULL,
    ends_at REAL NOT NULL,
    created_by TEXT NOT NULL,
    comment TEXT NOT NULL,
    updated_at REAL NOT NULL
);
"""
SilenceState = Literal["pending", "active", "expired"]


class SilenceError(ValueError):
    """A silence that cannot be added or expired (one line)."""


@dataclass(frozen=True)
class Silence:
    id: str
    matchers: tuple[Matcher, ...]
    starts_at: float
    ends_at: float
    created_by: str
    comment: str
    updated_at: float

    def state(self, now: float) -> SilenceState:
        if now >= self.ends_at:
            return "expired"
        return "active" if now >= self.starts_at else "pending"

    def mutes(self, labels: Mapping[str, str], now: float) -> bool:
        return self.state(now) == "active" and matches_all(self.matchers, labels)


class SilenceStore:
    """Silences in the state database."""

    def __init__(self, state: AlertStore) -> None:
        self.state = state
        with state.reading() as db:
            db.executescript(_SCHEMA)

    def add(
        self,
        matchers: Sequence[str],
        starts_at: float,
        ends_at: float,
        created_by: str,
        comment: str,
        now: float,
    ) -> Silence:
        """A new silence (SilenceError when it could never mute anything)."""
        parsed = tuple(parse_matchers(matchers))
        if not parsed:
            raise SilenceError("a silence needs at least one matcher, e.g. alertname=LossSpike")
        if all(m.matches({}) for m in parsed):
            raise SilenceError("matchers must not all match the empty label set")
        if ends_at <= starts_at:
            raise SilenceError("the silence must end after it starts")
        if ends_at <= now:
            raise SilenceError("the silence would already be expired")
        if not created_by.strip() or not comment.strip():
            raise SilenceError("a silence needs an author and a comment")
        silence = Silence(str(uuid.uuid4()), parsed, starts_at, ends_at, created_by, comment, now)
        with self.state.transaction() as db:
            db.execute(
                "INSERT INTO silences VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    silence.id,
                    json.dumps([str(m) for m in parsed]),
                    starts_at,
                    ends_at,
                    created_by,
                    comment,
                    now,
                ),
            )
        return silence

    def expire(self, silence_id: str, now: float) -> Silence:
        """End a silence now (a pending one is ended before it starts)."""
        with self.state.transaction() as db:
            row = db.execute(f"SELECT {_COLUMNS} FROM silences WHERE id = ?", (silence_id,))
            found = row.fetchone()
            if found is None:
                raise SilenceError(f"no silence with id {silence_id!r}")
            silence = _silence(found)
            if silence.state(now) == "expired":
                raise SilenceError(f"silence {silence_id} has already expired")
            db.execute(
                "UPDATE silences SET ends_at = ?, starts_at = MIN(starts_at, ?), updated_at = ?"
                " WHERE id = ?",
                (now, now, now, silence_id),
            )
        return _silence((silence_id, found[1], min(silence.starts_at, now), now, *found[4:6], now))

    def all(self) -> list[Silence]:
        """Every silence, newest first."""
        with self.state.reading() as db:
            rows = db.execute(f"SELECT {_COLUMNS} FROM silences ORDER BY updated_at DESC")
            return [_silence(r) for r in rows.fetchall()]

    def active(self, now: float) -> list[Silence]:
        with self.state.reading() as db:
            rows = db.execute(
                f"SELECT {_COLUMNS} FROM silences WHERE starts_at <= ? AND ends_at > ?",
                (now, now),
            )
            return [_silence(r) for r in rows.fetchall()]


_COLUMNS = "id, matchers, starts_at, ends_at, created_by, comment, updated_at"


def _silence(row: tuple[Any, ...]) -> Silence:
    id_, matchers, starts, ends, author, comment, updated = row
    return Silence(
        id_, tuple(parse_matchers(json.loads(matchers))), starts, ends, author, comment, updated
    )
