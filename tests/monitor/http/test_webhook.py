"""The webhook receiver: its payload against the real Alertmanager's webhook body (firing,
partly resolved, resolved; with and without max_alerts), and delivery outcomes against a local
HTTP server."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import requests
from hypothesis import given
from hypothesis import strategies as st

from lossguard.monitor.notify.integrations.webhook import (
    WebhookIntegration,
    go_time,
    quote_meta,
    webhook_payload,
)
from lossguard.monitor.notify.model import AlertInfo, Notification
from lossguard.monitor.rules.alerting import fingerprint
from tests.support.amserver import CaptureServer, alertmanager
from tests.support.processes import free_port, wait_for

pytestmark = pytest.mark.live

RECEIVER = "ml-ops.webhook (p1)"  # regexp-special characters, a space and a dash
GROUP_BY = ("alertname", "run_id")
MAX_ALERTS = 2
HEX16 = re.compile(r"[0-9a-f]{16}")
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


@pytest.fixture
def capture() -> Iterator[CaptureServer]:
    server = CaptureServer()
    yield server
    server.close()


def am_config(full_url: str, cut_url: str) -> dict[str, Any]:
    """One route grouping by alertname and run_id; one receiver with two webhooks, the second
    cut to MAX_ALERTS."""
    hook = {"send_resolved": True}
    return {
        "route": {
            "receiver": RECEIVER,
            "group_by": list(GROUP_BY),
            "group_wait": "1s",
            "group_interval": "1s",
            "repeat_interval": "1h",
        },
        "receivers": [
            {
                "name": RECEIVER,
                "webhook_configs": [
                    {**hook, "url": full_url},
                    {**hook, "url": cut_url, "max_alerts": MAX_ALERTS},
                ],
            }
        ],
    }


def rfc3339(micros: int) -> str:
    """How the test writes times to Alertmanager (independent of go_time)."""
    return (EPOCH + timedelta(microseconds=micros)).isoformat().replace("+00:00", "Z")


def alert_labels() -> list[dict[str, str]]:
    """Four alerts of one group whose order in Alertmanager depends on job, label count and
    values: 2 (has a job), 3 (fewer labels), 1 (rank 0), 0. The first two, the ones sent with
    max_alerts, share a label and an annotation more than all four do."""
    base = {"alertname": "LossSpike", "run_id": "run-7"}
    return [
        {**base, "severity": "critical", "rank": "1"},
        {**base, "severity": "critical", "rank": "0"},
        {**base, "severity": "warning", "rank": "2", "job": "trainer"},
        {**base, "severity": "warning"},
    ]


class Group:
    """The alerts the test sends to Alertmanager and the Notification lossguard would make."""

    def __init__(self, external_url: str, start_us: int) -> None:
        self.external_url = external_url
        self.labels = alert_labels()
        self.starts_us = [start_us + i * 25_000 + 4_700 for i in range(len(self.labels))]
        self.ends_us: dict[int, int] = {}

    def postable(self, indices: list[int]) -> list[dict[str, Any]]:
        return [self._postable(i) for i in indices]

    def resolve(self, indices: list[int], ends_us: int) -> list[dict[str, Any]]:
        for i in indices:
            self.ends_us[i] = ends_us
        return self.postable(indices)

    def notification(self, indices: list[int]) -> Notification:
        group_labels = {name: self.labels[0][name] for name in GROUP_BY}
        key = ", ".join(f'{name}="{value}"' for name, value in sorted(group_labels.items()))
        return Notification(
            receiver=RECEIVER,
            integration="webhook",
            index=0,
            group_key=f"{{}}:{{{key}}}",
            group_labels=group_labels,
            alerts=tuple(self._info(i) for i in indices),
            created_at=time.time(),
        )

    def _postable(self, i: int) -> dict[str, Any]:
        alert = {
            "labels": self.labels[i],
            "annotations": self._annotations(i),
            "startsAt": rfc3339(self.starts_us[i]),
            "generatorURL": self.external_url,
        }
        return {**alert, "endsAt": rfc3339(self.ends_us[i])} if i in self.ends_us else alert

    def _annotations(self, i: int) -> dict[str, str]:
        runbook = {"runbook_url": "https://runbooks/loss-spike"} if i in (2, 3) else {}
        return {"summary": "loss spiked", "description": f"alert {i} spiked", **runbook}

    def _info(self, i: int) -> AlertInfo:
        ends = self.ends_us.get(i)
        return AlertInfo(
            fingerprint=fingerprint(self.labels[i]),
            status="firing" if ends is None else "resolved",
            labels=self.labels[i],
            annotations=self._annotations(i),
            value=1.0,
            starts_at=self.starts_us[i] / 1e6,
            ends_at=None if ends is None else ends / 1e6,
            step=120,
            actions=("rolled back 1 time",),
        )


def now_ms() -> int:
    """The time now in microseconds, to the millisecond (as Prometheus sends)."""
    return time.time_ns() // 1_000_000 * 1000


def assert_same_as_alertmanager(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Identical keys (in order) and values at every level; fingerprints only in format."""
    assert list(ours) == list(theirs)
    assert [list(a) for a in ours["alerts"]] == [list(a) for a in theirs["alerts"]]
    for alert in [*ours["alerts"], *theirs["alerts"]]:
        assert HEX16.fullmatch(alert.pop("fingerprint"))
    assert ours == theirs


def wait_for_body(capture: CaptureServer, path: str, count: int) -> Any:
    what = f"Alertmanager's webhook body #{count} on {path}"
    wait_for(lambda: len(capture.bodies(path)) >= count, 10, what)
    return capture.bodies(path)[count - 1]


def test_payload_matches_alertmanager(tmp_path: Path, capture: CaptureServer) -> None:
    full, cut = "/hook/full", "/hook/cut"
    config = am_config(capture.url(full), capture.url(cut))
    with alertmanager(tmp_path / "am", config) as am:
        group = Group(am.url, time.time_ns() // 1000 - 150_000)
        everyone = [0, 1, 2, 3]

        def check(step: int, indices: list[int]) -> None:
            expected = group.notification(indices)
            assert_same_as_alertmanager(
                webhook_payload(expected, external_url=am.url), wait_for_body(capture, full, step)
            )
            assert_same_as_alertmanager(
                webhook_payload(expected, MAX_ALERTS, am.url), wait_for_body(capture, cut, step)
            )

        am.post_alerts(group.postable(everyone))
        check(1, everyone)
        order = [a["annotations"]["description"] for a in capture.bodies(full)[0]["alerts"]]
        assert order == [f"alert {i} spiked" for i in (2, 3, 1, 0)]

        # The alerts sent with max_alerts are resolved, others fire: "resolved" there.
        am.post_alerts(group.resolve([2, 3], now_ms()))
        check(2, everyone)
        assert [capture.bodies(path)[1]["status"] for path in (full, cut)] == ["firing", "resolved"]

        # Alertmanager forgets a resolved alert once it has been notified.
        am.post_alerts(group.resolve([0, 1], now_ms()))
        check(3, [0, 1])
        assert capture.bodies(full)[2]["status"] == "resolved"


def notification(alerts: int, truncated: int = 0) -> Notification:
    infos = tuple(
        AlertInfo(
            fingerprint=f"{i:016x}",
            status="firing" if i % 2 else "resolved",
            labels={"alertname": "NaNLoss", "run_id": "r", "rank": str(i)},
            annotations={"summary": "loss is NaN"},
            value=float("nan"),
            starts_at=1_700_000_000.25 + i,
            ends_at=None if i % 2 else 1_700_000_100.0,
        )
        for i in range(alerts)
    )
    return Notification(
        receiver="hooks",
        integration="webhook",
        index=0,
        group_key='{}:{alertname="NaNLoss"}',
        group_labels={"alertname": "NaNLoss"},
        alerts=infos,
        created_at=1_700_000_200.0,
        truncated_alerts=truncated,
    )


@given(st.integers(1, 6), st.integers(0, 8), st.integers(0, 3))
def test_max_alerts_keeps_the_first_alerts_and_counts_the_rest(
    alerts: int, limit: int, truncated: int
) -> None:
    """Alerts the notification already left out count too."""
    full = webhook_payload(notification(alerts, truncated))
    cut = webhook_payload(notification(alerts, truncated), limit)
    kept = full["alerts"][:limit] if limit else full["alerts"]
    assert cut["alerts"] == kept
    assert cut["truncatedAlerts"] == truncated + alerts - len(kept)
    assert cut["status"] == ("firing" if any(a["status"] == "firing" for a in kept) else "resolved")


@given(st.integers(0, 4_102_444_800 * 10**6))
def test_times_are_go_rfc3339_to_the_microsecond(micros: int) -> None:
    text = go_time(micros / 1e6)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{0,5}[1-9])?Z", text), text
    parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    assert parsed == EPOCH + timedelta(microseconds=micros)


def test_firing_alert_ends_at_go_zero_time() -> None:
    sent = notification(2)
    still_firing = replace(sent.alerts[1], ends_at=1_700_000_300.0)  # as dispatch.go zeroes it
    payload = webhook_payload(replace(sent, alerts=(sent.alerts[0], still_firing)))
    assert [a["endsAt"] for a in payload["alerts"]] == [
        "2023-11-14T22:15:00Z",  # rank 0, resolved
        "0001-01-01T00:00:00Z",  # rank 1, firing
    ]
    assert payload["alerts"][0]["startsAt"] == "2023-11-14T22:13:20.25Z"


def test_receiver_name_is_quoted_as_go_regexp_quotemeta() -> None:
    assert quote_meta(r"a.b+c*d?e(f)g|h[i]j{k}l^m$n\o p-q#r&s~t") == (
        r"a\.b\+c\*d\?e\(f\)g\|h\[i\]j\{k\}l\^m\$n\\o p-q#r&s~t"
    )


@pytest.mark.parametrize(
    ("status", "result"),
    [(200, "delivered"), (204, "delivered"), (500, "retry"), (429, "retry"), (404, "dead")],
)
def test_delivery_outcome(capture: CaptureServer, status: int, result: str) -> None:
    secret = "/hooks/T0KEN-d0-not-leak"
    capture.status = status
    hook = WebhookIntegration(capture.url(secret), send_resolved=True, max_alerts=1)
    sent = notification(3)
    with requests.Session() as session:
        outcome = hook.deliver(sent, 41, session, timeout_s=5)
    assert (outcome.result, outcome.status) == (result, status)
    assert "T0KEN" not in outcome.detail and "127.0.0.1" not in outcome.detail
    [(path, headers, body)] = capture.posts
    assert path == secret
    assert headers["Content-Type"] == "application/json"
    assert body == webhook_payload(sent, 1)
    assert (body["truncatedAlerts"], len(body["alerts"])) == (2, 1)


def test_unreachable_receiver_is_retried_without_naming_it() -> None:
    hook = WebhookIntegration(
        f"http://127.0.0.1:{free_port()}/T0KEN", send_resolved=False, max_alerts=0
    )
    with requests.Session() as session:
        outcome = hook.deliver(notification(1), 1, session, timeout_s=5)
    assert outcome.result == "retry"
    assert "T0KEN" not in outcome.detail and "127.0.0.1" not in outcome.detail
