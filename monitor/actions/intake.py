"""Alertmanager's webhook payload (version 4) as the actions pipeline takes it.

Alertmanager POSTs one JSON object per notification of an alert group::

    {"version": "4", "groupKey": "...", "truncatedAlerts": 0, "status": "firing",
     "receiver": "...", "groupLabels": {...}, "commonLabels": {...},
     "commonAnnotations": {...}, "externalURL": "...",
     "alerts": [{"status": "firing", "labels": {...}, "annotations": {...},
                 "startsAt": "<rfc3339>", "endsAt": "<rfc3339>", "generatorURL": "...",
                 "fingerprint": "..."}]}

:func:`parse_webhook` validates it (unknown fields are tolerated: Alertmanager and its forks add
some) and returns one :class:`IncomingAlert` per alert; anything else raises
:class:`IntakeError` with one line naming the problem and where it is."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from lossguard.common.jsondepth import TooDeep, load_bounded

WEBHOOK_VERSION = "4"
ZERO_TIME = "0001-01-01T00:00:00Z"  # Go's zero time.Time: "not set"
_FRACTION = re.compile(r"(\.\d{6})\d+")  # Go writes nanoseconds; Python parses microseconds

Status = Literal["firing", "resolved"]


class IntakeError(ValueError):
    """A webhook body that is not Alertmanager's payload v4 (one line)."""


@dataclass(frozen=True)
class IncomingAlert:
    """One alert of a webhook notification."""

    status: Status
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: float  # unix seconds
    ends_at: float | None  # None: not set (Alertmanager sends Go's zero time)
    generator_url: str
    source_fingerprint: str  # Alertmanager's fingerprint of the labels ("" when not sent)


def parse_time(text: str) -> float | None:
    """An RFC 3339 time as unix seconds; None for Go's zero time (any year 1 value)."""
    if text.startswith("0001-01-01T"):
        return None
    try:
        parsed = datetime.fromisoformat(_FRACTION.sub(r"\1", text))
    except ValueError:
        raise ValueError(f"not an RFC 3339 time: {text!r}") from None
    if parsed.tzinfo is None:
        raise ValueError(f"not an RFC 3339 time (no time zone): {text!r}")
    return parsed.timestamp()


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)


class WebhookAlert(_Model):
    status: Status
    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    starts_at: float = Field(alias="startsAt")
    ends_at: float | None = Field(default=None, alias="endsAt")
    generator_url: str = Field(default="", alias="generatorURL")
    fingerprint: str = ""

    @field_validator("starts_at", mode="before")
    @classmethod
    def _starts(cls, value: Any) -> float:
        if not isinstance(value, str):
            raise ValueError("must be an RFC 3339 time string")
        parsed = parse_time(value)
        if parsed is None:
            raise ValueError("must be set (got Go's zero time)")
        return parsed

    @field_validator("ends_at", mode="before")
    @classmethod
    def _ends(cls, value: Any) -> float | None:
        if value is None:
            return None
        if not isinstance(value, str):
            raise ValueError("must be an RFC 3339 time string")
        return parse_time(value)


class WebhookPayload(_Model):
    """Alertmanager's webhook payload, version 4."""

    version: str
    group_key: str = Field(alias="groupKey")
    truncated_alerts: int = Field(default=0, ge=0, alias="truncatedAlerts")
    status: Status
    receiver: str
    group_labels: dict[str, str] = Field(default_factory=dict, alias="groupLabels")
    common_labels: dict[str, str] = Field(default_factory=dict, alias="commonLabels")
    common_annotations: dict[str, str] = Field(default_factory=dict, alias="commonAnnotations")
    external_url: str = Field(default="", alias="externalURL")
    alerts: list[WebhookAlert]


def parse_webhook(body: bytes) -> list[IncomingAlert]:
    """The alerts of one webhook POST body; IntakeError names what is wrong with it."""
    try:
        data = load_bounded(body)
    except TooDeep as exc:
        raise IntakeError(f"body: {exc}") from None
    except UnicodeDecodeError:
        raise IntakeError("body is not UTF-8 JSON") from None
    except json.JSONDecodeError as exc:
        raise IntakeError(
            f"body is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    if not isinstance(data, dict):
        raise IntakeError(
            f"body is not a JSON object but {type(data).__name__}; expected Alertmanager's "
            "webhook payload"
        )
    version = data.get("version")
    if version != WEBHOOK_VERSION:
        raise IntakeError(
            f"version: expected Alertmanager's webhook payload version {WEBHOOK_VERSION!r}, "
            f"got {version!r}"
        )
    try:
        payload = WebhookPayload.model_validate(data)
    except ValidationError as exc:
        raise IntakeError(_describe(exc)) from None
    return [
        IncomingAlert(
            status=alert.status,
            labels=dict(alert.labels),
            annotations=dict(alert.annotations),
            starts_at=alert.starts_at,
            ends_at=alert.ends_at,
            generator_url=alert.generator_url,
            source_fingerprint=alert.fingerprint,
        )
        for alert in payload.alerts
    ]


_PAYLOAD_NAMES = {n: i.alias or n for n, i in WebhookPayload.model_fields.items()}
_ALERT_NAMES = {n: i.alias or n for n, i in WebhookAlert.model_fields.items()}


def _describe(exc: ValidationError) -> str:
    """The first problem, as ``alerts[0].startsAt: missing`` (the payload's own names)."""
    error = exc.errors()[0]
    loc = list(error["loc"])
    if loc:  # field names as the payload spells them (not label names)
        loc[0] = _PAYLOAD_NAMES.get(str(loc[0]), loc[0])
    if len(loc) > 2 and loc[0] == "alerts":
        loc[2] = _ALERT_NAMES.get(str(loc[2]), loc[2])
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    kind = error["type"]
    if kind == "missing":
        reason = "missing"
    elif kind == "value_error":
        reason = str(error.get("ctx", {}).get("error") or error["msg"])
    else:
        reason = str(error["msg"]).lower()
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{path}: {reason}{more}" if path else f"{reason}{more}"
