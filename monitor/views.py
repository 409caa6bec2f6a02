"""Views of the state database shared by the command line (``lossguard-monitor status``) and
HTTP (the read API): the active alerts and the actions, as plain data."""

from __future__ import annotations

from typing import Any

from lossguard.monitor.actions.describe import describe
from lossguard.monitor.actions.model import ActionRecord
from lossguard.monitor.actions.raised import RaisedAlerts
from lossguard.monitor.alert_store import AlertStore, value_text


def active_alerts(state: AlertStore) -> list[dict[str, Any]]:
    """The pending and firing alerts as the last evaluation recorded them, the monitor's own
    (pages and announcements) included, longest in their state first. ``since``: when the alert
    entered its state; ``value`` as text (NaN included)."""
    alerts = [a for found in state.load_alerts().values() for a in found] + [
        raised.alert for raised in RaisedAlerts(state).firing()
    ]
    listed = [
        {
            "fingerprint": a.fingerprint,
            "rule": a.rule,
            "labels": a.labels,
            "annotations": a.annotations,
            "state": a.state.value,
            "value": value_text(a.value),
            "active_at": a.active_at,
            "fired_at": a.fired_at,
            "since": a.active_at if a.fired_at is None else a.fired_at,
        }
        for a in alerts
    ]
    return sorted(listed, key=lambda a: (a["since"], a["fingerprint"]))


def action_json(record: ActionRecord) -> dict[str, Any]:
    """An action's record, with what was done in words (``text``)."""
    return {**record.to_json(), "text": describe(record)}
