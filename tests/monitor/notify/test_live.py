"""Notifications end to end: an agent with an injected NaN, the monitor as a process, and fake
Slack and PagerDuty servers. The NaN pages (Slack message and PagerDuty incident with what
on-call needs), then resolves in both; ``lossguard-monitor status`` shows it all; the secrets
are nowhere in the log or the state database."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support.fake_receivers import FakePagerDuty, FakeSlack, SlackMessage
from tests.support.processes import (
    free_port,
    monitor_cli,
    start_agent,
    start_monitor,
    stop_processes,
    wait_for,
)
from tests.support.runs import throttle, tiny_settings, write_config, write_monitor_config

pytestmark = pytest.mark.live

RULES = """
groups:
  - name: live
    rules:
      - alert: LossNonFinite
        expr: increase(lossguard_nonfinite_total{signal="loss", rank="0"}[12s]) > 0
        labels: {severity: critical}  # no action: this test is about notifying
        annotations:
          summary: "Non-finite loss in run {{ $labels.run_id }} (rank {{ $labels.rank }})"
          description: "Run {{ $labels.run_id }} had a NaN loss; the step was skipped."
          runbook_url: docs/runbook.md#lossnonfinite
"""
DASHBOARD = "https://grafana.example/d/lossguard/run?var-run_id={run_id}"
RUNBOOKS = "https://runbooks.example/lossguard/"


def notifications() -> dict[str, Any]:
    return {
        "dashboard_url": DASHBOARD,
        "runbook_base_url": RUNBOOKS,
        "receivers": [
            {"name": "oncall-slack", "slack_configs": [{"api_url_env": "LG_TEST_SLACK_URL"}]},
            {
                "name": "oncall-pager",
                "pagerduty_configs": [{"routing_key_env": "LG_TEST_PD_KEY", "url": "PD_URL"}],
            },
        ],
        "route": {
            "receiver": "oncall-slack",
            "group_by": ["alertname", "run_id"],
            "group_wait": "0s",
            "group_interval": "1s",
            "routes": [
                {"receiver": "oncall-pager", "matchers": ['severity="critical"'], "continue": True},
                {"receiver": "oncall-slack", "matchers": ['severity=~"critical|warning"']},
            ],
        },
        "delivery": {"timeout": "2s", "min_backoff": "100ms", "max_backoff": "1s"},
    }


def text_of(message: SlackMessage) -> str:
    """Everything a reader sees in a message: the fallback and every block's text."""
    return json.dumps(message.body, ensure_ascii=False)


def test_a_nan_pages_slack_and_pagerduty_then_resolves_in_both(
    tmp_path: Path, corpus_cache: Path
) -> None:
    runs = tmp_path / "runs"
    with FakeSlack() as slack, FakePagerDuty() as pager:
        settings = notifications()
        settings["receivers"][1]["pagerduty_configs"][0]["url"] = pager.enqueue_url
        rules = tmp_path / "rules.yml"
        rules.write_text(RULES)
        config, monitor_url = write_monitor_config(
            tmp_path / "monitor.yml",
            [rules],
            scrape={"runs_root": str(runs)},
            notifications=settings,
        )
        secrets = {"LG_TEST_SLACK_URL": slack.webhook_url, "LG_TEST_PD_KEY": pager.routing_key}
        monitor = start_monitor(config, env=secrets)
        agent_settings = tiny_settings(
            runs,
            corpus_cache,
            run={"id": "nanrun"},
            train={"max_steps": 10**7, "log_every": 5, "eval_every": 10**6},
            telemetry={"port": free_port()},
            faults=[{"kind": "nonfinite_loss", "step": 40, "duration": 2}, throttle(0.03)],
        )
        agent = start_agent(write_config(tmp_path / "agent.yaml", agent_settings))
        try:
            # firing: one Slack message and one PagerDuty incident, with what on-call needs
            (fired,) = wait_for(lambda: slack.messages, 90, "the Slack page")
            text = text_of(fired)
            assert fired.body["text"].startswith("[FIRING:1] LossNonFinite run=nanrun (critical)")
            for expected in (
                "FIRING",
                "*Severity*\\ncritical",
                "*Run*\\nnanrun",
                "*Rank*\\n0",
                "*Value*\\n",
                "Non-finite loss in run nanrun (rank 0)",
                "Run nanrun had a NaN loss; the step was skipped.",
                f"<{RUNBOOKS}docs/runbook.md#lossnonfinite|Open the runbook>",
                "<https://grafana.example/d/lossguard/run?var-run_id=nanrun|Open the dashboard>",
                f"lossguard notification #{fired.notification_id}",
            ):
                assert expected in text, expected
            step = int(text.split("*Step*\\n")[1].split('"')[0])
            assert step >= 40
            # the scrape that saw the NaN may have come between its two steps
            assert re.search(r"\*Actions\*\\nskipped (1 step|2 steps)\b", text), text
            (incident,) = wait_for(lambda: pager.incidents, 30, "the PagerDuty incident")
            trigger = pager.events[0].body
            assert trigger["event_action"] == "trigger"
            assert trigger["dedup_key"] == incident.dedup_key
            assert re.fullmatch("[0-9a-f]{64}", trigger["dedup_key"])  # the group key's SHA-256
            payload = trigger["payload"]
            assert payload["severity"] == "critical" and payload["class"] == "LossNonFinite"
            assert payload["group"] == "nanrun" and payload["component"] == "rank 0"
            assert payload["summary"].startswith("[critical] LossNonFinite run=nanrun rank=0")
            (nan,) = payload["custom_details"]["alerts"]
            assert nan["step"] >= 40
            assert nan["actions"][0] in ("skipped 1 step", "skipped 2 steps")
            assert {link["text"] for link in trigger["links"]} == {"Dashboard", "Runbook"}

            firing_status = monitor_cli("status", "--config", str(config))
            assert firing_status.returncode == 0, firing_status.stderr
            out = firing_status.stdout
            assert "running" in out and "targets (1)" in out and "UP " in out
            assert "firing alerts (1)" in out and "LossNonFinite" in out

            # resolved: both say so, the incident closes, nothing is sent twice
            resolved = wait_for(lambda: slack.messages[1:], 60, "the Slack resolve")
            assert resolved[0].body["text"].startswith("[RESOLVED] LossNonFinite run=nanrun")
            assert "RESOLVED" in text_of(resolved[0]) and "FIRING" not in text_of(resolved[0])
            wait_for(lambda: not pager.open_incidents(), 30, "the incident resolved")
            assert [e.body["event_action"] for e in pager.events] == ["trigger", "resolve"]
            assert len(pager.incidents) == 1 and len(slack.messages) == 2
            assert agent.poll() is None  # training went on

            quiet = monitor_cli("status", "--config", str(config), "--json")
            report = json.loads(quiet.stdout)
            assert report["firing"] == [] and report["outbox"]["pending"] == 0
            assert report["outbox"]["delivered"] == 2 + 2 and report["dead_letters"] == []
            metrics = requests.get(f"{monitor_url}/metrics", timeout=5).text
            for line in (
                'lossguard_monitor_notifications_total{integration="slack",'
                'receiver="oncall-slack",result="delivered"} 2.0',
                'lossguard_monitor_notifications_total{integration="pagerduty",'
                'receiver="oncall-pager",result="delivered"} 2.0',
                "lossguard_monitor_outbox_pending 0.0",
                "lossguard_monitor_outbox_dead_letters 0.0",
            ):
                assert line in metrics, line
        finally:
            assert stop_processes(monitor, agent)[0] == 0
        leaked = [slack.token, pager.routing_key]
        for path in [config.with_suffix(".log"), *tmp_path.glob("state.db*")]:
            content = path.read_bytes()
            for secret in leaked:
                assert secret.encode() not in content, f"a secret in {path.name}"


def test_a_missing_secret_stops_the_monitor_with_a_one_line_error(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text(RULES)
    settings = notifications()
    settings["receivers"][1]["pagerduty_configs"][0]["url"] = "http://127.0.0.1:9/v2/enqueue"
    config, _ = write_monitor_config(
        tmp_path / "monitor.yml", [rules], scrape={"runs_root": "runs"}, notifications=settings
    )
    result = subprocess.run(
        [sys.executable, "-m", "lossguard.monitor.cli", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("LG_TEST_")},
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "lossguard-monitor: error: notifications.receivers.0.slack_configs.0.api_url_env: "
        "environment variable LG_TEST_SLACK_URL is not set"
    ]
