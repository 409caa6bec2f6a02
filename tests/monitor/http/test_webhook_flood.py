"""A flood of forged alerts through the Alertmanager webhook (with the token, as the probe
had it) is bounded: each alert of a flood is a new instance (the sender chooses ``startsAt``
and the labels), so refusals past a window's budget are counted, not recorded and logged one
by one, and alerts awaiting the monitor's own view are capped. The probe's 21 POSTs of 5,000
alerts left 100,003 rows and 100,002 log lines; here 3 POSTs of 2,000 leave 20 of each."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
import requests

from lossguard.monitor.actions import refusals
from lossguard.monitor.actions.corroborate import AwaitingConfirmation
from lossguard.monitor.actions.model import ActionAlert
from lossguard.monitor.actions.refusals import RECORDED_PER_WINDOW, RefusalBudget
from tests.agent.test_rank_faults import deploy_env, shipped_monitor
from tests.support.processes import start_monitor, stop_process, wait_for

pytestmark = pytest.mark.live

TOKEN = "webhook-flood-test-token"


def forged(count: int, offset: int) -> dict[str, object]:
    """One webhook notification of ``count`` alerts, each a new instance (labels, startsAt)."""
    alerts = [
        {
            "status": "firing",
            "labels": {"alertname": "Forged", "action": "rollback", "run_id": f"r{i}"},
            "annotations": {},
            "startsAt": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(1e9 + offset + i)) + "Z",
            "endsAt": "0001-01-01T00:00:00Z",
        }
        for i in range(count)
    ]
    return {"version": "4", "groupKey": "{}", "status": "firing", "receiver": "m",
            "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {},
            "externalURL": "http://am", "truncatedAlerts": 0, "alerts": alerts}  # fmt: skip


def refused_rows(db: Path) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM actions WHERE state='refused'").fetchone()[0])


def test_a_flood_of_forged_alerts_leaves_a_bounded_trail(tmp_path: Path) -> None:
    config, url = shipped_monitor(tmp_path, "deploy/monitor.yml", tmp_path / "runs")
    (tmp_path / "runs").mkdir()
    monitor = start_monitor(config, env=deploy_env(TOKEN))
    try:
        wait_for(lambda: reachable(url), 60, "the monitor")
        for post in range(3):
            reply = requests.post(
                f"{url}/api/v1/alertmanager",
                json=forged(2000, post * 2000),
                headers={"Authorization": f"Bearer {TOKEN}"},
                timeout=60,
            )
            assert reply.status_code == 200 and len(reply.json()["refused"]) == 2000
        metrics = requests.get(f"{url}/metrics", timeout=10).text
        actions = requests.get(f"{url}/api/v1/actions?limit=1000", timeout=10).json()
    finally:
        stop_process(monitor)
    assert refused_rows(tmp_path / "state.db") == RECORDED_PER_WINDOW
    assert len(actions["data"]["actions"]) == RECORDED_PER_WINDOW
    log = config.with_suffix(".log").read_text()
    assert log.count("refused rollback for run") == RECORDED_PER_WINDOW
    counted = 'lossguard_monitor_actions_total{action="rollback",result="refused"} 6000.0'
    assert counted in metrics


def reachable(url: str) -> bool:
    try:
        return requests.get(f"{url}/-/healthy", timeout=5).status_code < 500
    except requests.ConnectionError:
        return False


def test_the_budget_sums_up_each_window_it_overflowed(caplog: pytest.LogCaptureFixture) -> None:
    budget = RefusalBudget()
    allowed = [budget.allow(100.0 + i * 0.01, f"r{i % 3}") for i in range(50)]
    assert allowed == [True] * RECORDED_PER_WINDOW + [False] * (50 - RECORDED_PER_WINDOW)
    assert "more alerts" not in caplog.text
    budget.flush(100.0 + refusals.WINDOW_S)
    (line,) = [r.getMessage() for r in caplog.records if "more alerts" in r.getMessage()]
    assert line.startswith("refused 30 more alerts from Alertmanager in 60 s without recording")
    assert "for 3 runs" in line
    assert budget.allow(100.0 + refusals.WINDOW_S + 1, "r0")  # a new window, a new budget


def test_alerts_awaiting_confirmation_are_capped() -> None:
    class Slow:
        confirm_within_s = 15.0

    awaiting = AwaitingConfirmation(Slow())  # type: ignore[arg-type]
    alerts = [
        ActionAlert(fingerprint=f"f{i}", labels={"alertname": "A", "run_id": f"r{i}"},
                    annotations={}, starts_at=float(i), value=0.0)
        for i in range(5)
    ]  # fmt: skip
    assert [awaiting.hold(a, 0.0, limit=3) for a in alerts] == [True, True, True, False, False]
    assert awaiting.hold(alerts[0], 1.0, limit=3)  # a repeat of a held one
