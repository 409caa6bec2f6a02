"""The Alertmanager path of the three outcomes, with the shipped files and a real Alertmanager:
the monitor's own alerts, routed as ``deploy/monitor.yml`` routes them (to its
``alertmanager`` receiver), are posted to Alertmanager running ``alerts/alertmanager.yml``
(behind basic auth, as in the compose stack). An action the monitor took reaches Slack exactly
once, at once, and never as resolved; a page reaches PagerDuty's and Slack's routes and resolves
when the monitor resolves it. Only the receivers' addresses and the secret files differ from
the shipped ones."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from lossguard.monitor.actions.model import ActionRecord
from lossguard.monitor.actions.outcomes import Outcomes
from lossguard.monitor.actions.raised import RaisedAlerts
from lossguard.monitor.alert_store import AlertStore
from lossguard.monitor.config import load_monitor_config
from lossguard.monitor.notify.config import read_secrets
from lossguard.monitor.notify.delivery import Backoff, Deliverer
from lossguard.monitor.notify.dispatcher import Dispatcher
from lossguard.monitor.notify.integrations import build_integrations
from lossguard.monitor.notify.integrations.alertmanager import AlertmanagerIntegration
from lossguard.monitor.notify.model import AlertInfo, Notification
from lossguard.monitor.notify.store import DELIVERED, NotifyStore
from tests.support.amserver import AlertmanagerServer, alertmanager, capture_server
from tests.support.processes import REPO, wait_for
from tests.support.webauth import WebAuth

pytestmark = pytest.mark.live

SHIPPED_AM = REPO / "alerts" / "alertmanager.yml"
SHIPPED_MONITOR = REPO / "deploy" / "monitor.yml"


def shipped_alertmanager(secrets: Path, slack_url: str, pagerduty_url: str) -> dict[str, Any]:
    """``alerts/alertmanager.yml`` with its secret files in ``secrets`` and PagerDuty's events
    URL at the stand-in."""
    config: dict[str, Any] = yaml.safe_load(SHIPPED_AM.read_text())
    secrets.mkdir()
    (secrets / "slack").write_text(slack_url)
    (secrets / "pd").write_text("k" * 32)
    (secrets / "token").write_text("t" * 32)
    for receiver in config["receivers"]:
        for slack in receiver.get("slack_configs", []):
            slack["api_url_file"] = str(secrets / "slack")
        for pagerduty in receiver.get("pagerduty_configs", []):
            pagerduty["routing_key_file"] = str(secrets / "pd")
            pagerduty["url"] = pagerduty_url
        for hook in receiver.get("webhook_configs", []):
            hook["http_config"]["authorization"]["credentials_file"] = str(secrets / "token")
    return config


class Monitor:
    """The monitor's pipeline from a raised alert to a delivered notification, as the daemon
    runs it, with ``deploy/monitor.yml``'s notifications pointed at ``am``."""

    def __init__(self, state_path: Path, am: AlertmanagerServer, password: str) -> None:
        config = load_monitor_config(SHIPPED_MONITOR).notifications
        for receiver in config.receivers:
            for hook in receiver.alertmanager_configs:
                hook.url = am.url
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("LOSSGUARD_WEB_PASSWORD", password)
            integrations = build_integrations(config, read_secrets(config), "")
        self.state = AlertStore(state_path)
        self.dispatcher = Dispatcher(self.state, config, integrations)
        self.raised = RaisedAlerts(self.state)
        waits = [r.group_wait_s for r in self.dispatcher.routes.values()]
        self.outcomes = Outcomes(self.raised, hold_s=max(waits) * 2 + 3600)
        self.deliverer = Deliverer(
            NotifyStore(self.state),
            integrations,
            timeout_s=config.delivery.timeout.seconds,
            backoff=Backoff(0.1, 1.0),
        )
        self.deliverer.start()

    def step(self) -> bool:
        """One notification cycle now: groups due are flushed and delivered; whether any
        notification was queued."""
        queued = bool(self.dispatcher.step(time.time(), []))
        if queued:
            self.deliverer.wake()
        return queued

    def delivered(self) -> int:
        return len(NotifyStore(self.state).entries(DELIVERED, 100))

    def close(self) -> None:
        self.deliverer.stop()
        self.state.close()


def rollback_record(at: float) -> ActionRecord:
    labels = {
        "alertname": "LossSpikeNotRecovering",
        "run_id": "r1",
        "rank": "0",
        "action": "rollback",
        "severity": "info",
    }
    return ActionRecord(
        id="lg-abc-1",
        run_id="r1",
        kind="rollback",
        alertname="LossSpikeNotRecovering",
        fingerprint="abc",
        labels=labels,
        origin="alertmanager",
        args={"target": "last_good", "skip_batches": "abandoned", "lr_scale": 1.0},
        state="applied",
        created_at=at,
        updated_at=at,
        result={"from_step": 1741, "to_step": 1500, "skipped_batches": 241, "lr_scale": 1.0},
        attempt=1,
        of_attempts=3,
    )


def am_alert(am: AlertmanagerServer, name: str) -> dict[str, Any] | None:
    found = [a for a in am.alerts() if a["labels"]["alertname"] == name]
    return found[0] if found else None


def test_an_action_is_announced_once_and_a_page_pages_through_alertmanager(
    tmp_path: Path,
) -> None:
    auth = WebAuth()
    with capture_server() as sink:
        config = shipped_alertmanager(tmp_path / "secrets", sink.url("/slack"), sink.url("/pd"))
        with alertmanager(tmp_path / "am", config, auth) as am:
            monitor = Monitor(tmp_path / "state.db", am, auth.password)
            try:
                now = time.time()
                assert monitor.outcomes.tell(rollback_record(now), now)
                monitor.step()
                wait_for(lambda: monitor.delivered() == 1, 20, "the announcement delivered")
                (message,) = wait_for(lambda: sink.bodies("/slack"), 20, "the Slack message")
                (attachment,) = message["attachments"]
                assert attachment["title"] == "ActionTaken" and attachment["color"] == "good"
                text = " ".join(attachment["text"].split())
                assert "rolled back from step 1741 to step 1500" in text
                assert "241 steps to train again, 241 batches skipped" in text
                announced = am_alert(am, "ActionTaken")
                assert announced is not None
                assert [r["name"] for r in announced["receivers"]] == ["slack-announcements"]

                # rollbacks exhausted: one page, on PagerDuty's and Slack's routes
                labels = {"alertname": "LossSpikeNotRecovering", "run_id": "r1", "rank": "0"}
                assert monitor.outcomes.exhausted(labels, 3, 2000, "pause", time.time())
                monitor.step()
                page = wait_for(lambda: am_alert(am, "RollbacksExhausted"), 20, "the page")
                assert page["labels"]["severity"] == "critical"
                assert sorted(r["name"] for r in page["receivers"]) == ["pagerduty", "slack"]
                assert page["status"]["state"] == "active"

                # the run stops diverging: the page resolves in Alertmanager too
                monitor.outcomes.resolve_quiet([], time.time())
                wait_for(  # sent at the group's next flush (group_interval 10 s)
                    lambda: (monitor.step(), am_alert(am, "RollbacksExhausted") is None)[1],
                    30,
                    "the page resolved in Alertmanager",
                    interval=0.2,
                )
                assert am_alert(am, "ActionTaken") is not None  # still announced, not resolved
                assert len(sink.bodies("/slack")) == 1  # the page waits out group_wait (30 s)
            finally:
                monitor.close()


def test_a_wrong_password_is_a_dead_notification_that_never_shows_it(tmp_path: Path) -> None:
    """Alertmanager answers 401 without the web password: a permanent failure (a dead letter,
    not retried forever), and the outcome's detail never holds the password tried."""
    auth = WebAuth()
    with capture_server() as sink:
        config = shipped_alertmanager(tmp_path / "secrets", sink.url("/slack"), sink.url("/pd"))
        with alertmanager(tmp_path / "am", config, auth) as am:
            wrong = "not-the-password-" + auth.password[:8]
            integration = AlertmanagerIntegration(
                am.url, True, username="lossguard", password=wrong
            )
            now = time.time()
            alert = AlertInfo("f", "firing", {"alertname": "ActionFailed"}, {}, 1.0, now)
            note = Notification("am", "alertmanager", 0, "{}", {}, (alert,), now)
            with requests.Session() as session:
                outcome = integration.deliver(note, 1, session, timeout_s=10)
            assert (outcome.result, outcome.status) == ("dead", 401)
            assert wrong not in outcome.detail
            assert am.alerts() == []
