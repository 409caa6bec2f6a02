"""What a receiver is told: one notification of one alert group, with the alerts as they were
when the group was flushed. Stored in the outbox as JSON, rendered per receiver at send time."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Literal

from lossguard.monitor.alert_store import value_text

Status = Literal["firing", "resolved"]
RUN_LABEL = "run_id"
ANNOUNCE_LABEL = "announce"


def announcement(labels: dict[str, str]) -> bool:
    """An alert labelled ``announce="once"`` tells of something done (an action, a fault the
    run healed): receivers hear when it fires, never when it resolves."""
    return labels.get(ANNOUNCE_LABEL) == "once"


@dataclass(frozen=True)
class AlertInfo:
    """One alert in a notification."""

    fingerprint: str
    status: Status
    labels: dict[str, str]
    annotations: dict[str, str]
    value: float
    starts_at: float  # when it became active (Unix seconds)
    ends_at: float | None = None  # when it resolved
    step: int | None = None  # the run's last completed step when the alert changed state
    actions: tuple[str, ...] = ()  # what was done about the run so far, e.g. "rolled back 1 time"
    next_steps: tuple[str, ...] = ()  # what on-call can do, with the exact commands

    @property
    def name(self) -> str:
        return self.labels.get("alertname", "")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["value"] = value_text(self.value)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AlertInfo:
        return cls(
            **{
                **data,
                "value": float(data["value"]),
                "actions": tuple(data["actions"]),
                "next_steps": tuple(data.get("next_steps", ())),
            }
        )


@dataclass(frozen=True)
class Notification:
    """What one receiver integration is told about one alert group at one flush."""

    receiver: str  # the receiver's name in monitor.yml
    integration: str  # "slack" | "pagerduty" | "webhook" | "log"
    index: int  # which of the receiver's configs of that kind (0-based)
    group_key: str  # Alertmanager's form: '{}/{severity="critical"}:{alertname="X"}'
    group_labels: dict[str, str]
    alerts: tuple[AlertInfo, ...]
    created_at: float
    truncated_alerts: int = 0

    @property
    def status(self) -> Status:
        """firing while any alert fires, else resolved (as Alertmanager)."""
        return "firing" if any(a.status == "firing" for a in self.alerts) else "resolved"

    @property
    def firing(self) -> list[AlertInfo]:
        return [a for a in self.alerts if a.status == "firing"]

    @property
    def resolved(self) -> list[AlertInfo]:
        return [a for a in self.alerts if a.status == "resolved"]

    @property
    def common_labels(self) -> dict[str, str]:
        return _common([a.labels for a in self.alerts])

    @property
    def common_annotations(self) -> dict[str, str]:
        return _common([a.annotations for a in self.alerts])

    @property
    def lane(self) -> str:
        """The delivery lane: one per receiver integration, delivered in order and paced."""
        return lane_name(self.receiver, self.integration, self.index)

    def to_json(self) -> str:
        data = asdict(self)
        data["alerts"] = [a.to_json() for a in self.alerts]
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Notification:
        data = json.loads(text)
        data["alerts"] = tuple(AlertInfo.from_json(a) for a in data["alerts"])
        return cls(**data)


def lane_name(receiver: str, kind: str, index: int) -> str:
    """``team/slack[0]``: a receiver's ``index``-th integration of ``kind``."""
    return f"{receiver}/{kind}[{index}]"


def _common(dicts: list[dict[str, str]]) -> dict[str, str]:
    """The pairs every dict has (Alertmanager's commonLabels / commonAnnotations)."""
    if not dicts:
        return {}
    common = dict(dicts[0])
    for d in dicts[1:]:
        common = {k: v for k, v in common.items() if d.get(k) == v}
    return common
