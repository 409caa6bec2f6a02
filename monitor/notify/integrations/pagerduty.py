"""The PagerDuty receiver: one Events API v2 event per alert.

Follows PagerDuty's Events API v2 reference (``PagerDuty/api-schema``,
``reference/events-v2/openapiv3.json``): POST to ``/v2/enqueue`` with ``routing_key`` and
``event_action`` (trigger, acknowledge or resolve) and a ``dedup_key`` that ties a resolve to
its trigger; a trigger's ``payload`` needs ``summary`` (at most 1024 characters), ``source``
and ``severity`` (critical, error, warning or info). Replies: 202 ``{"status": "success",
"message": "Event processed", "dedup_key": ...}``; 400 ``{"status": "invalid event",
"errors": [...]}`` (not retried); 429 and 5xx are retried. A trigger for a dedup_key whose
incident is open is folded into it, so the key (stable per alert fingerprint) makes retries and
restarts page once."""

from __future__ import annotations

from typing import Any

from lossguard.monitor.notify.integrations.http import HttpIntegration
from lossguard.monitor.notify.links import Links, clip, is_web_url, iso_time, single_spaced, subject
from lossguard.monitor.notify.model import RUN_LABEL, AlertInfo, Notification
from lossguard.monitor.state import value_text

MAX_SUMMARY = 1024
SEVERITIES = frozenset({"critical", "error", "warning", "info"})
DEFAULT_SEVERITY = "error"
CLIENT = "lossguard"


class PagerDutyIntegration(HttpIntegration):
    """Sends one event per alert (the dispatcher writes one notification per alert); the
    routing key is added to the body when sending, never stored or shown."""

    kind = "pagerduty"
    pace_s = 0.5  # 120 events a minute per routing key
    per_alert = True

    def __init__(self, url: str, routing_key: str, send_resolved: bool, links: Links) -> None:
        super().__init__(url, send_resolved)
        self.routing_key = routing_key
        self.links = links

    def destination(self) -> str:
        return self.routing_key  # PagerDuty's rate limit is per routing key

    def secrets(self) -> list[str]:
        return [self.routing_key]  # the events URL is public

    def body(self, notification: Notification, notification_id: int) -> dict[str, Any]:
        if len(notification.alerts) != 1:
            raise ValueError(
                f"a PagerDuty event is about one alert, not {len(notification.alerts)}"
            )
        event = pagerduty_event(notification.alerts[0], self.links)
        return {**event, "routing_key": self.routing_key}


def pagerduty_event(alert: AlertInfo, links: Links) -> dict[str, Any]:
    """The event for ``alert`` without its routing key: a trigger while it fires, a resolve
    once it has resolved."""
    key = dedup_key(alert)
    if alert.status == "resolved":
        return {"event_action": "resolve", "dedup_key": key}
    labels = alert.labels
    payload = {
        "summary": summary(alert),
        "source": labels.get("instance") or labels.get(RUN_LABEL) or "lossguard-monitor",
        "severity": severity(labels.get("severity", "")),
        "timestamp": iso_time(alert.starts_at),
        "component": f"rank {labels['rank']}" if "rank" in labels else labels.get("job", ""),
        "group": labels.get(RUN_LABEL, ""),
        "class": alert.name,
        "custom_details": {
            "labels": labels,
            "annotations": alert.annotations,
            "value": value_text(alert.value),  # text: NaN and infinities are not JSON
            "step": alert.step,
            "actions": list(alert.actions),
            "next_steps": list(alert.next_steps),
            "fingerprint": alert.fingerprint,
        },
    }
    event: dict[str, Any] = {
        "event_action": "trigger",
        "dedup_key": key,
        "payload": {name: value for name, value in payload.items() if value != ""},
        "client": CLIENT,
        "links": [
            {"href": url, "text": text}
            for url, text in (
                (links.dashboard(labels), "Dashboard"),
                (links.runbook(alert.annotations), "Runbook"),
            )
            if url is not None and is_web_url(url)
        ],
    }
    if is_web_url(links.monitor_url):
        event["client_url"] = links.monitor_url
    return event


def dedup_key(alert: AlertInfo) -> str:
    """The same for every event about one alert (its fingerprint), across retries and restarts."""
    return f"lossguard-{alert.fingerprint}"


def summary(alert: AlertInfo) -> str:
    """``[critical] LossSpike run=abc rank=0: <summary annotation>``, at most 1024 characters."""
    text = f"[{alert.labels.get('severity', 'none')}] {subject(alert)}"
    if alert.annotations.get("summary"):
        text += f": {alert.annotations['summary']}"
    return clip(single_spaced(text), MAX_SUMMARY)


def severity(label: str) -> str:
    """The ``severity`` label as PagerDuty's severity; anything else is ``error``."""
    label = label.strip().lower()
    return label if label in SEVERITIES else DEFAULT_SEVERITY
