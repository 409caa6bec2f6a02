"""The monitor's own alerts (its pages and announcements) posted to Alertmanager's API
(``POST /api/v2/alerts``), as Prometheus posts its rules' alerts: where Alertmanager owns Slack
and PagerDuty (the compose stack), they reach people through its routes.

A firing alert is sent with ``endsAt`` a day on (Alertmanager would otherwise resolve it after
its ``resolve_timeout``): the route to this receiver must repeat it within that day (its
``repeat_interval``), and its resolution is sent with the time it resolved. An announcement
(``announce="once"``) is sent ending an hour on: it is never told as resolved."""

from __future__ import annotations

from typing import Any

from lossguard.monitor.notify.integrations.http import HttpIntegration
from lossguard.monitor.notify.integrations.webhook import go_time
from lossguard.monitor.notify.model import AlertInfo, Notification, announcement

API_PATH = "/api/v2/alerts"
FIRING_FOR_S = 86400.0
ANNOUNCED_FOR_S = 3600.0


def alertmanager_alerts(notification: Notification, generator_url: str) -> list[dict[str, Any]]:
    """The body of ``POST /api/v2/alerts`` for the notification's alerts."""
    return [_alert(a, notification.created_at, generator_url) for a in notification.alerts]


class AlertmanagerIntegration(HttpIntegration):
    """Posts a notification's alerts to one Alertmanager; basic auth when a password is set."""

    kind = "alertmanager"
    pace_s = 0.0
    per_alert = False

    def __init__(
        self,
        url: str,
        send_resolved: bool,
        *,
        username: str = "",
        password: str | None = None,
        generator_url: str = "",
    ) -> None:
        super().__init__(url.rstrip("/") + API_PATH, send_resolved)
        self.auth = None if password is None else (username, password)
        self.generator_url = generator_url

    def body(self, notification: Notification, notification_id: int) -> list[dict[str, Any]]:
        return alertmanager_alerts(notification, self.generator_url)


def _alert(alert: AlertInfo, told_at: float, generator_url: str) -> dict[str, Any]:
    if alert.status == "resolved":
        ends = alert.ends_at
    else:
        ends = told_at + (ANNOUNCED_FOR_S if announcement(alert.labels) else FIRING_FOR_S)
    return {
        "labels": alert.labels,
        "annotations": alert.annotations,
        "startsAt": go_time(alert.starts_at),
        "endsAt": go_time(ends),
        "generatorURL": generator_url,
    }
