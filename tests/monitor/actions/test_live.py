"""The monitor acting on its own, end to end: a real agent training a tiny GPT with injected
NaNs, the monitor as a process with the shipped LossNonFinite rule, fake Slack and PagerDuty.

* NaNs that keep coming, and come back on every replay, with the shipped routes and timers
  (group_wait 30 s): rollback (attempt 1), the alert resolves, the NaNs recur (a new alert
  instance), rollback with the learning rate halved (attempt 2), recur again:
  RollbacksExhausted pages once and the run is paused. The team channel hears each action
  once (announcements, though each alert resolved long before its group_wait), PagerDuty only
  the one page.
* A lasting NaN: a silence holds the rollback back; the agent's socket is away when the
  silence ends, so the recorded rollback cannot be sent; the monitor is SIGKILLed and restarted
  and sends it, with the same request id; then the monitor is killed once more after the agent
  applied it but before the answer was recorded: the agent answers the repeat from its first
  result. One rollback in all, and the run trains on without another.
"""

from __future__ import annotations

import json
import signal
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from lossguard.monitor.demo.scenario import PAGERDUTY_ENV, SLACK_ENV, shipped_notifications
from tests.support.fake_receivers import FakePagerDuty, FakeSlack
from tests.support.processes import (
    REPO,
    free_port,
    monitor_cli,
    start_agent,
    start_monitor,
    stop_processes,
    wait_for,
)
from tests.support.runs import (
    events,
    last_step,
    throttle,
    tiny_settings,
    write_config,
    write_monitor_config,
)

pytestmark = pytest.mark.live

SHIPPED_RULES = REPO / "alerts" / "lossguard.rules.yml"
RUNBOOKS = "https://runbooks.example/lossguard/"


def shipped_rule(tmp_path: Path, name: str) -> Path:
    """A rules file holding only the shipped rule ``name``, exactly as shipped."""
    groups = yaml.safe_load(SHIPPED_RULES.read_text())["groups"]
    rules = [r for g in groups for r in g["rules"] if r.get("alert") == name]
    path = tmp_path / f"{name}.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "shipped", "rules": rules}]}))
    return path


def agent_settings(
    runs: Path,
    cache: Path,
    run_id: str,
    fault: dict[str, Any],
    step_s: float,
    slow_from: int = 1,
) -> dict[str, Any]:
    """A run checkpointing every 50 steps, each step from ``slow_from`` on taking at least
    ``step_s``."""
    return tiny_settings(
        runs,
        cache,
        run={"id": run_id},
        train={"max_steps": 10**7, "log_every": 5, "eval_every": 10**6},
        telemetry={"port": free_port()},
        checkpoint={"every": 50, "keep_last": 10, "async_save": False},
        faults=[fault, throttle(step_s, from_step=slow_from)],
    )


def actions_in(db: Path) -> list[dict[str, Any]]:
    if not db.exists():
        return []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        try:
            rows = conn.execute(
                "SELECT id, kind, state, attempt, args, result, reason, tries FROM actions"
                " ORDER BY created_at"
            ).fetchall()
        except sqlite3.OperationalError:
            return []
    keys = ("id", "kind", "state", "attempt", "args", "result", "reason", "tries")
    found = [dict(zip(keys, row, strict=True)) for row in rows]
    for action in found:
        action["args"], action["result"] = json.loads(action["args"]), json.loads(action["result"])
    return found


def rollbacks(run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in events(run_dir) if e.get("event") == "rollback"]


def slack_texts(slack: FakeSlack) -> list[str]:
    return [json.dumps(m.body, ensure_ascii=False) for m in slack.messages]


def test_recurring_divergence_gets_attempts_then_a_page_and_a_pause(
    tmp_path: Path, corpus_cache: Path
) -> None:
    runs = tmp_path / "runs"
    run_dir = runs / "divrun"
    db = tmp_path / "state.db"
    with FakeSlack() as slack, FakePagerDuty() as pager:
        config, monitor_url = write_monitor_config(
            tmp_path / "monitor.yml",
            [shipped_rule(tmp_path, "LossNonFinite")],
            scrape={"runs_root": str(runs)},
            notifications={
                **shipped_notifications(pager.enqueue_url),
                "runbook_base_url": RUNBOOKS,
            },
            actions={"rollback": {"max_attempts": 2, "cooldown": "0s"}},
        )
        secrets = {SLACK_ENV: slack.webhook_url, PAGERDUTY_ENV: pager.routing_key}
        monitor = start_monitor(config, env=secrets)
        # NaNs from step 90 for 45 steps, again on every replay: LossNonFinite at 40 of them
        nan = {"kind": "nonfinite_loss", "step": 90, "duration": 45}
        settings = agent_settings(runs, corpus_cache, "divrun", nan, step_s=0.1, slow_from=45)
        agent = start_agent(write_config(tmp_path / "agent.yaml", settings))
        try:
            first, second = wait_for(
                lambda: rollbacks(run_dir)[:2] if len(rollbacks(run_dir)) >= 2 else None,
                150,
                "two rollbacks",
            )
            for rollback, lr_scale in ((first, 1.0), (second, 0.5)):
                # the in-memory snapshot of step 50 (beside the checkpoint of the same step)
                assert rollback["to_step"] == 50
                assert rollback["checkpoint"] == "memory/step_00000050"
                assert rollback["from_step"] >= 129  # 40 NaN steps: not one NaN alone
                assert rollback["lr_scale"] == lr_scale
                # the newest detection of the abandoned timeline: one of its NaNs
                assert 90 <= rollback["abandoned"]["step"] <= rollback["from_step"]
                assert rollback["abandoned"]["nonfinite"] is True
            # "abandoned": past every batch the abandoned timelines trained on, so none recurs
            assert first["skipped_batches"] == first["from_step"] - 50
            assert second["skipped_batches"] == first["skipped_batches"] + second["from_step"] - 50
            pause = wait_for(
                lambda: [
                    a for a in actions_in(db) if a["kind"] == "pause" and a["state"] != "pending"
                ],
                60,
                "the pause after the attempts ran out",
            )[0]
            assert pause["state"] == "applied" and pause["result"]["paused"] is True
            recorded = actions_in(db)
            assert [(a["kind"], a["state"], a["attempt"]) for a in recorded] == [
                ("rollback", "applied", 1),
                ("rollback", "applied", 2),
                ("rollback", "failed", None),
                ("pause", "applied", None),
            ]
            assert [a["args"]["lr_scale"] for a in recorded[:2]] == [1.0, 0.5]
            assert "2 rollbacks for bad steps within 2000 steps already" in recorded[2]["reason"]
            assert pause["id"] == f"{recorded[2]['id']}-pause"
            # every action reached the agent once, under the monitor's request id
            commands = [e for e in events(run_dir) if e.get("event") == "command"]
            assert [(c["cmd"], c["id"]) for c in commands] == [
                ("rollback", recorded[0]["id"]),
                ("rollback", recorded[1]["id"]),
                ("pause", pause["id"]),
            ]

            # the team channel: each action once (after group_wait, though LossNonFinite
            # resolved within seconds of each rollback), and the page; PagerDuty: the page only
            def told() -> list[str]:
                return slack_texts(slack)

            texts = wait_for(lambda: len(told()) >= 4 and told(), 90, "three actions and a page")
            announced = [t for t in texts if "ActionTaken" in t]
            assert len(announced) == 3, texts
            rolled = [t for t in announced if "rolled back from step" in t]
            assert len(rolled) == 2
            assert "to step 50 (memory/step_00000050)" in rolled[0]
            assert "attempt 1 of 2" in " ".join(rolled) and "attempt 2 of 2" in " ".join(rolled)
            assert f"At step {first['abandoned']['step']} the loss was not finite" in rolled[0]
            assert "steps to train again" in rolled[0] and "batches skipped" in rolled[0]
            (paused,) = [t for t in announced if "paused training at step" in t]
            assert ": rollbacks exhausted (2 within 2000 steps)" in paused
            (page,) = [t for t in texts if "RollbacksExhausted" in t]
            assert "Rollbacks exhausted in run divrun" in page
            assert f"{RUNBOOKS}docs/runbook.md#rollbacksexhausted" in page
            assert not [t for t in texts if "] LossNonFinite" in t]  # info: told by its actions
            (incident,) = pager.incidents  # one page, nothing else
            assert "RollbacksExhausted" in incident.summary and incident.open
            assert incident.severity == "critical"

            status = monitor_cli("status", "--config", str(config))
            assert status.returncode == 0, status.stderr
            assert "actions (0 pending, 4 recent)" in status.stdout
            assert "RollbacksExhausted" in status.stdout
            metrics = requests.get(f"{monitor_url}/metrics", timeout=5).text
            for line in (
                'lossguard_monitor_actions_total{action="rollback",result="applied"} 2.0',
                'lossguard_monitor_actions_total{action="rollback",result="failed"} 1.0',
                'lossguard_monitor_actions_total{action="pause",result="applied"} 1.0',
            ):
                assert line in metrics, line
            assert agent.poll() is None  # paused, alive, its state kept for a human
            assert len(slack_texts(slack)) == 4 and len(pager.incidents) == 1  # nothing more
        finally:
            assert stop_processes(monitor, agent)[0] == 0


def test_held_recorded_killed_and_resent_rollback_is_applied_once(
    tmp_path: Path, corpus_cache: Path
) -> None:
    runs = tmp_path / "runs"
    run_dir = runs / "onerun"
    db = tmp_path / "state.db"
    config, _ = write_monitor_config(
        tmp_path / "monitor.yml",
        [shipped_rule(tmp_path, "LossNonFinite")],
        scrape={"runs_root": str(runs)},
        notifications={
            "receivers": [{"name": "log", "log_configs": [{}]}],
            "route": {"receiver": "log"},
        },
    )
    silenced = monitor_cli(
        "silence",
        "add",
        "--config",
        str(config),
        'run_id="onerun"',
        "--duration",
        "1h",
        "--comment",
        "looking at it first",
    )
    assert silenced.returncode == 0, silenced.stderr
    silence_id = silenced.stdout.strip()
    monitor = start_monitor(config)
    # lasting, and gone on replay. Slow steps from just before it: the alert must still fire
    # (no good state past the NaNs) when the test lets the held rollback go.
    nan = {"kind": "nonfinite_loss", "step": 55, "duration": 10**6, "once": True}
    settings = agent_settings(runs, corpus_cache, "onerun", nan, step_s=0.2, slow_from=45)
    agent = start_agent(write_config(tmp_path / "agent.yaml", settings))
    socket_path = run_dir / "control.sock"
    away = run_dir / "control.sock.away"
    try:
        held = wait_for(lambda: actions_in(db), 120, "the held rollback")[0]
        assert held["state"] == "held" and silence_id in held["reason"]
        status = monitor_cli("status", "--config", str(config))
        assert "actions (1 pending, 0 recent)" in status.stdout and "HELD" in status.stdout
        wait_for(socket_path.exists, 30, "the control socket")
        socket_path.rename(away)  # the agent cannot be reached for now
        expired = monitor_cli("silence", "expire", "--config", str(config), silence_id)
        assert expired.returncode == 0, expired.stderr
        tried = wait_for(
            lambda: [a for a in actions_in(db) if a["tries"] >= 1], 30, "a failed send"
        )[0]
        assert tried["id"] == held["id"] and tried["state"] == "pending"
        monitor.send_signal(signal.SIGKILL)
        monitor.wait(30)
        away.rename(socket_path)
        monitor = start_monitor(config)
        applied = wait_for(
            lambda: [a for a in actions_in(db) if a["state"] == "applied"], 60, "the rollback"
        )[0]
        assert applied["id"] == held["id"]
        assert [r["to_step"] for r in rollbacks(run_dir)] == [50]

        # killed after the agent applied it, before the answer was recorded: sent again
        monitor.send_signal(signal.SIGKILL)
        monitor.wait(30)
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE actions SET state = 'pending', result = '{}'")
        monitor = start_monitor(config)
        again = wait_for(
            lambda: [a for a in actions_in(db) if a["state"] == "applied"], 60, "the answer"
        )[0]
        assert again["result"]["from_step"] == applied["result"]["from_step"]
        step_then = last_step(run_dir)
        wait_for(lambda: last_step(run_dir) >= step_then + 20, 120, "training past the bad step")
        assert len(rollbacks(run_dir)) == 1  # applied once; the NaNs did not recur
        assert [a["kind"] for a in actions_in(db)] == ["rollback"]
        commands = [e for e in events(run_dir) if e.get("event") == "command"]
        assert [c["id"] for c in commands] == [held["id"]]
    finally:
        assert stop_processes(monitor, agent)[0] == 0
