"""The monitor daemon as a real process: config errors, its /metrics and /healthz, alerts from a
real scrape target, SIGHUP reloads (a broken file keeps the old rules), restarts that keep
alert state, and SIGTERM."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import monitor_cli, start_monitor, stop_process, wait_for
from tests.support.promserver import ExpositionServer, exposition_server
from tests.support.runs import alert_events, write_monitor_config

pytestmark = pytest.mark.live

RULES = """\
groups:
  - name: test
    rules:
      - alert: LossHigh
        expr: lossguard_train_loss > 5
        for: 2s
        labels: {severity: critical}
        annotations: {summary: "loss {{ $value }} on {{ $labels.run_id }}"}
"""


def loss(value: float) -> str:
    return f'lossguard_train_loss{{run_id="r1",rank="0"}} {value}\n'


@pytest.fixture
def exposition() -> Iterator[ExpositionServer]:
    with exposition_server() as served:
        yield served


def scrape_metrics(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = requests.get(f"{base_url}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def firing(base_url: str, alertname: str) -> float | None:
    try:
        found = scrape_metrics(base_url)
    except requests.ConnectionError:
        return None
    return found.get(("lossguard_monitor_alerts", (("alertname", alertname), ("state", "firing"))))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"rules": {"files": []}}, "rules.files: "),
        ({"rules": {"files": ["r.yml"], "evaluation_interval": "soon"}}, "not a valid duration"),
        ({"rules": {"files": ["r.yml"]}, "scrape": {"targets": ["ftp://x"]}}, "not an http"),
        ({"rules": {"files": ["r.yml"]}, "scrape": {"targets": ["http://h:99999/m"]}}, "h:99999"),
        (
            {"rules": {"files": ["r.yml"]}, "scrape": {"runs_root": ".", "timeout": "2s"}},
            "scrape.timeout: must not exceed scrape.interval",
        ),
        ({"rules": {"files": ["latin1.yml"]}, "scrape": {"runs_root": "."}}, "not UTF-8"),
        ({"rules": {"files": ["r.yml"]}, "source": "prometheus"}, "prometheus: required when"),
        ({"rules": {"files": ["r.yml"]}}, "scrape: give targets, file_sd_files or runs_root"),
        ({"rules": {"files": ["r.yml"]}, "extra": 1}, "extra: unknown key"),
        (
            {
                "rules": {"files": ["r.yml"]},
                "scrape": {"runs_root": ".", "trusted_owners": ["nx-no-one"]},
            },
            "scrape.trusted_owners: no such user 'nx-no-one'",
        ),
        ({"rules": {"files": ["missing.yml"]}, "scrape": {"targets": ["http://h:1/m"]}}, "cannot"),
        ({"rules": {"files": ["bad.yml"]}, "scrape": {"targets": ["http://h:1/m"]}}, "bad.yml:1:"),
    ],
)
def test_bad_configs_and_rule_files_exit_2_with_one_line(
    tmp_path: Path, settings: dict, message: str
) -> None:
    (tmp_path / "r.yml").write_text(RULES)
    (tmp_path / "bad.yml").write_text("groups: [{name: g, rules: [{alert: A, expr: 'up ='}]}]")
    (tmp_path / "latin1.yml").write_bytes(b"# caf\xe9\ngroups: []\n")
    config = tmp_path / "monitor.yml"
    config.write_text(yaml.safe_dump(settings))
    result = monitor_cli("run", "--config", str(config))
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("lossguard-monitor: error: ") and message in line, line


def test_alert_fires_survives_a_restart_and_sighup_keeps_old_rules_on_a_bad_file(
    tmp_path: Path, exposition: ExpositionServer
) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text(RULES)
    config, url = write_monitor_config(
        tmp_path / "monitor.yml", [rules], scrape={"targets": [exposition.url]}
    )
    db = tmp_path / "state.db"
    exposition.body = loss(9.5)
    monitor = start_monitor(config)
    try:
        wait_for(lambda: firing(url, "LossHigh") == 1, 30, "LossHigh firing")
        health = requests.get(f"{url}/healthz", timeout=5)
        assert health.status_code == 200 and health.json()["targets_up"] == 1
        target = ("lossguard_monitor_target_up", (("target", exposition.url),))
        assert scrape_metrics(url)[target] == 1
        (pending, fired) = alert_events(db)
        assert (pending["kind"], fired["kind"]) == ("pending", "firing")
        assert fired["at"] - pending["at"] >= 2  # for: 2s
        assert fired["labels"] == {
            "alertname": "LossHigh",
            "rank": "0",
            "run_id": "r1",
            "severity": "critical",
            "job": "lossguard-agent",
            "instance": exposition.url.split("/")[2],
        }

        # killed mid-alert and restarted: the same alert carries on, announced once
        monitor.kill()
        monitor.wait()
        monitor = start_monitor(config)
        wait_for(lambda: firing(url, "LossHigh") == 1, 30, "LossHigh firing after restart")
        assert [e["kind"] for e in alert_events(db)] == ["pending", "firing"]

        # a broken rules file on SIGHUP: old rules kept, reload reported as failed
        rules.write_text(RULES.replace("> 5", "> "))
        monitor.send_signal(signal.SIGHUP)
        reload_ok = ("lossguard_monitor_config_last_reload_successful", ())
        wait_for(lambda: scrape_metrics(url)[reload_ok] == 0, 30, "failed reload reported")
        assert firing(url, "LossHigh") == 1
        log = config.with_suffix(".log").read_text()
        assert "rules reload failed, keeping the 1 rules in force" in log
        assert "rules.yml:5:" in log

        # a good new file: the changed rule's alert ends, the new threshold applies
        rules.write_text(RULES.replace("severity: critical", "severity: warning"))
        monitor.send_signal(signal.SIGHUP)
        wait_for(lambda: scrape_metrics(url)[reload_ok] == 1, 30, "good reload")
        wait_for(
            lambda: [e["kind"] for e in alert_events(db)][2:] == ["resolved", "pending", "firing"],
            30,
            "old alert resolved, new one firing",
        )
        old, new = alert_events(db)[1]["fingerprint"], alert_events(db)[-1]["fingerprint"]
        assert old != new

        # the loss recovers: resolved
        exposition.body = loss(1.0)
        wait_for(lambda: alert_events(db)[-1]["kind"] == "resolved", 30, "resolved")
    finally:
        assert stop_process(monitor) == 0
