"""The log receiver: each notification written to the monitor's log, one line per alert
(WARNING while it fires, INFO once resolved). Needs no network and cannot fail."""

from __future__ import annotations

import logging

import requests

from lossguard.monitor.notify.integrations.http import DELIVERED, Outcome
from lossguard.monitor.notify.links import single_spaced, subject, value_display
from lossguard.monitor.notify.model import AlertInfo, Notification

log = logging.getLogger("lossguard.monitor.notify")
LEVEL = {"firing": logging.WARNING, "resolved": logging.INFO}


class LogIntegration:
    kind = "log"
    pace_s = 0.0
    per_alert = False

    def __init__(self, send_resolved: bool) -> None:
        self.send_resolved = send_resolved

    def destination(self) -> str:
        return "log"

    def deliver(
        self,
        notification: Notification,
        notification_id: int,
        session: requests.Session,
        timeout_s: float,
    ) -> Outcome:
        for alert in notification.alerts:
            log.log(LEVEL[alert.status], "%s", log_line(alert, notification_id, notification))
        return DELIVERED


def log_line(alert: AlertInfo, notification_id: int, notification: Notification) -> str:
    """``FIRING LossSpike run=abc rank=0 step=120 value=3.2: <summary> -- <description> Done:
    <actions>. Next: <next steps>. (notification #7 to console)``; newlines in annotations
    become spaces, so one alert is one line."""
    text = f"{alert.status.upper()} {subject(alert)}"
    if alert.step is not None:
        text += f" step={alert.step}"
    text += f" value={value_display(alert.value)}"
    if alert.annotations.get("summary"):
        text += f": {alert.annotations['summary']}"
    if alert.annotations.get("description"):
        text += f" -- {alert.annotations['description']}"
    if alert.annotations.get("diagnosis"):
        text += f" Diagnosis: {alert.annotations['diagnosis']}."
    if alert.actions:
        text += f" Done: {'; '.join(alert.actions)}."
    if alert.next_steps and alert.status == "firing":
        text += f" Next: {'; '.join(alert.next_steps)}."
    return single_spaced(f"{text} (notification #{notification_id} to {notification.receiver})")
