"""The PagerDuty receiver: one Events API v2 event per notification of an alert group, as
Alertmanager sends them.

Follows PagerDuty's Events API v2 reference (``PagerDuty/api-schema``,
``reference/events-v2/openapiv3.json``): POST to ``/v2/enqueue`` with ``routing_key`` and
``event_action`` (trigger, acknowledge or resolve) and a ``dedup_key`` that ties a resolve to
its trigger; a trigger's ``payload`` needs ``summary`` (at most 1024 characters), ``source``
and ``severity`` (critical, error, warning or info). Replies: 202 ``{"status": "success",
"message": "Event processed", "dedup_key": ...}``; 400 ``{"status": "invalid event",
"errors": [...]}`` (not retried); 429 and 5xx are retried. A trigger for a dedup_key whose
incident is open is folded into it.

As Alertmanager's PagerDuty notifier (notify/pagerduty): the dedup_key is the SHA-256 of the
group key in hex, the same for every event about the group, so a group is one incident however
many alerts it holds, and retries and restarts page once; the event triggers while any alert of
the group fires and resolves once all have resolved."""

from __future__ import annotations

import hashlib
from typing import Any

from lossguard.monitor.alert_store import value_text
from lossguard.monitor.notify.integrations.http import HttpIntegration
from lossguard.monitor.notify.links import Links, clip, is_web_url, iso_time, single_spaced, subject
from lossguard.monitor.notify.model import RUN_LABEL, AlertInfo, Notification

MAX_SUMMARY = 1024
SEVERITIES = ("critical", "error", "warning", "info")  # most severe first
DEFAULT_SEVERITY = "error"
CLIENT = "lossguard"
MAX_DETAILED = 100  # alerts described in custom_details; the rest counted


class PagerDutyIntegration(HttpIntegration):
    """Sends one event per notification of an alert group; the routing key is added to the
    body when sending, never stored or shown."""

    kind = "pagerduty"
    pace_s = 0.5  # 120 events a minute per routing key
    per_alert = False

    def __init__(self, url: str, routing_key: str, send_resolved: bool, links: Links) -> None:
        super().__init__(url, send_resolved)
        self.routing_key = routing_key
        self.links = links

    def destination(self) -> str:
        return self.routing_key  # PagerDuty's rate limit is per routing key

    def secrets(self) -> list[str]:
        return [self.routing_key]  # the events URL is public

    def body(self, notification: Notification, notification_id: int) -> dict[str, Any]:
        event = pagerduty_event(notification, self.links)
        return {**event, "routing_key": self.routing_key}


def pagerduty_event(notification: Notification, links: Links) -> dict[str, Any]:
    """The event for ``notification`` without its routing key: a trigger while any of the
    group's alerts fires, a resolve once every one has resolved."""
    key = dedup_key(notification.group_key)
    if notification.status == "resolved":
        return {"event_action": "resolve", "dedup_key": key}
    firing = notification.firing
    common = notification.common_labels
    alerts = [*firing, *notification.resolved]
    payload = {
        "summary": summary(notification),
        "source": common.get("instance") or common.get(RUN_LABEL) or "lossguard-monitor",
        "severity": min(
            (severity(a.labels.get("severity", "")) for a in firing), key=SEVERITIES.index
        ),
        "timestamp": iso_time(min(a.starts_at for a in firing)),
        "component": f"rank {common['rank']}" if "rank" in common else common.get("job", ""),
        "group": common.get(RUN_LABEL, ""),
        "class": ", ".join(dict.fromkeys(a.name for a in firing)),
        "custom_details": {
            "firing": len(firing),
            "resolved": len(notification.resolved),
            "group_labels": notification.group_labels,
            "alerts": [details(a) for a in alerts[:MAX_DETAILED]],
            "more_alerts": max(len(alerts) - MAX_DETAILED, 0) + notification.truncated_alerts,
        },
    }
    runbooks = dict.fromkeys(
        url for a in firing if (url := links.runbook(a.annotations)) is not None
    )
    event: dict[str, Any] = {
        "event_action": "trigger",
        "dedup_key": key,
        "payload": {name: value for name, value in payload.items() if value != ""},
        "client": CLIENT,
        "links": [
            {"href": url, "text": text}
            for url, text in (
                (links.dashboard(common), "Dashboard"),
                *((url, "Runbook") for url in runbooks),
            )
            if url is not None and is_web_url(url)
        ],
    }
    if is_web_url(links.monitor_url):
        event["client_url"] = links.monitor_url
    return event


def details(alert: AlertInfo) -> dict[str, Any]:
    """One alert of the group in ``custom_details``."""
    return {
        "status": alert.status,
        "labels": alert.labels,
        "annotations": alert.annotations,
        "value": value_text(alert.value),  # text: NaN and infinities are not JSON
        "step": alert.step,
        "actions": list(alert.actions),
        "next_steps": list(alert.next_steps),
        "starts_at": iso_time(alert.starts_at),
        "ends_at": None if alert.ends_at is None else iso_time(alert.ends_at),
        "fingerprint": alert.fingerprint,
    }


def dedup_key(group_key: str) -> str:
    """Alertmanager's for the group (``notify.Key.Hash``): the SHA-256 of its key, in hex; the
    same for every event about the group, across retries and restarts."""
    return hashlib.sha256(group_key.encode()).hexdigest()


def summary(notification: Notification) -> str:
    """``[critical] LossSpike run=abc: <summary annotation>`` for one firing alert;
    ``[critical] 3 alerts firing: A run=abc: <summary>; B run=abc: <summary>; ...`` for more,
    the severity label the group's (``mixed`` when its alerts differ); at most 1024
    characters."""
    firing = notification.firing
    severities = {a.labels.get("severity", "none") for a in firing}
    text = f"[{severities.pop() if len(severities) == 1 else 'mixed'}] "
    if len(firing) > 1:
        text += f"{len(firing)} alerts firing: "
    text += "; ".join(_alert_summary(alert) for alert in firing)
    return clip(single_spaced(text), MAX_SUMMARY)


def _alert_summary(alert: AlertInfo) -> str:
    text = subject(alert)
    if alert.annotations.get("summary"):
        text += f": {alert.annotations['summary']}"
    return text


def severity(label: str) -> str:
    """The ``severity`` label as PagerDuty's severity; anything else is ``error``."""
    label = label.strip().lower()
    return label if label in SEVERITIES else DEFAULT_SEVERITY
