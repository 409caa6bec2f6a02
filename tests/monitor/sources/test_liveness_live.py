"""A real monitor watching a real tiny agent that is SIGKILLed: TrainingProcessDied fires naming
the run, its last step and its newest checkpoint (in the alert and in the console
notification), the monitor exports the dead run on its /metrics, and LossguardAgentDown does
not fire.

The shipped rules are used with shorter `for`s (TrainingProcessDied 6 s instead of 3 m,
LossguardAgentDown 3 s instead of 1 m), so that "agent down" would have fired before the dead-run
alert if the killed agent still counted as a failed scrape."""

from __future__ import annotations

import json
import signal
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from lossguard.common.rundir.checkpoints import list_checkpoints
from lossguard.common.rundir.metrics_log import last_logged
from tests.support.processes import (
    REPO,
    free_port,
    start_agent,
    start_monitor,
    stop_process,
    wait_for,
)
from tests.support.runs import (
    alert_events,
    throttle,
    tiny_settings,
    write_config,
    write_monitor_config,
)

pytestmark = pytest.mark.live

FOR = {"TrainingProcessDied": "6s", "LossguardAgentDown": "3s"}


def shipped_rules(path: Path) -> Path:
    """The shipped rules file with the `for`s of :data:`FOR`."""
    rules = yaml.safe_load((REPO / "alerts" / "lossguard.rules.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["for"] = FOR.get(rule.get("alert"), rule.get("for", "0s"))
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return path


def fired(db: Path, alertname: str) -> dict[str, Any] | None:
    """The first firing event of ``alertname``: its labels and annotations."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        try:
            row = conn.execute(
                "SELECT labels, annotations FROM alert_events WHERE kind = 'firing' "
                "AND json_extract(labels, '$.alertname') = ? ORDER BY id LIMIT 1",
                (alertname,),
            ).fetchone()
        except sqlite3.OperationalError:  # no tables yet
            return None
    return (
        None if row is None else {"labels": json.loads(row[0]), "annotations": json.loads(row[1])}
    )


def target_up(monitor_url: str, run_id: str) -> bool:
    try:
        targets = requests.get(f"{monitor_url}/api/status", timeout=5).json()["targets"]
    except (requests.RequestException, ValueError, KeyError):
        return False
    return any(t["run_id"] == run_id and t["up"] for t in targets)


def test_a_killed_agent_pages_training_process_died_and_not_agent_down(
    tmp_path: Path, corpus_cache: Path
) -> None:
    runs = tmp_path / "runs"
    settings = tiny_settings(
        runs,
        corpus_cache,
        run={"id": "victim"},
        train={"max_steps": 10**7, "log_every": 5, "eval_every": 10**6},
        telemetry={"port": free_port()},
        checkpoint={"every": 10, "keep_last": 3, "async_save": False},
        faults=[throttle(0.02)],
    )
    console: dict[str, Any] = {
        "receivers": [{"name": "console", "log_configs": [{}]}],
        "route": {"receiver": "console", "group_wait": "0s", "group_by": ["alertname"]},
    }
    config, monitor_url = write_monitor_config(
        tmp_path / "monitor.yml",
        [shipped_rules(tmp_path / "rules.yml")],
        scrape={"runs_root": str(runs)},
        actions={"enabled": False},
        notifications=console,
    )
    db = tmp_path / "state.db"
    monitor = start_monitor(config)
    agent = start_agent(write_config(tmp_path / "victim.yaml", settings))
    run_dir = runs / "victim"
    try:
        wait_for(lambda: list_checkpoints(run_dir / "checkpoints"), 60, "a checkpoint")
        wait_for(lambda: target_up(monitor_url, "victim"), 30, "the monitor scraping the agent")
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        step = last_logged(run_dir).step
        newest = list_checkpoints(run_dir / "checkpoints")[-1].name

        alert = wait_for(lambda: fired(db, "TrainingProcessDied"), 30, "TrainingProcessDied")
        labels = alert["labels"]
        assert (labels["run_id"], labels["exit"], labels["supervisor"]) == (
            "victim",
            "crashed",
            "none",
        )
        assert labels["last_step"] == str(step) and labels["last_checkpoint"].startswith(newest)
        summary = (
            f"Run victim crashed on {labels['host']} at step {step}; "
            f"last checkpoint {labels['last_checkpoint']}; "
            "no supervisor restarts it"
        )
        assert alert["annotations"]["summary"] == summary
        log = config.with_suffix(".log")
        wait_for(
            lambda: f"FIRING TrainingProcessDied run=victim step={step} " in log.read_text(),
            30,
            "the console notification",
        )
        assert summary in log.read_text()

        metrics = requests.get(f"{monitor_url}/metrics", timeout=5).text
        assert 'lossguard_run_exited_timestamp_seconds{exit="crashed"' in metrics
        down = [e for e in alert_events(db) if e["labels"]["alertname"] == "LossguardAgentDown"]
        assert [e for e in down if e["kind"] == "firing"] == []
    finally:
        assert stop_process(monitor) == 0
        stop_process(agent)
