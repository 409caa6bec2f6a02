"""What the demo watches while it runs, read as it grows: the agent's metrics log and audit
trail, and the monitor's state database (alert transitions, actions, delivered notifications).
Each poll returns what happened since the last one, in words, and keeps it all for the
summary."""

from __future__ import annotations

import contextlib
import sqlite3
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lossguard.common.rundir.events import CHECKPOINT, DETECTIONS, FAULT, ROLLBACK
from lossguard.common.rundir.jsonl import JsonlFollower
from lossguard.common.rundir.paths import RunPaths
from lossguard.monitor.actions.describe import describe, diagnosis_text
from lossguard.monitor.actions.model import ActionRecord
from lossguard.monitor.actions.outcomes import ANNOUNCED_STATES, TAKEN
from lossguard.monitor.actions.store import ActionStore
from lossguard.monitor.alert_store import AlertStore
from lossguard.monitor.notify.integrations.pagerduty import summary as pagerduty_summary
from lossguard.monitor.notify.integrations.slack import fallback_text
from lossguard.monitor.notify.model import AlertInfo, announcement
from lossguard.monitor.notify.store import DEAD, DELIVERED, NotifyStore, OutboxEntry
from lossguard.monitor.rules.alerting import ALERT_NAME, TransitionKind

Tone = Literal["info", "warn", "bad", "good"]
SPARK_POINTS = 60
ALERT_TONES: dict[str, Tone] = {"pending": "warn", "firing": "bad", "resolved": "good"}
SERVICES = {"slack": "Slack", "pagerduty": "PagerDuty", "webhook": "webhook"}


@dataclass(frozen=True)
class Happening:
    """One thing the view tells: when, what kind, in words."""

    at: float
    kind: str  # run | alert | action | notification
    text: str
    tone: Tone = "info"


@dataclass(frozen=True)
class AlertChange:
    """One alert transition the monitor recorded."""

    at: float
    name: str
    kind: str  # pending | firing | resolved | inactive
    severity: str
    summary: str


@dataclass(frozen=True)
class Sent:
    """One notification the monitor delivered (or gave up on), and the alerts it told of by
    name: firing, resolved, and announcements (``announce="once"``: told once, never as
    resolved), with the ids of the actions it announced (ActionTaken)."""

    at: float
    service: str  # Slack | PagerDuty | webhook
    receiver: str
    text: str
    delivered: bool
    firing: tuple[str, ...] = ()
    resolved: tuple[str, ...] = ()
    announced: tuple[str, ...] = ()
    action_ids: tuple[str, ...] = ()


@dataclass
class RunStatus:
    """The run as its metrics log last told it."""

    step: int | None = None
    train_loss: float | None = None
    val_loss: float | None = None
    val_step: int | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    memory_bytes: float | None = None
    losses: deque[float] = field(default_factory=lambda: deque(maxlen=SPARK_POINTS))


class Watcher:
    """Polls the run directory and the monitor's state database (once the monitor has
    started: its ``listen_url`` is recorded)."""

    def __init__(self, run_dir: Path, state_db: Path) -> None:
        self.state_db = state_db
        self.records: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.alerts: list[AlertChange] = []
        self.actions: dict[str, ActionRecord] = {}
        self.sent: list[Sent] = []
        self.status = RunStatus()
        self.monitor_url: str | None = None
        paths = RunPaths.of(run_dir)
        self._metrics = JsonlFollower(paths.metrics)
        self._audit = JsonlFollower(paths.events)
        self._state: AlertStore | None = None
        self._action_store: ActionStore | None = None
        self._notify_store: NotifyStore | None = None
        self._after_event = 0
        self._outbox_seen: set[int] = set()
        self._last_healthy: bool | None = None
        self._troubles: set[tuple[str, str]] = set()

    def poll(self) -> list[Happening]:
        found = self._read_metrics() + self._read_events()
        if self._connect():
            found += self._read_alerts() + self._read_actions() + self._read_outbox()
        return sorted(found, key=lambda h: h.at)

    def close(self) -> None:
        if self._state is not None:
            self._state.close()
            self._state = self._action_store = self._notify_store = None

    def firing(self) -> list[str]:
        """The alerts pending or firing now, as ``Name (state)``."""
        now: dict[str, str] = {}
        for change in self.alerts:
            if change.kind in ("pending", "firing"):
                now[change.name] = change.kind
            else:
                now.pop(change.name, None)
        return [f"{name} ({state})" for name, state in now.items()]

    def unannounced(self) -> list[ActionRecord]:
        """The actions applied (or dry run) whose announcement (ActionTaken) no delivered
        notification has told yet."""
        told = {i for s in self.sent if s.delivered for i in s.action_ids}
        return [
            a for a in self.actions.values() if a.state in ANNOUNCED_STATES and a.id not in told
        ]

    def outbox_pending(self) -> int | None:
        """Notifications waiting to be delivered (None: the monitor has not started)."""
        if self._notify_store is None:
            return None
        return self._notify_store.counts()["pending"]

    # ------------------------------------------------------------------ the agent's side

    def _read_metrics(self) -> list[Happening]:
        found = []
        for record in self._metrics.read():
            self.records.append(record)
            status = self.status
            if record.get("kind") == "eval":
                status.val_loss, status.val_step = record.get("val_loss"), record.get("step")
                found.append(
                    Happening(
                        record["time"],
                        "run",
                        f"step {record['step']}: validation loss {status.val_loss:.4g}",
                    )
                )
                continue
            status.step = record.get("step")
            status.train_loss = record.get("train_loss")
            status.tokens_per_second = record.get("tokens_per_second")
            status.mfu = record.get("mfu")
            memory = record.get("memory")
            status.memory_bytes = memory.get("allocated") if isinstance(memory, dict) else None
            if isinstance(status.train_loss, int | float):
                status.losses.append(float(status.train_loss))
        return found

    def _read_events(self) -> list[Happening]:
        found = []
        for event in self._audit.read():
            self.events.append(event)
            told = self._tell(event)
            if told is not None:
                found.append(told)
        return found

    def _tell(self, event: dict[str, Any]) -> Happening | None:
        kind, at, step = event.get("event"), event["time"], event.get("step")
        if kind == FAULT:
            return Happening(at, "run", f"step {step}: injected fault: {_fault(event)}", "bad")
        if kind == ROLLBACK:
            self._troubles.clear()  # a new timeline: its first trouble is news again
        if kind in DETECTIONS and isinstance(event.get("diagnosis"), dict):
            trouble = (kind, str(event.get("signal")))
            if trouble not in self._troubles:  # the first of each kind: the agent repeats it
                self._troubles.add(trouble)
                return Happening(at, "run", diagnosis_text(event["diagnosis"]), "warn")
        if kind == CHECKPOINT:
            healthy = bool(event.get("healthy"))
            changed = healthy != self._last_healthy
            self._last_healthy = healthy
            if changed:
                how = (
                    "healthy"
                    if healthy
                    else "unhealthy (inside a spike episode or after a non-finite value)"
                )
                return Happening(at, "run", f"step {step}: checkpoint {event['name']} {how}")
        if kind == "close":
            return Happening(at, "run", f"step {step}: the run ended", "info")
        return None

    # ------------------------------------------------------------------ the monitor's side

    def _connect(self) -> bool:
        """Open the state database once the monitor has started (never before: opening it
        first would race the monitor's own set-up)."""
        if self._state is not None:
            return True
        url = _listen_url(self.state_db)
        if url is None:
            return False
        self.monitor_url = url
        self._state = AlertStore(self.state_db)
        self._action_store = ActionStore(self._state)
        self._notify_store = NotifyStore(self._state)
        return True

    def _read_alerts(self) -> list[Happening]:
        assert self._state is not None
        found = []
        for recorded in self._state.events(self._after_event):
            self._after_event = recorded.id
            transition = recorded.transition
            alert = transition.alert
            change = AlertChange(
                at=transition.at,
                name=alert.labels.get(ALERT_NAME, alert.rule),
                kind=transition.kind.value,
                severity=alert.labels.get("severity", ""),
                summary=alert.annotations.get("summary", ""),
            )
            self.alerts.append(change)
            if transition.kind is TransitionKind.INACTIVE:
                continue
            text = f"alert {change.name} ({change.severity}) {change.kind}"
            if transition.kind is TransitionKind.FIRING and change.summary:
                text += f": {change.summary}"
            found.append(Happening(change.at, "alert", text, ALERT_TONES[change.kind]))
        return found

    def _read_actions(self) -> list[Happening]:
        assert self._action_store is not None
        found = []
        for record in reversed(self._action_store.recent()):
            before = self.actions.get(record.id)
            self.actions[record.id] = record
            if before is not None and before.state == record.state:
                continue
            tone: Tone = "good" if record.state == "applied" else "warn"
            text = f"action {record.kind} ({record.alertname}): {describe(record)}"
            found.append(Happening(record.updated_at, "action", text, tone))
        return found

    def _read_outbox(self) -> list[Happening]:
        store = self._notify_store
        assert store is not None
        entries = store.entries(DELIVERED) + store.entries(DEAD)
        found = []
        for entry in sorted(entries, key=lambda e: e.id):
            if entry.id in self._outbox_seen or entry.notification.integration == "log":
                continue
            self._outbox_seen.add(entry.id)
            sent = _sent(entry)
            self.sent.append(sent)
            verb = "->" if sent.delivered else "not delivered to"
            text = f"{verb} {sent.service} ({sent.receiver}): {sent.text}"
            found.append(Happening(sent.at, "notification", text, "info"))
        return found


def _fault(event: dict[str, Any]) -> str:
    kind = event["kind"]
    if kind == "lr_scale":
        return f"learning rate x{event['factor']:g}"
    if kind == "nonfinite_loss":
        steps = int(event.get("duration", 1))
        return "NaN loss" if steps == 1 else f"NaN losses for {steps} steps"
    if kind == "slow_step":
        return f"{event['duration']} steps slowed by {event['seconds']:g} s"
    return str(kind)


def _sent(entry: OutboxEntry) -> Sent:
    notification = entry.notification
    kind = notification.integration
    if kind == "pagerduty":  # one event for the group: a trigger while any alert fires
        action = "trigger" if notification.status == "firing" else "resolve"
        text = f"{action} {pagerduty_summary(notification)}"
    else:
        text = fallback_text(notification)
    if entry.state == DEAD:
        text += f" ({entry.last_error})"
    alerts = notification.alerts
    told = [a for a in alerts if not announcement(a.labels)]
    announced = [a for a in alerts if announcement(a.labels) and a.status == "firing"]
    return Sent(
        at=entry.finished_at or entry.created_at,
        service=SERVICES.get(kind, kind),
        receiver=notification.receiver,
        text=text,
        delivered=entry.state == DELIVERED,
        firing=_names(a for a in told if a.status == "firing"),
        resolved=_names(a for a in told if a.status == "resolved"),
        announced=_names(announced),
        action_ids=tuple(
            a.labels["action_id"] for a in announced if a.name == TAKEN and "action_id" in a.labels
        ),
    )


def _names(alerts: Iterable[AlertInfo]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(a.name for a in alerts))


def _listen_url(path: Path) -> str | None:
    """The running monitor's URL from its state database, read-only (None: not started)."""
    if not path.exists():
        return None
    with contextlib.suppress(sqlite3.Error):
        uri = f"{path.resolve().as_uri()}?mode=ro"
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as db:
            row = db.execute("SELECT value FROM meta WHERE key = 'listen_url'").fetchone()
            return None if row is None else str(row[0])
    return None
