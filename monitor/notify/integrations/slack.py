"""The Slack receiver: one incoming-webhook message per notification, Block Kit ``blocks`` with
a ``text`` fallback (what push notifications and screen readers read).

Follows Slack's documentation: an incoming webhook takes a JSON POST to its URL (the secret)
and answers 200 with the body ``ok``; errors are an HTTP status with a short code as the body
("Improving error conditions for Incoming Webhooks", 2016: 400 ``invalid_payload``, 403
``action_prohibited``, 404 ``channel_not_found``, 410 ``channel_is_archived``, 500
``rollup_error``; also 400 ``no_text`` / ``invalid_blocks``, 403 ``invalid_token``, 404
``no_service``, and 429 with ``Retry-After`` past about one message per second per webhook).
Block Kit limits: 50 blocks a message, a header's plain_text 150 characters, a section's text
3000 and at most 10 fields of 2000. In mrkdwn, ``&``, ``<`` and ``>`` are escaped as HTML
entities."""

from __future__ import annotations

from typing import Any

import requests

from lossguard.monitor.notify.integrations.http import HttpIntegration, Outcome, classify
from lossguard.monitor.notify.links import (
    Links,
    clip,
    is_web_url,
    iso_time,
    single_spaced,
    value_display,
)
from lossguard.monitor.notify.model import RUN_LABEL, AlertInfo, Notification, Status

MAX_BLOCKS = 50
MAX_HEADER = 150
MAX_TEXT = 3000  # a section's or a context element's text
MAX_FIELDS = 10  # per section
MAX_FIELD = 2000
ALERT_BLOCKS = MAX_BLOCKS - 3  # the others: header, "and N more alerts", context
STYLE: dict[Status, tuple[str, str]] = {
    "firing": (":red_circle:", "FIRING"),
    "resolved": (":large_green_circle:", "RESOLVED"),
}
CONTEXT_MARK = "lossguard notification #"  # followed by the outbox id


class SlackIntegration(HttpIntegration):
    """Posts each notification as one message; 200 ``ok`` is delivered. Any other 200 is dead:
    the message may have been posted, so it is never sent again."""

    kind = "slack"
    pace_s = 1.0  # Slack allows about one message per second per webhook
    per_alert = False

    def __init__(self, url: str, send_resolved: bool, links: Links) -> None:
        super().__init__(url, send_resolved)
        self.links = links

    def body(self, notification: Notification, notification_id: int) -> dict[str, Any]:
        return slack_message(notification, notification_id, self.links)

    def accept(self, reply: requests.Response) -> Outcome | None:
        if reply.status_code == 200 and reply.text.strip() == "ok":
            return None
        return Outcome(
            "dead",
            f"{classify(reply).detail} instead of Slack's 'ok': the message may have been "
            "posted, so it is not sent again",
            reply.status_code,
        )


def slack_message(notification: Notification, notification_id: int, links: Links) -> dict[str, Any]:
    """The webhook body: header, one section per alert (firing first; at most what fits in 50
    blocks, the rest counted in an "and N more alerts" section), and a context line naming the
    notification id and the group."""
    alerts = notification.firing + notification.resolved
    shown = alerts[:ALERT_BLOCKS]
    hidden = len(alerts) - len(shown) + notification.truncated_alerts
    emoji, word = STYLE[notification.status]
    header = clip(f"{emoji} {word}: {_names(alerts)}", MAX_HEADER)
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": header, "emoji": True}},
        *(_alert_section(alert, links) for alert in shown),
    ]
    if hidden:
        blocks.append(_section(f"_…and {hidden} more alert{'s' if hidden > 1 else ''}_"))
    blocks.append(_context(notification, notification_id, links))
    return {"text": fallback_text(notification), "blocks": blocks}


def fallback_text(notification: Notification) -> str:
    """``[FIRING:2] LossSpike run=abc (critical): <common summary>``, as Alertmanager's
    default title; ``[RESOLVED] ...`` once every alert has resolved."""
    _, word = STYLE[notification.status]
    count = f":{len(notification.firing)}" if notification.status == "firing" else ""
    common = notification.common_labels
    text = f"[{word}{count}] {_names(notification.alerts)}"
    if RUN_LABEL in common:
        text += f" run={common[RUN_LABEL]}"
    if "severity" in common:
        text += f" ({common['severity']})"
    summary = notification.common_annotations.get("summary")
    if summary:
        text += f": {summary}"
    return clip(escape(single_spaced(text)), MAX_TEXT)


def escape(text: str) -> str:
    """Text for mrkdwn: Slack's control characters as HTML entities (no mentions, no links)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _names(alerts: list[AlertInfo] | tuple[AlertInfo, ...]) -> str:
    return ", ".join(dict.fromkeys(a.name for a in alerts)) or "alerts"


def _alert_section(alert: AlertInfo, links: Links) -> dict[str, Any]:
    emoji, word = STYLE[alert.status]
    lines = [f"{emoji} *{escape(alert.name)}* {word}"]
    for title, key in ANNOTATIONS_SHOWN:
        if alert.annotations.get(key):
            lines.append(f"*{title}:* {escape(alert.annotations[key])}")
    if alert.next_steps and alert.status == "firing":
        lines.append("*Next steps:*")
        lines += [f"• {escape(_command(step))}" for step in alert.next_steps]
    facts = {  # at most MAX_FIELDS
        "Severity": escape(alert.labels.get("severity", "")),
        "Run": escape(alert.labels.get(RUN_LABEL, "")),
        "Rank": escape(alert.labels.get("rank", "")),
        "Step": "" if alert.step is None else str(alert.step),
        "Value": value_display(alert.value),
        "Actions": escape("; ".join(alert.actions)) or "none",
        "Started": _date(alert.starts_at),
        "Resolved": _date(alert.ends_at) if alert.status == "resolved" else "",
        "Runbook": _link(links.runbook(alert.annotations), "Open the runbook"),
        "Dashboard": _link(links.dashboard(alert.labels), "Open the dashboard"),
    }
    fields = [
        {"type": "mrkdwn", "text": clip(f"*{title}*\n{value}", MAX_FIELD)}
        for title, value in facts.items()
        if value
    ]
    return {**_section("\n".join(lines)), "fields": fields}


ANNOTATIONS_SHOWN = (
    ("Summary", "summary"),
    ("Description", "description"),
    ("Diagnosis", "diagnosis"),
)


def _command(step: str) -> str:
    """``what: command`` with the command as code."""
    what, sep, command = step.partition(": ")
    return f"{what}: `{command}`" if sep else step


def _section(text: str) -> dict[str, Any]:
    return {"type": "section", "text": {"type": "mrkdwn", "text": clip(text, MAX_TEXT)}}


def _context(notification: Notification, notification_id: int, links: Links) -> dict[str, Any]:
    where = [
        f"{CONTEXT_MARK}{notification_id}",
        f"receiver {escape(notification.receiver)}",
        f"group {escape(notification.group_key)}",
    ]
    if is_web_url(links.monitor_url):
        where.append(_link(links.monitor_url, "lossguard-monitor"))
    text = clip(" · ".join(where), MAX_TEXT)
    return {"type": "context", "elements": [{"type": "mrkdwn", "text": text}]}


def _link(url: str | None, label: str) -> str:
    """A mrkdwn link to a web URL; any other URL (a relative runbook path) as plain text."""
    if not url:
        return ""
    return f"<{escape(url)}|{label}>" if is_web_url(url) else escape(url)


def _date(seconds: float | None) -> str:
    """A Slack date token: shown in the reader's time zone, UTC text where it cannot be."""
    if seconds is None:
        return ""
    return f"<!date^{int(seconds)}^{{date_short_pretty}} {{time_secs}}|{iso_time(seconds)}>"
