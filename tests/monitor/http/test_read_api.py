"""The monitor's HTTP API (docs/monitor.md, "HTTP API") on a real monitor watching a real tiny
agent, a run whose process is gone (its supervisor restarting it), a completed run and a target
known only by its scrape: every endpoint answers what the runs really have, control works only
with the token and nothing refused reaches the agent."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from lossguard.common.rundir.agent_file import AgentInfo
from lossguard.common.rundir.checkpoints import list_checkpoints
from lossguard.common.rundir.supervisor_file import SupervisorInfo
from tests.support.processes import free_port, start_agent, start_monitor, stop_process, wait_for
from tests.support.promserver import ExpositionServer
from tests.support.runs import events, throttle, tiny_settings, write_config, write_monitor_config

pytestmark = pytest.mark.live

TOKEN_ENV = "LOSSGUARD_MONITOR_TOKEN"
TOKEN = "api-t0ken-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RULES = """\
groups:
  - name: api
    rules:
      - alert: ApiStepReached
        expr: lossguard_step > 5
        labels: {severity: info}
        annotations: {summary: "run {{ $labels.run_id }} at step {{ $value }}"}
      - alert: ApiNeverFires
        expr: lossguard_step{run_id="live"} > 0
        for: 1h
        labels: {severity: info}
      - alert: ApiSaveOnce
        expr: lossguard_step{run_id="live"} > 20
        labels: {severity: info, action: checkpoint}
      - alert: ApiSaveTwice
        expr: lossguard_step{run_id="live"} > 40
        labels: {severity: info, action: checkpoint}
"""


@dataclass
class Stack:
    url: str  # the monitor's, with the token set
    open_url: str  # a second monitor's, without a token
    runs: Path
    agent: subprocess.Popen
    monitor: subprocess.Popen
    log: Path


def write_run(runs: Path, run_id: str, **changes: Any) -> Path:
    """A run directory whose agent.json says ``changes`` (the process of a past run)."""
    run_dir = runs / run_id
    run_dir.mkdir(parents=True)
    info = AgentInfo(run_id, ("http://127.0.0.1:1/metrics",), None, started_at=1.0, **changes)
    (run_dir / "agent.json").write_text(info.to_json())
    return run_dir


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, corpus_cache: Path) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("api")
    runs = tmp / "runs"
    settings = tiny_settings(
        runs,
        corpus_cache,
        run={"id": "live"},
        train={"max_steps": 10**7, "log_every": 5, "eval_every": 10},
        telemetry={"port": free_port()},
        checkpoint={"every": 10, "keep_last": 3, "async_save": False},
        faults=[throttle(0.02)],
    )
    agent = start_agent(write_config(tmp / "live.yaml", settings))
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True
    )
    hostname = socket.gethostname()
    gone = write_run(runs, "gone", pid=int(finished.stdout), hostname=hostname)
    supervisor = SupervisorInfo("gone", os.getpid(), hostname, 1.0, "backoff", restarts=2)
    (gone / "supervisor.json").write_text(supervisor.to_json())
    write_run(runs, "done", pid=1, hostname=hostname, finished_at=2.0, exit="completed")
    rules = tmp / "rules.yml"
    rules.write_text(RULES)
    exposition = ExpositionServer('lossguard_step{run_id="ext",rank="0"} 7\n')
    scrape = {"runs_root": str(runs), "targets": [exposition.url]}
    config, url = write_monitor_config(tmp / "monitor.yml", [rules], scrape=scrape)
    monitor = start_monitor(config, env={TOKEN_ENV: TOKEN})
    (tmp / "open").mkdir()  # a second monitor, without a token, that does nothing else
    no_rules = tmp / "open" / "rules.yml"
    no_rules.write_text("groups: []\n")
    open_config, open_url = write_monitor_config(
        tmp / "open" / "monitor.yml", [no_rules], scrape={"targets": [exposition.url]}
    )
    open_monitor = start_monitor(open_config, env={TOKEN_ENV: ""})
    try:
        for base in (url, open_url):
            wait_for(lambda base=base: serving(base), 30, f"a monitor serving {base}")
        yield Stack(url, open_url, runs, agent, monitor, config.with_suffix(".log"))
    finally:
        for process in (monitor, open_monitor, agent):
            stop_process(process)
        exposition.close()


def serving(base_url: str) -> bool:
    try:
        return requests.get(f"{base_url}/api/v1/alerts", timeout=5).status_code == 200
    except requests.ConnectionError:
        return False


def get(url: str, **params: str) -> Any:
    reply = requests.get(url, params=params, timeout=10)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["status"] == "success"
    return body["data"]


def run_of(stack: Stack, run_id: str) -> dict[str, Any] | None:
    """The run as GET /api/v1/runs lists it (None: not listed)."""
    runs = get(f"{stack.url}/api/v1/runs")["runs"]
    return next((r for r in runs if r["run_id"] == run_id), None)


def control(stack: Stack, cmd: str, args: dict[str, Any] | None = None, **kw: Any) -> Any:
    """POST a control command with the token; the response."""
    body = {"cmd": cmd, **({"args": args} if args is not None else {})}
    headers = kw.pop("headers", AUTH)
    url = kw.pop("url", stack.url)
    run_id = kw.pop("run_id", "live")
    return requests.post(
        f"{url}/api/v1/runs/{run_id}/control", json=body, headers=headers, timeout=30, **kw
    )


def command_ids(stack: Stack) -> list[str]:
    """The ids of the control commands the live agent applied (its audit trail)."""
    return [e["id"] for e in events(stack.runs / "live") if e.get("event") == "command"]


def applied_actions(stack: Stack) -> list[dict[str, Any]]:
    """The live run's two checkpoint actions once both are applied, newest first."""

    def both() -> list[dict[str, Any]]:
        found = get(f"{stack.url}/api/v1/actions", run_id="live")["actions"]
        return found if [a["state"] for a in found] == ["applied", "applied"] else []

    return list(wait_for(both, 60, "two applied checkpoint actions"))


def error_of(reply: requests.Response, status: int) -> str:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert body["status"] == "error" and set(body) >= {"errorType", "error"}, body
    assert "\n" not in body["error"]
    return str(body["error"])


def test_runs_show_each_run_as_it_is(stack: Stack) -> None:
    def live_alerting() -> dict[str, Any] | None:
        run = run_of(stack, "live")
        names = {a["labels"]["alertname"] for a in run["health"]["alerts"]} if run else set()
        return run if {"ApiStepReached", "ApiNeverFires"} <= names else None

    live = wait_for(live_alerting, 60, "the live run with its alerts")
    assert live["status"] == "running" and live["health"]["ok"] is False  # an alert fires
    assert live["run_dir"] == str(stack.runs / "live")
    assert isinstance(live["train_loss"], float) and live["paused"] is False
    (rank,) = live["targets"]
    assert rank["rank"] == 0 and rank["up"] is True and rank["url"].endswith("/metrics")
    assert rank["step"] == live["step"]
    process = live["health"]["process"]
    assert process["pid"] == stack.agent.pid and process["alive"] is True
    assert process["exit"] is None and process["hostname"] == socket.gethostname()
    names = {a["labels"]["alertname"]: a["state"] for a in live["health"]["alerts"]}
    assert names["ApiStepReached"] == "firing" and names["ApiNeverFires"] == "pending"

    gone = run_of(stack, "gone")
    assert gone is not None and gone["status"] == "restarting"
    assert gone["health"]["process"]["alive"] is False and gone["health"]["ok"] is False
    assert gone["supervisor"]["state"] == "backoff" and gone["supervisor"]["restarts"] == 2
    assert gone["supervisor"]["alive"] is True and gone["step"] is None

    done = run_of(stack, "done")
    assert done is not None and done["status"] == "completed" and done["health"]["ok"] is True
    assert done["health"]["process"]["exit"] == "completed" and done["targets"] == []

    ext = run_of(stack, "ext")  # known only by what its target exposes
    assert ext is not None and ext["step"] == 7 and ext["run_dir"] is None
    assert ext["health"]["process"] is None and ext["targets"][0]["up"] is True

    one = get(f"{stack.url}/api/v1/runs/done")
    assert one["run_id"] == "done" and one["status"] == "completed"
    missing = error_of(requests.get(f"{stack.url}/api/v1/runs/nope", timeout=10), 404)
    assert "'nope'" in missing


def test_while_paused_checkpoints_and_step_match_the_run(stack: Stack) -> None:
    checkpoints = stack.runs / "live" / "checkpoints"
    applied_actions(stack)  # the monitor's saves are done
    pause = control(stack, "pause")  # nothing changes while we compare
    assert pause.status_code == 200, pause.text
    try:
        step = pause.json()["data"]["result"]["step"]
        paused = wait_for(
            lambda: (r := run_of(stack, "live")) and r["paused"] and r["step"] == step and r,
            30,
            "the pause scraped",
        )
        assert paused["status"] == "paused" and paused["health"]["ok"] is False
        status = control(stack, "status").json()["data"]["result"]
        assert (status["step"], status["paused"], status["pid"]) == (step, True, stack.agent.pid)
        listed = get(f"{stack.url}/api/v1/runs/live/checkpoints")
        on_disk = list_checkpoints(checkpoints)
        assert [c["name"] for c in listed["checkpoints"]] == [m.name for m in on_disk]
        assert [c["step"] for c in listed["checkpoints"]] == [m.step for m in on_disk]
        agent = control(stack, "checkpoints").json()["data"]["result"]
    finally:
        assert control(stack, "resume").status_code == 200
    for mark in ("latest", "best", "last_good"):
        # checkpoints every 10 steps, snapshots every 50: a snapshot is never newer than the
        # disk, and at a step both hold the agent names the snapshot (the faster restore)
        on_disk_name = agent[mark] and agent[mark].removeprefix("memory/")
        assert listed[mark] == on_disk_name
        marked = [c["name"] for c in listed["checkpoints"] if mark in c["marks"]]
        assert marked == ([on_disk_name] if on_disk_name else [])
    # the monitor reads the disk; the agent lists its in-memory snapshots beside it
    on_disk_by_agent = [c["name"] for c in agent["checkpoints"] if not c.get("in_memory")]
    assert [c["name"] for c in listed["checkpoints"]] == on_disk_by_agent
    assert listed["latest"] == on_disk[-1].name

    assert get(f"{stack.url}/api/v1/runs/gone/checkpoints")["checkpoints"] == []
    missing = requests.get(f"{stack.url}/api/v1/runs/ext/checkpoints", timeout=10)
    assert "'ext'" in error_of(missing, 404)
    # the monitor listed checkpoints without torch
    maps = Path(f"/proc/{stack.monitor.pid}/maps").read_text()
    assert "torch" not in maps


def test_alerts_and_actions_as_recorded(stack: Stack) -> None:
    wanted = {("ApiStepReached", "live"), ("ApiStepReached", "ext"), ("ApiNeverFires", "live")}

    def alerts() -> dict[tuple[str, str], dict[str, Any]]:
        found = get(f"{stack.url}/api/v1/alerts")["alerts"]
        by_name = {(a["labels"]["alertname"], a["labels"]["run_id"]): a for a in found}
        return by_name if wanted <= set(by_name) else {}

    by_name = wait_for(alerts, 60, "the alerts")
    reached = by_name[("ApiStepReached", "live")]
    assert reached["state"] == "firing" and reached["since"] == reached["fired_at"]
    assert reached["annotations"]["summary"].startswith("run live at step ")
    assert float(reached["value"]) > 5 and len(reached["fingerprint"]) == 16
    assert by_name[("ApiStepReached", "ext")]["labels"]["instance"]
    pending = by_name[("ApiNeverFires", "live")]
    assert pending["state"] == "pending" and pending["fired_at"] is None
    assert pending["since"] == pending["active_at"]

    newest, oldest = applied_actions(stack)
    assert (newest["alertname"], oldest["alertname"]) == ("ApiSaveTwice", "ApiSaveOnce")
    assert newest["created_at"] >= oldest["created_at"] and newest["kind"] == "checkpoint"
    assert newest["result"]["name"].startswith("step_") and newest["text"]
    assert newest["id"] in command_ids(stack)  # the agent applied exactly that request
    assert get(f"{stack.url}/api/v1/actions", limit="1")["actions"] == [newest]
    assert get(f"{stack.url}/api/v1/actions", run_id="gone")["actions"] == []
    for name, value in (("limit", "0"), ("limit", "x"), ("limit", "1001"), ("run_id", "")):
        reply = requests.get(f"{stack.url}/api/v1/actions", params={name: value}, timeout=10)
        assert error_of(reply, 400).startswith(f"{name}: ")
        assert reply.json()["errorType"] == "bad_data"


def test_control_only_with_the_token(stack: Stack) -> None:
    before = wait_for(lambda: (r := run_of(stack, "live")) and r["step"], 60, "a live step")
    applied_before = command_ids(stack)
    refused = [
        (control(stack, "status", headers={}), 401),
        (control(stack, "status", url=stack.open_url), 403),
        (control(stack, "explode"), 400),
        (control(stack, "set_lr_scale", {"scale": -1}), 400),
        (control(stack, "rollback", {"target": "/etc/passwd"}), 400),
        (control(stack, "status", run_id="nope"), 404),
        (control(stack, "status", run_id="done"), 503),
        (control(stack, "status", headers={"Authorization": "Bearer nope"}), 403),
    ]
    errors = [error_of(reply, status) for reply, status in refused]
    assert refused[0][0].headers["WWW-Authenticate"].startswith("Bearer")
    assert f"${TOKEN_ENV}" in errors[1]
    assert errors[2].startswith("unknown command 'explode'; commands: status, checkpoints")
    assert "scale" in errors[3] and "never a path" in errors[4]
    assert "'nope'" in errors[5] and "completed" in errors[6]
    # after a wrong token, this address waits out a back-off (the agent's: 0.25 s at first)
    held = control(stack, "status")
    assert "too many requests: wrong tokens from 127.0.0.1" in error_of(held, 429)
    assert held.headers["Retry-After"] == "1"

    reply = wait_for(
        lambda: (r := control(stack, "status")).status_code != 429 and r, 10, "the back-off"
    )
    assert reply.status_code == 200, reply.text
    answer = reply.json()["data"]
    assert (answer["cmd"], answer["run_id"], answer["args"]) == ("status", "live", {})
    assert before <= answer["result"]["step"] and answer["result"]["pid"] == stack.agent.pid
    # the agent applies commands in order: of all we asked, only the last one reached it
    new = command_ids(stack)[len(applied_before) :]
    assert [i for i in new if not i.startswith("lg-")] == [answer["id"]]
    log = stack.log.read_text()
    assert f"control {answer['id']}: status {{}} to run live" in log
    assert "control: refused a request for run live" in log
    assert TOKEN not in log


def test_bad_paths_and_methods_are_json_errors(stack: Stack) -> None:
    assert "/api/v1/nope" in error_of(requests.get(f"{stack.url}/api/v1/nope", timeout=10), 404)
    wrong = requests.delete(f"{stack.url}/api/v1/runs", timeout=10)
    assert "use GET" in error_of(wrong, 405) and wrong.headers["Allow"] == "GET"
    wrong = requests.get(f"{stack.url}/api/v1/runs/live/control", timeout=10)
    assert error_of(wrong, 405) and wrong.headers["Allow"] == "POST"
    url = f"{stack.url}/api/v1/runs/live/control"
    not_json = requests.post(url, data=b"{", headers=AUTH, timeout=10)
    assert error_of(not_json, 400).startswith("body: not JSON")
    extra = requests.post(url, json={"cmd": "status", "token": TOKEN}, headers=AUTH, timeout=10)
    assert "'token'" in error_of(extra, 400)
