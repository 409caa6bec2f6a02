"""The generic webhook receiver: Alertmanager's webhook payload (version 4), so receivers
written for Alertmanager's ``webhook_configs`` work unchanged.

Follows Alertmanager 0.25 ``notify/webhook/webhook.go`` (``Message``: ``template.Data`` plus
``version``, ``groupKey``, ``truncatedAlerts``; ``max_alerts`` cuts the alerts before the data
is built), ``template/template.go`` (``Data``; the receiver name regexp-quoted) and
``dispatch/dispatch.go`` (a group's alerts sorted by ``types.AlertSlice``; a firing alert's
``endsAt`` is Go's zero time). Two values differ by design: ``fingerprint`` is ours (16 hex
digits of SHA-256, the id the rest of lossguard uses) where Alertmanager's is FNV-64a of the
labels; ``generatorURL`` is the monitor's URL (its ``rules.external_url``), as lossguard keeps no
per-alert source link. Lossguard's extras (value, step, actions) are left
out, so the payload has exactly Alertmanager's shape."""

from __future__ import annotations

import time
from dataclasses import replace
from functools import cmp_to_key
from typing import Any

from lossguard.monitor.notify.integrations.http import HttpIntegration
from lossguard.monitor.notify.model import AlertInfo, Notification

VERSION = "4"
GO_ZERO_TIME = "0001-01-01T00:00:00Z"
REGEXP_SPECIAL = frozenset("\\.+*?()|[]{}^$")  # Go's regexp.QuoteMeta escapes these
ORDER_FIRST = ("job", "instance")  # types.AlertSlice compares these labels first


def webhook_payload(
    notification: Notification, max_alerts: int = 0, external_url: str = ""
) -> dict[str, Any]:
    """Alertmanager's webhook body for ``notification``: alerts in Alertmanager's order, at
    most ``max_alerts`` of them (0: all); status and common labels describe the alerts sent,
    ``truncatedAlerts`` counts the others; ``external_url`` is the monitor's."""
    ordered = sorted(notification.alerts, key=cmp_to_key(_compare))
    kept = ordered[:max_alerts] if max_alerts else ordered
    shown = replace(
        notification,
        alerts=tuple(kept),
        truncated_alerts=notification.truncated_alerts + len(ordered) - len(kept),
    )
    return {
        "receiver": quote_meta(shown.receiver),
        "status": shown.status,
        "alerts": [_alert(alert, external_url) for alert in kept],
        "groupLabels": _sorted(shown.group_labels),
        "commonLabels": _sorted(shown.common_labels),
        "commonAnnotations": _sorted(shown.common_annotations),
        "externalURL": external_url,
        "version": VERSION,
        "groupKey": shown.group_key,
        "truncatedAlerts": shown.truncated_alerts,
    }


class WebhookIntegration(HttpIntegration):
    """POSTs the payload to one URL (a secret: never in an outcome's detail); any 2xx is
    delivered. Alertmanager's webhook body has no idempotency key, so this adds none: a retry
    after a lost reply can deliver a body twice."""

    kind = "webhook"
    pace_s = 0.0
    per_alert = False

    def __init__(
        self, url: str, send_resolved: bool, max_alerts: int, external_url: str = ""
    ) -> None:
        super().__init__(url, send_resolved)
        self.max_alerts = max_alerts
        self.external_url = external_url  # the monitor's, as Alertmanager's externalURL

    def body(self, notification: Notification, notification_id: int) -> dict[str, Any]:
        return webhook_payload(notification, self.max_alerts, self.external_url)


def go_time(seconds: float | None) -> str:
    """Unix seconds as Go marshals a ``time.Time`` in UTC to JSON (RFC 3339 with the fraction's
    trailing zeros dropped), to the microsecond a float holds; None is Go's zero time."""
    if seconds is None:
        return GO_ZERO_TIME
    whole, micros = divmod(round(seconds * 1_000_000), 1_000_000)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
    fraction = f"{micros:06d}".rstrip("0")
    return f"{text}.{fraction}Z" if fraction else f"{text}Z"


def quote_meta(text: str) -> str:
    """Go's ``regexp.QuoteMeta`` (fewer characters than Python's ``re.escape``)."""
    return "".join("\\" + char if char in REGEXP_SPECIAL else char for char in text)


def _alert(alert: AlertInfo, generator_url: str) -> dict[str, Any]:
    return {
        "status": alert.status,
        "labels": _sorted(alert.labels),
        "annotations": _sorted(alert.annotations),
        "startsAt": go_time(alert.starts_at),
        "endsAt": go_time(alert.ends_at if alert.status == "resolved" else None),
        "generatorURL": generator_url,
        "fingerprint": alert.fingerprint,
    }


def _sorted(pairs: dict[str, str]) -> dict[str, str]:
    """Keys in Go's JSON order for maps (sorted)."""
    return dict(sorted(pairs.items()))


def _compare(a: AlertInfo, b: AlertInfo) -> int:
    return -1 if _before(a.labels, b.labels) else 1 if _before(b.labels, a.labels) else 0


def _before(a: dict[str, str], b: dict[str, str]) -> bool:
    """``types.AlertSlice.Less``: by job, then instance (an alert without one after those
    with), then ``model.LabelSet.Before``."""
    for name in ORDER_FIRST:
        if name not in a and name not in b:
            continue
        if name not in a or name not in b:
            return name in a
        if a[name] != b[name]:
            return a[name] < b[name]
    return _labels_before(a, b)


def _labels_before(a: dict[str, str], b: dict[str, str]) -> bool:
    """``model.LabelSet.Before``: fewer labels first; then, over all names in order, the set
    lacking a name first, then the smaller value (code-point order is UTF-8 byte order)."""
    if len(a) != len(b):
        return len(a) < len(b)
    for name in sorted({*a, *b}):
        if name not in a or name not in b:
            return name not in a
        if a[name] != b[name]:
            return a[name] < b[name]
    return False
