"""From alert transitions to queued notifications, as Alertmanager's dispatcher and notify
pipeline do it: route each alert into its groups; flush a group ``group_wait`` after it formed
and every ``group_interval`` after that; leave out silenced and inhibited alerts; tell each
receiver integration only what changed since it was last told, or everything again once
``repeat_interval`` has passed; queue what it is told in the outbox.

Three differences from Alertmanager, on purpose: a receiver that was told an alert fires is told
when it resolves even if the alert is silenced or inhibited by then, so a page never stays open
because someone silenced it after acknowledging it; an announcement (``announce="once"``) is
never told as resolved; and the groups outlive config changes (they are persisted): an alert
keeps the receivers it was routed to while it fires, and they hear when it resolves, while alerts
that fire after the change follow the new routes."""

from __future__ import annotations

import dataclasses
import logging
import sqlite3
from collections.abc import Callable, Iterator, Mapping, Sequence

from lossguard.monitor.alert_store import AlertEvent, AlertStore
from lossguard.monitor.notify.config import NotificationsConfig
from lossguard.monitor.notify.facts import Facts, RunFacts
from lossguard.monitor.notify.inhibit import Inhibitor
from lossguard.monitor.notify.integrations import Integration
from lossguard.monitor.notify.model import (
    RUN_LABEL,
    AlertInfo,
    Notification,
    announcement,
    lane_name,
)
from lossguard.monitor.notify.routing import Route, build_route
from lossguard.monitor.notify.silences import Silence, SilenceStore
from lossguard.monitor.notify.store import Group, NotifyStore
from lossguard.monitor.rules.alerting import TransitionKind

log = logging.getLogger("lossguard.monitor.notify")
Labels = Mapping[str, str]
NOTIFIED_KINDS = (TransitionKind.FIRING, TransitionKind.RESOLVED)
KEEP_S = 7 * 86400  # delivered notifications and consumed alert events are kept a week
PRUNE_EVERY_S = 3600


@dataclasses.dataclass(frozen=True)
class Lane:
    """One integration of a receiver, as the outbox names it."""

    name: str
    receiver: str
    kind: str
    index: int
    integration: Integration


class Dispatcher:
    """Consumes the recorded alert transitions; queues notifications in the outbox."""

    def __init__(
        self,
        state: AlertStore,
        config: NotificationsConfig,
        integrations: Mapping[str, Integration],
        *,
        facts: RunFacts | None = None,
        annotate: Callable[[AlertInfo], AlertInfo] | None = None,
    ) -> None:
        self.state = state
        self.store = NotifyStore(state)
        self.silences = SilenceStore(state)
        self.route = build_route(config.route)
        self.routes = {r.id: r for r in _walk(self.route)}
        self.inhibitor = Inhibitor(config.inhibit_rules)
        self.lanes: dict[str, list[Lane]] = {
            receiver.name: [
                Lane(name, receiver.name, kind, index, integrations[name])
                for kind, index, _ in receiver.integrations()
                for name in [lane_name(receiver.name, kind, index)]
            ]
            for receiver in config.receivers
        }
        self.facts = facts
        self.annotate = annotate
        self._next_prune = 0.0

    def step(self, now: float, firing: Sequence[Labels]) -> list[int]:
        """Take in new transitions and flush the groups that are due; the ids queued.
        ``firing``: the labels of every firing alert (the sources of inhibition)."""
        self.ingest(now)
        queued = self.flush(now, firing)
        if now >= self._next_prune:
            with self.state.transaction() as db:
                NotifyStore.prune(db, now - KEEP_S)
            self._next_prune = now + PRUNE_EVERY_S
        return queued

    def ingest(self, now: float, batch: int = 1000) -> int:
        """Put the firing and resolved transitions recorded since the last call into their
        alert groups; how many events were consumed."""
        with self.state.reading() as db:
            cursor = NotifyStore.cursor(db)
        events = self.state.events(cursor, batch)
        if not events:
            return 0
        facts: dict[tuple[str, float], Facts] = {}  # one lookup per run and evaluation
        alerts = [
            (self._alert_info(e, facts), e) for e in events if e.transition.kind in NOTIFIED_KINDS
        ]
        with self.state.transaction() as db:
            for alert, event in alerts:
                if alert.status == "resolved":  # also where it was routed before a config change
                    NotifyStore.resolve_everywhere(db, alert)
                for route in self.route.match(alert.labels):
                    key = route.group_key(alert.labels)
                    group = Group(
                        id=f"{route.id}|{route.receiver}|{key}",
                        key=key,
                        route=route.id,
                        receiver=route.receiver,
                        labels=route.group_labels(alert.labels),
                        next_flush=event.transition.at + route.group_wait_s,
                    )
                    NotifyStore.add_to_group(db, group, alert)
            NotifyStore.set_cursor(db, events[-1].id)
        return len(events)

    def _alert_info(self, event: AlertEvent, facts: dict[tuple[str, float], Facts]) -> AlertInfo:
        transition = event.transition
        alert = transition.alert
        resolved = transition.kind is TransitionKind.RESOLVED
        key = (alert.labels.get(RUN_LABEL, ""), transition.at)
        if key not in facts:
            facts[key] = self.facts.of(alert.labels, transition.at) if self.facts else (None, ())
        step, actions = facts[key]
        return AlertInfo(
            fingerprint=alert.fingerprint,
            status="resolved" if resolved else "firing",
            labels=alert.labels,
            annotations=alert.annotations,
            value=alert.value,
            starts_at=alert.fired_at if alert.fired_at is not None else alert.active_at,
            ends_at=transition.at if resolved else None,
            step=step,
            actions=actions,
        )

    def flush(self, now: float, firing: Sequence[Labels]) -> list[int]:
        """Flush every group that is due at ``now``; the ids of the notifications queued."""
        silences = self.silences.active(now)
        queued: list[int] = []
        with self.state.transaction() as db:
            for group in NotifyStore.due_groups(db, now):
                if group.receiver not in self.lanes:
                    log.warning("dropping alert group %s: its receiver is gone", group.key)
                    NotifyStore.drop_group(db, group.id)
                    continue
                # a group whose route was edited away lives on, on the root's timers, so its
                # receiver still hears the end of what it was told
                route = self.routes.get(group.route, self.route)
                alerts = NotifyStore.group_alerts(db, group.id)
                if self.annotate is not None:
                    alerts = [self.annotate(a) for a in alerts]
                muted = {
                    a.fingerprint
                    for a in alerts
                    if a.status == "firing" and self._muted(a.labels, silences, firing, now)
                }
                for lane in self.lanes[group.receiver]:
                    queued += self._tell(db, group, route, lane, alerts, muted, now)
                NotifyStore.finish_flush(
                    db,
                    group,
                    [a.fingerprint for a in alerts if a.status == "resolved"],
                    now + route.group_interval_s,
                )
        return queued

    def _muted(
        self, labels: Labels, silences: list[Silence], firing: Sequence[Labels], now: float
    ) -> bool:
        return any(s.mutes(labels, now) for s in silences) or self.inhibitor.inhibited(
            labels, firing
        )

    def _tell(
        self,
        db: sqlite3.Connection,
        group: Group,
        route: Route,
        lane: Lane,
        alerts: list[AlertInfo],
        muted: set[str],
        now: float,
    ) -> list[int]:
        """What ``lane`` must be told of ``group`` now (Alertmanager's DedupStage), queued."""
        told, told_at = NotifyStore.told(db, group.id, lane.name) or (set(), None)
        firing = [a for a in alerts if a.status == "firing"]
        current = [a for a in firing if a.fingerprint not in muted]
        ended = [
            a
            for a in alerts
            if a.status == "resolved" and a.fingerprint in told and not announcement(a.labels)
        ]
        send_resolved = lane.integration.send_resolved
        changed = any(a.fingerprint not in told for a in current) or bool(ended and send_resolved)
        repeat = bool(current) and told_at is not None and now - told_at >= route.repeat_interval_s
        still_told = {a.fingerprint for a in firing if a.fingerprint in told}
        if not (changed or repeat):
            if told_at is not None and still_told != told:
                NotifyStore.set_told(db, group.id, lane.name, still_told, told_at)
            return []
        notification = Notification(
            receiver=lane.receiver,
            integration=lane.kind,
            index=lane.index,
            group_key=group.key,
            group_labels=group.labels,
            alerts=tuple(current + (ended if send_resolved else [])),
            created_at=now,
        )
        NotifyStore.set_told(
            db, group.id, lane.name, still_told | {a.fingerprint for a in current}, now
        )
        return [NotifyStore.queue(db, n) for n in _split(notification, lane.integration)]

    def next_flush(self) -> float | None:
        """When the next group is due (None: no group waits)."""
        with self.state.reading() as db:
            return NotifyStore.next_flush(db)


def _split(notification: Notification, integration: Integration) -> list[Notification]:
    """One notification per alert for integrations that take one event per alert."""
    if not integration.per_alert:
        return [notification]
    return [dataclasses.replace(notification, alerts=(a,)) for a in notification.alerts]


def _walk(route: Route) -> Iterator[Route]:
    yield route
    for child in route.routes:
        yield from _walk(child)
