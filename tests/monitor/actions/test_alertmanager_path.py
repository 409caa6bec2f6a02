"""The standard ops path acting on training, end to end, all real: an agent training a tiny GPT
with NaN losses that keep coming (until a rollback: they do not recur on the replay), Prometheus
scraping it and evaluating the shipped LossNonFinite rule, Alertmanager grouping the alert and
POSTing it (with a bearer token) to the monitor's webhook, and the monitor, whose own rules do
not act (``triggers: [alertmanager]``) but confirm the alert on its own scrape, rolling the run
back through its control socket. A silence on the monitor holds the rollback back at first, so
that Alertmanager sends the firing alert again and again (repeat_interval 1s); neither those
repeats nor the same notification replayed after the alert resolved make a second rollback.
Alertmanager and Prometheus, behind basic auth as in the compose stack, refuse requests without
it; forged alerts posted to Alertmanager with it, which it forwards with the token, are refused
by the monitor, and nothing is sent to the run."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.monitor.actions.test_live import agent_settings, rollbacks, shipped_rule
from tests.support.alert_stack import MONITOR_WEBHOOK_PATH, alert_stack
from tests.support.amserver import capture_server
from tests.support.processes import (
    monitor_cli,
    start_agent,
    start_monitor,
    stop_processes,
    wait_for,
)
from tests.support.runs import events, write_config, write_monitor_config

pytestmark = pytest.mark.live

TOKEN_ENV = "LOSSGUARD_MONITOR_TOKEN"
TOKEN = "am-to-monitor-test-token"


def acted(db: Path) -> list[dict[str, Any]]:
    """The actions the monitor took up (not those it refused)."""
    return [row for row in actions_rows(db) if row["state"] != "refused"]


def actions_rows(db: Path) -> list[dict[str, Any]]:
    if not db.exists():
        return []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        conn.row_factory = sqlite3.Row
        try:
            rows = conn.execute("SELECT * FROM actions ORDER BY created_at").fetchall()
        except sqlite3.OperationalError:
            return []
    return [dict(row) for row in rows]


def sent_alerts(bodies: list[Any], status: str) -> list[dict[str, Any]]:
    """The alerts with ``status`` in the webhook notifications Alertmanager sent."""
    return [
        alert
        for body in bodies
        for alert in body["alerts"]
        if alert["status"] == status and alert["labels"].get("alertname") == "LossNonFinite"
    ]


def last_evaluation(monitor_url: str) -> float:
    try:
        value = requests.get(f"{monitor_url}/healthz", timeout=5).json()["last_evaluation"]
    except (requests.ConnectionError, ValueError):
        return 0.0
    return float(value or 0.0)


def webhook_receipts(config: Path) -> list[str]:
    """The monitor's log lines for webhook notifications that had a LossNonFinite firing."""
    log = config.with_suffix(".log")
    lines = log.read_text().splitlines() if log.exists() else []
    return [
        line for line in lines if "alertmanager webhook:" in line and "LossNonFinite firing" in line
    ]


def test_an_alert_through_prometheus_and_alertmanager_rolls_the_run_back_once(
    tmp_path: Path, corpus_cache: Path
) -> None:
    runs = tmp_path / "runs"
    run_dir = runs / "amrun"
    db = tmp_path / "state.db"
    # the monitor's own rule confirms, but does not act: the webhook is the only way to an action
    config, monitor_url = write_monitor_config(
        tmp_path / "monitor.yml",
        [shipped_rule(tmp_path, "LossNonFinite")],
        scrape={"runs_root": str(runs)},  # where the run's control socket is found
        notifications={
            "receivers": [{"name": "log", "log_configs": [{}]}],
            "route": {"receiver": "log"},
        },
        actions={"triggers": ["alertmanager"], "rollback": {"cooldown": "0s"}},
    )
    # held at first, so that Alertmanager sends the firing alert again and again
    silenced = monitor_cli(
        "silence",
        "add",
        "--config",
        str(config),
        'run_id="amrun"',
        "--duration",
        "1h",
        "--comment",
        "hold it while Alertmanager repeats",
    )
    assert silenced.returncode == 0, silenced.stderr
    webhook = f"{monitor_url}{MONITOR_WEBHOOK_PATH}"
    monitor = start_monitor(config, env={TOKEN_ENV: TOKEN})
    # NaNs from step 55 on, gone on replay; checkpoints every 50 steps: nothing healthy after
    # the NaNs, so the rollback goes to step 50
    nan = {"kind": "nonfinite_loss", "step": 55, "duration": 10**6, "once": True}
    settings = agent_settings(runs, corpus_cache, "amrun", nan, step_s=0.3, slow_from=45)
    agent = start_agent(write_config(tmp_path / "agent.yaml", settings))
    metrics_url = f"http://127.0.0.1:{settings['telemetry']['port']}/metrics"
    try:
        with (
            capture_server() as sink,
            alert_stack(
                tmp_path / "stack",
                [metrics_url],
                webhook,
                rule_files=[shipped_rule(tmp_path, "LossNonFinite")],
                token=TOKEN,
                repeat_interval="1s",  # the firing group again on every flush
                also=[{"url": sink.url("/seen"), "send_resolved": True}],
            ) as stack,
        ):
            (held,) = wait_for(lambda: acted(db), 90, "the held rollback")
            assert held["state"] == "held" and held["origin"] == "alertmanager"
            wait_for(
                lambda: len(webhook_receipts(config)) >= 3,
                20,
                "the monitor to hear the firing alert three times",
            )
            assert [a["id"] for a in acted(db)] == [held["id"]]
            expired = monitor_cli(
                "silence", "expire", "--config", str(config), silenced.stdout.strip()
            )
            assert expired.returncode == 0, expired.stderr

            applied = wait_for(
                lambda: [a for a in acted(db) if a["state"] == "applied"],
                30,
                "the rollback applied",
            )
            (action,) = applied
            assert action["id"] == held["id"] and action["id"].startswith("lg-")
            assert action["kind"] == "rollback" and action["origin"] == "alertmanager"
            assert action["alertname"] == "LossNonFinite"
            assert json.loads(action["labels"])["run_id"] == "amrun"
            result = json.loads(action["result"])
            assert result["to_step"] == 50
            assert result["skipped_batches"] == result["from_step"] - 50

            # the rollback ends the alert: Prometheus resolves it, Alertmanager says so
            wait_for(lambda: sent_alerts(sink.bodies("/seen"), "resolved"), 30, "the resolved")
            firing_sent = sent_alerts(sink.bodies("/seen"), "firing")
            assert len(firing_sent) >= 3, stack.alertmanager.log
            assert {a["startsAt"] for a in firing_sent} == {firing_sent[0]["startsAt"]}

            # the same firing notification once more, after the alert resolved: nothing new
            first = next(b for b in sink.bodies("/seen") if sent_alerts([b], "firing"))
            replay = requests.post(
                webhook, json=first, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
            )
            # taken (the same request id: decided already) or refused (no NaN seen any more)
            assert replay.status_code == 200, replay.text
            replayed_at = time.time()
            wait_for(
                lambda: last_evaluation(monitor_url) > replayed_at + 1,
                30,
                "two decision cycles after the replay",
            )

            # Alertmanager and Prometheus answer no one without the web password (compose's
            # settings); forged alerts from someone with it, forwarded with the token: refused
            for url in (
                f"{stack.alertmanager.url}/api/v2/alerts",
                f"{stack.prometheus.url}/-/quit",
            ):
                assert requests.post(url, json=[], timeout=10).status_code == 401
            trail = (run_dir / "events.jsonl").read_bytes()
            forged = {"alertname": "LossNonFinite", "run_id": "amrun", "rank": "0"}
            stack.alertmanager.post_firing(
                [
                    {**forged, "action": "stop"},  # not the rule's action
                    {**forged, "action": "rollback", "forged": "yes"},  # not what the monitor sees
                    {"alertname": "StopAll", "run_id": "amrun", "action": "stop"},  # no such rule
                ]
            )
            reasons = wait_for(
                lambda: (
                    (found := [a["reason"] for a in actions_rows(db) if a["state"] == "refused"])
                    and len(found) >= 3
                    and found
                ),
                60,  # the one the monitor does not see waits CONFIRM_WITHIN_S first
                "the forged alerts refused",
            )
            assert any("asks for rollback, not action 'stop'" in r for r in reasons), reasons
            assert any("'StopAll' is not a rule the monitor loaded" in r for r in reasons), reasons
            assert any("not confirmed" in r for r in reasons), reasons
            assert (run_dir / "events.jsonl").read_bytes().startswith(trail)
            # for a post-mortem: what Alertmanager sent
            (tmp_path / "webhooks.json").write_text(json.dumps(sink.bodies("/seen"), indent=1))
        assert len(webhook_receipts(config)) >= 4  # Alertmanager's (three or more) and ours
        assert [a["id"] for a in acted(db)] == [action["id"]]
        commands = [e for e in events(run_dir) if e.get("event") == "command"]
        assert [(c["cmd"], c["id"]) for c in commands] == [("rollback", action["id"])]
        assert [r["to_step"] for r in rollbacks(run_dir)] == [50]
        assert agent.poll() is None, "the run trains on"
    finally:
        assert stop_processes(monitor, agent)[0] == 0
