"""The Slack, PagerDuty and log receivers: what they render, and what each reply of the fake
services (real HTTP servers on 127.0.0.1) means for delivery."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import re
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lossguard.common.config import ConfigError
from lossguard.monitor.notify.config import NotificationsConfig
from lossguard.monitor.notify.integrations.log import LogIntegration
from lossguard.monitor.notify.integrations.pagerduty import (
    PagerDutyIntegration,
    pagerduty_event,
    severity,
)
from lossguard.monitor.notify.integrations.slack import (
    ALERT_BLOCKS,
    SlackIntegration,
    slack_message,
)
from lossguard.monitor.notify.links import Links
from lossguard.monitor.notify.model import AlertInfo, Notification
from tests.support.fake_receivers import FakePagerDuty, FakeSlack, parse_fault, slack_problem
from tests.support.processes import wait_for

NOW = 1_700_000_000.0
TIMEOUT = 0.3
FP = "0123456789abcdef"
GROUP_KEY = '{}/{severity="critical"}:{alertname="LossSpikeNotRecovering"}'
LINKS = Links(
    dashboard_url="https://grafana.example/d/lg?var-run={run_id}&var-rank={rank}",
    runbook_base_url="https://github.com/acme/lossguard/blob/main/",
    monitor_url="http://monitor.example:9411",
)


STATUS_STEP = "look at the run: lossguard-ctl --run-dir runs/abc status"


def alert(status: str = "firing", fingerprint: str = FP, **labels: str) -> AlertInfo:
    return AlertInfo(
        fingerprint=fingerprint,
        status=status,  # type: ignore[arg-type]
        labels={
            "alertname": "LossSpikeNotRecovering",
            "severity": "critical",
            "run_id": "abc",
            "rank": "0",
            "job": "lossguard",
            **labels,
        },
        annotations={
            "summary": "Loss spike not recovering in run abc",
            "description": "Loss has stayed 3x above its EMA for 300 steps.",
            "runbook_url": "docs/runbook.md#lossspikenotrecovering",
        },
        value=3.25,
        starts_at=NOW,
        ends_at=NOW + 600 if status == "resolved" else None,
        step=1200,
        actions=("rolled back 1 time",),
        next_steps=(STATUS_STEP,),
    )


def note(*alerts: AlertInfo, kind: str = "slack", truncated: int = 0) -> Notification:
    return Notification(
        receiver="team",
        integration=kind,
        index=0,
        group_key=GROUP_KEY,
        group_labels={"alertname": "LossSpikeNotRecovering", "severity": "critical"},
        alerts=alerts,
        created_at=NOW,
        truncated_alerts=truncated,
    )


def texts(block: dict[str, Any]) -> str:
    """All text of a block, fields and elements included."""
    parts = [block.get("text", {}).get("text", "")]
    parts += [f["text"] for f in block.get("fields", [])]
    parts += [e["text"] for e in block.get("elements", [])]
    return "\n".join(parts)


@pytest.fixture
def slack() -> Iterator[FakeSlack]:
    with FakeSlack() as fake:
        yield fake


@pytest.fixture
def pagerduty() -> Iterator[FakePagerDuty]:
    with FakePagerDuty() as fake:
        yield fake


@pytest.fixture
def session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


# Links ------------------------------------------------------------------------------------


def test_dashboard_fills_label_placeholders_url_quoted() -> None:
    links = Links(dashboard_url="https://g.example/d?run={run_id}&rank={rank}&x={missing}")
    assert links.dashboard({"run_id": "a b/c&d", "rank": "3"}) == (
        "https://g.example/d?run=a%20b%2Fc%26d&rank=3&x="
    )
    assert Links().dashboard({"run_id": "abc"}) is None


def test_runbook_resolves_relative_urls_against_the_base() -> None:
    relative = {"runbook_url": "docs/runbook.md#lossspike"}
    absolute = {"runbook_url": "https://wiki.example/runbook#x"}
    assert LINKS.runbook(relative) == (
        "https://github.com/acme/lossguard/blob/main/docs/runbook.md#lossspike"
    )
    assert LINKS.runbook(absolute) == "https://wiki.example/runbook#x"
    assert LINKS.runbook({}) is None
    assert LINKS.runbook({"runbook_url": " "}) is None
    assert Links().runbook(relative) == "docs/runbook.md#lossspike"


# Slack rendering --------------------------------------------------------------------------


def test_slack_firing_message_shows_each_alert_in_full() -> None:
    quiet = replace(alert(rank="1", fingerprint="f" * 16), actions=(), next_steps=())
    message = slack_message(note(alert(), quiet), 42, LINKS)
    header, first, second, context = message["blocks"]
    assert slack_problem(message) is None
    assert header["text"]["text"] == ":red_circle: FIRING: LossSpikeNotRecovering"
    assert message["text"] == (
        "[FIRING:2] LossSpikeNotRecovering run=abc (critical): Loss spike not recovering in run abc"
    )
    for section, rank, actions in ((first, "0", "rolled back 1 time"), (second, "1", "none")):
        shown = texts(section)
        for fact in (
            "*LossSpikeNotRecovering* FIRING",
            "*Summary:* Loss spike not recovering in run abc",
            "*Description:* Loss has stayed 3x above its EMA for 300 steps.",
            "*Severity*\ncritical",
            "*Run*\nabc",
            f"*Rank*\n{rank}",
            "*Step*\n1200",
            "*Value*\n3.25",
            f"*Actions*\n{actions}",
            "<https://github.com/acme/lossguard/blob/main/docs/runbook.md#lossspikenotrecovering|",
            f"<https://grafana.example/d/lg?var-run=abc&amp;var-rank={rank}|",
        ):
            assert fact in shown, (fact, shown)
    assert "*Next steps:*\n• look at the run: `lossguard-ctl --run-dir runs/abc status`" in (
        texts(first)
    )
    assert "Next steps" not in texts(second)
    assert context["type"] == "context"
    assert "lossguard notification #42" in texts(context)
    assert GROUP_KEY in texts(context)
    assert "<http://monitor.example:9411|lossguard-monitor>" in texts(context)


def test_slack_resolved_message_reads_resolved() -> None:
    message = slack_message(note(alert("resolved"), alert("resolved", rank="1")), 7, LINKS)
    assert message["blocks"][0]["text"]["text"] == (
        ":large_green_circle: RESOLVED: LossSpikeNotRecovering"
    )
    assert message["text"].startswith("[RESOLVED] LossSpikeNotRecovering run=abc (critical)")
    body = json.dumps(message)
    assert "FIRING" not in body and ":red_circle:" not in body
    assert "*Resolved*\n<!date^1700000600^" in texts(message["blocks"][1])


def test_slack_mixed_message_lists_firing_alerts_first() -> None:
    message = slack_message(note(alert("resolved", rank="1"), alert(rank="0")), 7, LINKS)
    assert message["text"].startswith("[FIRING:1]")
    first, second = message["blocks"][1:3]
    assert ":red_circle: *LossSpikeNotRecovering* FIRING" in texts(first)
    assert ":large_green_circle: *LossSpikeNotRecovering* RESOLVED" in texts(second)


def test_slack_escapes_control_characters() -> None:
    sneaky = replace(alert(), annotations={"summary": "<!channel> loss & <http://x|click>"})
    body = json.dumps(slack_message(note(sneaky), 1, Links()))
    assert "<!channel>" not in body and "<http://x" not in body
    assert "&lt;!channel&gt; loss &amp; &lt;http://x|click&gt;" in body


def more_alerts(message: dict[str, Any]) -> int:
    found = [re.search(r"and (\d+) more alerts?", texts(b)) for b in message["blocks"]]
    return sum(int(m[1]) for m in found if m)


@pytest.mark.parametrize("count", [ALERT_BLOCKS, ALERT_BLOCKS + 1, 200])
def test_slack_message_counts_the_alerts_it_leaves_out(count: int) -> None:
    alerts = [alert(rank=str(i), fingerprint=f"{i:016x}") for i in range(count)]
    message = slack_message(note(*alerts, truncated=3), 1, LINKS)
    sections = [b for b in message["blocks"] if "*LossSpikeNotRecovering*" in texts(b)]
    assert len(message["blocks"]) <= 50
    assert len(sections) == min(count, ALERT_BLOCKS)
    assert more_alerts(message) == count + 3 - len(sections)
    assert slack_problem(message) is None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    count=st.integers(1, 70),
    truncated=st.integers(0, 5),
    name=st.text(min_size=1, max_size=300),
    words=st.text(max_size=40),
    repeat=st.integers(0, 200),
    actions=st.lists(st.text(max_size=300), max_size=10),
)
@example(
    count=60, truncated=2, name="N" * 200, words="<&> words ", repeat=500, actions=["a" * 2500]
)
def test_slack_messages_always_fit_slacks_limits(
    count: int, truncated: int, name: str, words: str, repeat: int, actions: list[str]
) -> None:
    long = words * repeat
    base = replace(
        alert(alertname=name, run_id=long[:5000]),
        annotations={"summary": long, "description": long, "runbook_url": long[:3000]},
        actions=tuple(actions),
        next_steps=tuple(actions),
    )
    alerts = [replace(base, fingerprint=f"{i:016x}") for i in range(count)]
    message = slack_message(note(*alerts, truncated=truncated), 1, LINKS)
    assert slack_problem(message) is None
    shown = sum(1 for b in message["blocks"] if b.get("fields"))
    assert shown + more_alerts(message) == count + truncated


# PagerDuty rendering ----------------------------------------------------------------------


GROUP_DEDUP_KEY = hashlib.sha256(GROUP_KEY.encode()).hexdigest()


def details(a: AlertInfo, **changed: Any) -> dict[str, Any]:
    """What custom_details says of one alert."""
    return {
        "status": a.status,
        "labels": a.labels,
        "annotations": a.annotations,
        "value": "3.25",
        "step": 1200,
        "actions": ["rolled back 1 time"],
        "next_steps": [STATUS_STEP],
        "starts_at": "2023-11-14T22:13:20.000+00:00",
        "ends_at": None if a.ends_at is None else "2023-11-14T22:23:20.000+00:00",
        "fingerprint": a.fingerprint,
        **changed,
    }


def test_pagerduty_trigger_event() -> None:
    firing = alert(instance="node-3:9400")
    assert pagerduty_event(note(firing, kind="pagerduty"), LINKS) == {
        "event_action": "trigger",
        "dedup_key": GROUP_DEDUP_KEY,
        "payload": {
            "summary": "[critical] LossSpikeNotRecovering run=abc rank=0: "
            "Loss spike not recovering in run abc",
            "source": "node-3:9400",
            "severity": "critical",
            "timestamp": "2023-11-14T22:13:20.000+00:00",
            "component": "rank 0",
            "group": "abc",
            "class": "LossSpikeNotRecovering",
            "custom_details": {
                "firing": 1,
                "resolved": 0,
                "group_labels": {"alertname": "LossSpikeNotRecovering", "severity": "critical"},
                "alerts": [details(firing)],
                "more_alerts": 0,
            },
        },
        "client": "lossguard",
        "client_url": "http://monitor.example:9411",
        "links": [
            {"href": "https://grafana.example/d/lg?var-run=abc&var-rank=0", "text": "Dashboard"},
            {
                "href": "https://github.com/acme/lossguard/blob/main/docs/runbook.md"
                "#lossspikenotrecovering",
                "text": "Runbook",
            },
        ],
    }


def test_pagerduty_sends_one_event_for_a_group_with_a_count() -> None:
    """Alertmanager's way: the group's alerts in one event, its summary counting and naming the
    firing ones, the most severe of them its severity; resolved ones are only in the details."""
    ranks = [alert(rank="0"), alert(fingerprint="1" * 16, rank="1", severity="warning")]
    ended = alert("resolved", fingerprint="2" * 16, rank="2")
    event = pagerduty_event(note(*ranks, ended, kind="pagerduty"), LINKS)
    payload = event["payload"]
    assert event["dedup_key"] == GROUP_DEDUP_KEY and event["event_action"] == "trigger"
    assert payload["summary"] == (
        "[mixed] 2 alerts firing: LossSpikeNotRecovering run=abc rank=0: Loss spike not "
        "recovering in run abc; LossSpikeNotRecovering run=abc rank=1: Loss spike not "
        "recovering in run abc"
    )
    assert (payload["severity"], payload["component"], payload["group"]) == (
        "critical",
        "lossguard",  # the ranks differ: the common job
        "abc",
    )
    assert payload["custom_details"]["firing"] == 2
    assert payload["custom_details"]["resolved"] == 1
    assert payload["custom_details"]["alerts"] == [details(a) for a in (*ranks, ended)]
    assert [link["text"] for link in event["links"]] == ["Dashboard", "Runbook"]


def test_pagerduty_resolves_the_group_once_every_alert_has_resolved() -> None:
    one_left = note(alert(), alert("resolved", fingerprint="1" * 16, rank="1"), kind="pagerduty")
    assert pagerduty_event(one_left, LINKS)["event_action"] == "trigger"
    resolved = note(alert("resolved"), alert("resolved", rank="1"), kind="pagerduty")
    assert pagerduty_event(resolved, LINKS) == {
        "event_action": "resolve",
        "dedup_key": GROUP_DEDUP_KEY,
    }
    other = replace(resolved, group_key='{}/{severity="critical"}:{alertname="Other"}')
    assert pagerduty_event(other, LINKS)["dedup_key"] != GROUP_DEDUP_KEY


def test_pagerduty_event_without_optional_facts() -> None:
    bare = AlertInfo(FP, "firing", {"alertname": "Down"}, {}, float("nan"), NOW)
    event = pagerduty_event(note(bare), Links(runbook_base_url="", monitor_url=""))
    assert event["payload"]["source"] == "lossguard-monitor"
    assert event["payload"]["severity"] == "error"
    assert event["payload"]["summary"] == "[none] Down"
    assert event["payload"]["custom_details"]["alerts"][0]["value"] == "NaN"
    assert "component" not in event["payload"] and "group" not in event["payload"]
    assert event["links"] == [] and "client_url" not in event
    json.dumps(event, allow_nan=False)  # strict JSON: NaN travels as text
    relative = replace(alert(job="trainer"), labels={"alertname": "X", "job": "trainer"})
    assert pagerduty_event(note(relative), Links())["payload"]["component"] == "trainer"
    assert pagerduty_event(note(relative), Links())["payload"]["source"] == "lossguard-monitor"


def test_pagerduty_details_of_a_huge_group_are_capped() -> None:
    many = [alert(fingerprint=f"{i:016x}", rank=str(i)) for i in range(150)]
    event = pagerduty_event(note(*many, truncated=7), LINKS)
    custom = event["payload"]["custom_details"]
    assert len(custom["alerts"]) == 100 and custom["more_alerts"] == 57
    assert event["payload"]["summary"].startswith("[critical] 150 alerts firing: ")
    assert len(event["payload"]["summary"]) == 1024


@given(st.text(max_size=3000))
@example("s" * 2000)
@example("s" * (1024 - len("[critical] LossSpikeNotRecovering run=abc rank=0: ")))
def test_pagerduty_summary_is_at_most_1024_characters(text: str) -> None:
    event = pagerduty_event(note(replace(alert(), annotations={"summary": text})), LINKS)
    summary = event["payload"]["summary"]
    full = " ".join(f"[critical] LossSpikeNotRecovering run=abc rank=0: {text}".split())
    full = full.removesuffix(":") if not text else full
    if len(full) <= 1024:
        assert summary == full
    else:
        assert len(summary) == 1024 and summary.endswith("…")
        assert full.startswith(summary[:-1])


@pytest.mark.parametrize(
    ("label", "expected"),
    [
        ("critical", "critical"),
        ("CRITICAL", "critical"),
        ("error", "error"),
        ("warning", "warning"),
        ("info", "info"),
        ("page", "error"),
        ("", "error"),
    ],
)
def test_pagerduty_severity(label: str, expected: str) -> None:
    assert severity(label) == expected


# Slack delivery ---------------------------------------------------------------------------


def slack_to(fake: FakeSlack) -> SlackIntegration:
    return SlackIntegration(fake.webhook_url, send_resolved=True, links=LINKS)


def test_slack_delivers_in_order(slack: FakeSlack, session: requests.Session) -> None:
    integration = slack_to(slack)
    for notification_id in (3, 1, 2):
        outcome = integration.deliver(note(alert()), notification_id, session, TIMEOUT)
        assert outcome.result == "delivered", outcome
    assert slack.accepted_ids() == [3, 1, 2]
    assert slack.messages[0].body == slack_message(note(alert()), 3, LINKS)


@pytest.mark.parametrize(
    ("fault", "result", "words"),
    [
        ((200, "not ok"), "dead", ["HTTP 200 not ok", "may have been posted"]),
        (400, "dead", ["HTTP 400 invalid_payload"]),
        (403, "dead", ["HTTP 403 action_prohibited"]),
        (404, "dead", ["HTTP 404 channel_not_found"]),
        (410, "dead", ["HTTP 410 channel_is_archived"]),
        (500, "retry", ["HTTP 500 rollup_error"]),
        ((429, 2), "retry", ["HTTP 429 rate_limited"]),
        ("drop", "retry", ["connection dropped"]),
        (("slow", 2.0), "retry", [f"no reply within {TIMEOUT:g}s"]),
    ],
)
def test_slack_outcomes(
    slack: FakeSlack, session: requests.Session, fault: Any, result: str, words: list[str]
) -> None:
    slack.script([fault])
    outcome = slack_to(slack).deliver(note(alert()), 9, session, TIMEOUT)
    assert outcome.result == result, outcome
    for word in words:
        assert word in outcome.detail
    assert outcome.retry_after_s == (2.0 if fault == (429, 2) else None)
    # The real Slack posts a message whose reply was slow; no other fault posts anything.
    assert slack.accepted_ids() == ([9] if fault == ("slow", 2.0) else [])


def test_slack_rejects_wrong_tokens_and_paths(slack: FakeSlack, session: requests.Session) -> None:
    wrong_token = SlackIntegration(slack.webhook_url[:-1] + "x", True, LINKS)
    wrong_path = SlackIntegration(f"{slack.base_url}/services/nothing", True, LINKS)
    assert wrong_token.deliver(note(alert()), 1, session, TIMEOUT).detail == (
        "HTTP 403 invalid_token"
    )
    assert wrong_path.deliver(note(alert()), 1, session, TIMEOUT).detail == "HTTP 404 no_service"
    assert slack.accepted_ids() == []


def test_closed_service_is_refused(session: requests.Session) -> None:
    with FakeSlack() as slack:
        integration = slack_to(slack)
        assert integration.deliver(note(alert()), 1, session, TIMEOUT).result == "delivered"
    outcome = integration.deliver(note(alert()), 2, session, TIMEOUT)
    assert (outcome.result, outcome.detail) == ("retry", "connection refused")


# PagerDuty delivery -----------------------------------------------------------------------


def pd_to(fake: FakePagerDuty, key: str | None = None) -> PagerDutyIntegration:
    return PagerDutyIntegration(fake.enqueue_url, key or fake.routing_key, True, LINKS)


def test_pagerduty_pages_once_per_group(
    pagerduty: FakePagerDuty, session: requests.Session
) -> None:
    """A node's 8 agents down in one group: one incident, retries and repeats folded into it,
    resolved when the last alert of the group resolves."""
    integration = pd_to(pagerduty)
    ranks = [alert(fingerprint=f"{r:016x}", rank=str(r)) for r in range(8)]
    firing = note(*ranks, kind="pagerduty")
    for notification_id in (1, 2):  # a retry, or the same group after a restart
        assert integration.deliver(firing, notification_id, session, TIMEOUT).result == "delivered"
    (incident,) = pagerduty.incidents
    assert (incident.dedup_key, incident.triggers, incident.open) == (GROUP_DEDUP_KEY, 2, True)
    assert incident.summary.startswith("[critical] 8 alerts firing: LossSpikeNotRecovering")
    half = note(*ranks[:4], *(replace(a, status="resolved") for a in ranks[4:]), kind="pagerduty")
    assert integration.deliver(half, 3, session, TIMEOUT).result == "delivered"
    (incident,) = pagerduty.open_incidents()  # still open: 4 alerts fire; the trigger logged
    assert incident.log[-1].startswith("[critical] 4 alerts firing: LossSpikeNotRecovering")
    resolved = note(*(replace(a, status="resolved") for a in ranks[:4]), kind="pagerduty")
    assert integration.deliver(resolved, 4, session, TIMEOUT).result == "delivered"
    assert pagerduty.open_incidents() == [] and pagerduty.incidents[0].resolved_at is not None
    assert [e.body["event_action"] for e in pagerduty.events] == [
        "trigger",
        "trigger",
        "trigger",
        "resolve",
    ]
    assert all(e.body["routing_key"] == pagerduty.routing_key for e in pagerduty.events)


def test_pagerduty_retries_throttling_and_server_errors(
    pagerduty: FakePagerDuty, session: requests.Session
) -> None:
    pagerduty.script([(429, 1), 502, "drop"])
    integration = pd_to(pagerduty)
    outcomes = [integration.deliver(note(alert()), 1, session, TIMEOUT) for _ in range(4)]
    assert [o.result for o in outcomes] == ["retry", "retry", "retry", "delivered"]
    assert outcomes[0].retry_after_s == 1.0 and "throttle event" in outcomes[0].detail
    assert outcomes[2].detail == "connection dropped"
    assert len(pagerduty.incidents) == 1 and len(pagerduty.events) == 1


def test_pagerduty_invalid_event_is_dead(
    pagerduty: FakePagerDuty, session: requests.Session
) -> None:
    key = "k" * 31
    outcome = pd_to(pagerduty, key).deliver(note(alert()), 1, session, TIMEOUT)
    assert (outcome.result, outcome.status) == ("dead", 400)
    assert "invalid event" in outcome.detail and key not in outcome.detail
    assert pagerduty.incidents == []


def test_no_secret_in_any_outcome(session: requests.Session) -> None:
    faults: list[Any] = [200, (200, "nope"), 400, 403, 404, 410, (429, 1), 500, "drop"]
    faults.append(("slow", 1.0))
    details = []
    with FakeSlack() as slack, FakePagerDuty() as pagerduty:
        slack.script(faults)
        pagerduty.script(faults)
        for integration in (slack_to(slack), pd_to(pagerduty)):
            for _ in faults:
                details.append(integration.deliver(note(alert()), 1, session, TIMEOUT).detail)
        broken = pd_to(pagerduty, pagerduty.routing_key[:-1])
        details.append(broken.deliver(note(alert()), 1, session, TIMEOUT).detail)
    details.append(slack_to(slack).deliver(note(alert()), 1, session, TIMEOUT).detail)
    assert len(set(details)) >= 10
    for secret in (slack.token, pagerduty.routing_key, pagerduty.routing_key[:-1]):
        assert not [d for d in details if secret in d]


# Log receiver -----------------------------------------------------------------------------


def test_log_receiver_writes_one_line_per_alert(caplog: pytest.LogCaptureFixture) -> None:
    multi_line = replace(alert(), annotations={"summary": "loss\nspiked"})
    notification = note(multi_line, alert("resolved", rank="1"), kind="log")
    with caplog.at_level(logging.INFO, logger="lossguard.monitor.notify"):
        outcome = LogIntegration(True).deliver(notification, 5, requests.Session(), TIMEOUT)
    assert outcome.result == "delivered"
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.WARNING,
            "FIRING LossSpikeNotRecovering run=abc rank=0 step=1200 value=3.25: loss spiked "
            f"Done: rolled back 1 time. Next: {STATUS_STEP}. (notification #5 to team)",
        ),
        (
            logging.INFO,
            "RESOLVED LossSpikeNotRecovering run=abc rank=1 step=1200 value=3.25: "
            "Loss spike not recovering in run abc -- Loss has stayed 3x above its EMA for 300 "
            "steps. Done: rolled back 1 time. (notification #5 to team)",
        ),
    ]


# Integrations -----------------------------------------------------------------------------


def notifications_config(pd_url: str) -> NotificationsConfig:
    return NotificationsConfig.model_validate(
        {
            "dashboard_url": "https://grafana.example/d/lg?var-run={run_id}",
            "receivers": [
                {
                    "name": "team",
                    "slack_configs": [{"api_url_env": "SLACK_URL", "send_resolved": False}],
                    "pagerduty_configs": [
                        {"routing_key_env": "PD_KEY", "url": pd_url},
                        {"routing_key_env": "PD_KEY_2"},
                    ],
                    "webhook_configs": [{"url_env": "HOOK_URL", "max_alerts": 3}],
                },
                {"name": "console", "log_configs": [{}]},
            ],
            "route": {"receiver": "console"},
        }
    )


def test_build_integrations_one_per_lane(
    slack: FakeSlack, pagerduty: FakePagerDuty, session: requests.Session
) -> None:
    from lossguard.monitor.notify.integrations import build_integrations

    config = notifications_config(pagerduty.enqueue_url)
    secrets = {
        "SLACK_URL": slack.webhook_url,
        "PD_KEY": pagerduty.routing_key,
        "PD_KEY_2": "b" * 32,
        "HOOK_URL": "http://127.0.0.1:9/hook",
    }
    built = build_integrations(config, secrets, "http://monitor.example:9411")
    lanes = {
        replace(note(alert()), receiver=r, integration=k, index=i).lane: k
        for r, k, i in [
            ("team", "slack", 0),
            ("team", "pagerduty", 0),
            ("team", "pagerduty", 1),
            ("team", "webhook", 0),
            ("console", "log", 0),
        ]
    }
    assert {lane: i.kind for lane, i in built.items()} == lanes
    assert [(i.pace_s, i.per_alert) for i in built.values()] == [
        (1.0, False),
        (0.5, False),
        (0.5, False),
        (0.0, False),
        (0.0, False),
    ]
    assert built["team/slack[0]"].send_resolved is False
    assert built["team/pagerduty[0]"].send_resolved is True
    for secret in secrets.values():
        assert all(secret not in repr(i) for i in built.values())
    built["team/slack[0]"].deliver(note(alert()), 4, session, TIMEOUT)
    built["team/pagerduty[0]"].deliver(note(alert()), 5, session, TIMEOUT)
    assert slack.accepted_ids() == [4] and len(pagerduty.incidents) == 1
    assert "var-run=abc" in json.dumps(slack.messages[0].body)


def test_build_integrations_names_a_missing_secret() -> None:
    from lossguard.monitor.notify.integrations import build_integrations

    config = notifications_config("https://events.pagerduty.com/v2/enqueue")
    secrets = {"SLACK_URL": "https://hooks.slack.com/services/T/B/secret", "PD_KEY": "x" * 32}
    with pytest.raises(
        ConfigError, match=r"pagerduty_configs\.1: environment variable PD_KEY_2 is not set"
    ) as error:
        build_integrations(config, secrets, "")
    assert "secret" not in str(error.value) and "x" * 32 not in str(error.value)


# The fakes themselves ---------------------------------------------------------------------


def post(url: str, body: Any, session: requests.Session | None = None) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (session or requests).post(url, data=data, timeout=5)


def test_fake_slack_validates_like_slack(slack: FakeSlack) -> None:
    url = slack.webhook_url
    cases = [
        (url, b"{not json", 400, "invalid_payload"),
        (url, {}, 400, "no_text"),
        (url, {"blocks": [{"type": "divider"}] * 51}, 400, "invalid_blocks"),
        (
            url,
            {"blocks": [{"type": "header", "text": {"type": "plain_text", "text": "h" * 151}}]},
            400,
            "invalid_blocks",
        ),
        (
            url,
            {"blocks": [{"type": "section", "fields": [{"text": "f"}] * 11}]},
            400,
            "invalid_blocks",
        ),
        (url[:-2] + "zz", {"text": "hi"}, 403, "invalid_token"),
        (slack.base_url + "/hooks/x", {"text": "hi"}, 404, "no_service"),
        (url, {"text": "hi"}, 200, "ok"),
    ]
    for target, body, status, reply in cases:
        answer = post(target, body)
        assert (answer.status_code, answer.text) == (status, reply), (body, answer.text)
    assert slack.accepted_ids() == [None]
    assert [e.status for e in slack.exchanges] == [c[2] for c in cases]


def test_fake_pagerduty_validates_like_pagerduty(pagerduty: FakePagerDuty) -> None:
    key = pagerduty.routing_key
    good = {"summary": "s", "source": "h", "severity": "info"}
    cases = [
        (b"[", "Event object format is unrecognized"),
        (
            {"routing_key": "short", "event_action": "trigger", "payload": good},
            "Length of 'routing_key' is incorrect",
        ),
        ({"routing_key": key, "event_action": "page"}, "'event_action' is invalid"),
        ({"routing_key": key, "event_action": "trigger"}, "'payload' is missing"),
        (
            {"routing_key": key, "event_action": "trigger", "payload": {**good, "severity": "x"}},
            "'payload.severity' is invalid",
        ),
        (
            {
                "routing_key": key,
                "event_action": "trigger",
                "payload": {**good, "summary": "s" * 1025},
            },
            "'payload.summary' is too long",
        ),
        ({"routing_key": key, "event_action": "resolve"}, "'dedup_key' is missing"),
    ]
    for body, error in cases:
        answer = post(pagerduty.enqueue_url, body)
        assert answer.status_code == 400
        assert any(error in e for e in [answer.json()["message"], *answer.json()["errors"]]), (
            body,
            answer.text,
        )
    answer = post(
        pagerduty.enqueue_url, {"routing_key": key, "event_action": "trigger", "payload": good}
    )
    assert answer.status_code == 202
    assert answer.json()["status"] == "success" and answer.json()["message"] == "Event processed"
    assert len(pagerduty.open_incidents()) == 1
    assert pagerduty.incidents[0].dedup_key == answer.json()["dedup_key"]


def test_script_answers_the_next_requests_in_order(slack: FakeSlack) -> None:
    slack.script([500, "drop", (429, 7), 404])
    statuses: list[tuple[int | None, str | None]] = []
    with requests.Session() as session:
        for _ in range(5):
            try:
                reply = post(slack.webhook_url, {"text": "hi"}, session)
                statuses.append((reply.status_code, reply.headers.get("Retry-After")))
            except requests.ConnectionError:
                statuses.append((None, None))
    assert statuses == [(500, None), (None, None), (429, "7"), (404, None), (200, None)]
    exchanges = slack.exchanges
    assert [e.status for e in exchanges] == [500, None, 429, 404, 200]
    wait_for(  # a reply's time is noted just after it is written
        lambda: [e.replied_at is None for e in slack.exchanges] == [False, True] + [False] * 3,
        5,
        "the replies' times",
    )
    assert all(a.arrived_at <= b.arrived_at for a, b in itertools.pairwise(exchanges))
    assert slack.pending_script() == 0 and len(slack.messages) == 1


def test_fail_ratio_is_seeded_and_thread_safe() -> None:
    def run(threads: int, per_thread: int) -> tuple[list[int | None], FakePagerDuty]:
        fake = FakePagerDuty()
        fake.fail_ratio(0.5, seed=11, faults=[500, (429, 1), "drop"])
        event = {
            "routing_key": fake.routing_key,
            "event_action": "trigger",
            "dedup_key": "k",
            "payload": {"summary": "s", "source": "h", "severity": "info"},
        }

        def send() -> None:
            with requests.Session() as session:
                for _ in range(per_thread):
                    with contextlib.suppress(requests.ConnectionError):
                        post(fake.enqueue_url, event, session)

        workers = [threading.Thread(target=send) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        fake.close()
        return [e.status for e in fake.exchanges], fake

    sequential, _ = run(1, 30)
    assert run(1, 30)[0] == sequential  # same seed, same faults
    statuses, fake = run(6, 15)
    assert len(statuses) == 90
    accepted = statuses.count(202)
    assert 20 <= accepted <= 70 and len(fake.events) == accepted
    assert fake.incidents[0].triggers == accepted
    assert set(statuses) <= {202, 500, 429, None}


def test_unknown_fault_is_refused() -> None:
    for spec in ("explode", ("slow",), (429, 1.5), ("slow", "x")):
        with pytest.raises(ValueError, match="unknown fault"):
            parse_fault(spec)
