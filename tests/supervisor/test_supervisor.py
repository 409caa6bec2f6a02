"""lossguard-supervise with stand-in training commands: restarts, backoff and budget, crash loop
and a human restart, preemption, requested restarts of a hung command, a killed supervisor,
the control over TCP behind the token gate."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from lossguard.common.control.client import ControlClient
from lossguard.common.exitcodes import EXIT_STOPPED
from lossguard.common.rundir.supervisor_file import SupervisorInfo, pid_alive
from lossguard.supervisor.budget import RestartBudget
from lossguard.supervisor.leader import Leader
from lossguard.supervisor.multinode import Coordination
from lossguard.supervisor.process import command_env
from lossguard.supervisor.resume import ResumePlanner, step_reached
from lossguard.supervisor.supervisor import Supervisor, SupervisorOptions, TcpControl
from tests.support.processes import run_cli, stop_process, supervisor_argv, wait_for
from tests.support.runs import events, tiny_settings, write_config

pytestmark = pytest.mark.live

# A stand-in training command: counts its starts in starts.txt, records the checkpoint it was
# told to resume from (and the supervisor's TCP control address, in control.txt), then behaves
# as the file behaviour.txt says: "exit N" (after writing a line to stderr), "hang", or "train"
# (run until SIGTERM, then exit 3, stopped, as the agent does).
COMMAND = textwrap.dedent(
    """
    import os, signal, sys, threading, pathlib
    here = pathlib.Path(sys.argv[1])
    with open(here / "starts.txt", "a") as fh:
        fh.write(os.environ.get("LOSSGUARD_RESUME", "-") + "\\n")
    (here / "control.txt").write_text(os.environ.get("LOSSGUARD_SUPERVISOR_CONTROL", "-"))
    behaviour = (here / "behaviour.txt").read_text().split()
    if behaviour[0] == "exit":
        print("stand-in: failing on purpose", file=sys.stderr)
        sys.exit(int(behaviour[1]))
    stopped = threading.Event()
    if behaviour[0] == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stuck: only SIGKILL ends it
    else:
        signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    (here / "child.pid.tmp").write_text(str(os.getpid()))  # whole when it appears
    os.replace(here / "child.pid.tmp", here / "child.pid")
    stopped.wait()
    (here / "saved.txt").write_text("saved")
    sys.exit(3)
    """
)


def stand_in(run_dir: Path) -> list[str]:
    """The stand-in's argv. The script is written once: rewriting it in place for a second
    supervisor truncated it under a first one's child still starting, which then ran an empty
    script and exited 0."""
    script = run_dir.parent / "stand_in.py"
    if not script.exists():
        script.write_text(COMMAND)
    return [sys.executable, str(script), str(run_dir)]


def supervise(
    run_dir: Path, *options: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = supervisor_argv(run_dir, "--backoff", "50ms", *options, command=stand_in(run_dir))
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def starts(run_dir: Path) -> list[str]:
    path = run_dir / "starts.txt"
    return path.read_text().split() if path.exists() else []


def ask(
    run_dir: Path | None, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``lossguard-supervise ARGS --run-dir RUN_DIR`` (None: ARGS name the supervisor)."""
    where = ["--run-dir", str(run_dir)] if run_dir is not None else []
    return subprocess.run(
        [sys.executable, "-m", "lossguard.supervisor.cli", *args, *where],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def supervisor_series(run_dir: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    info = SupervisorInfo.read(run_dir)
    assert info is not None and info.metrics_url is not None
    text = requests.get(info.metrics_url, timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def state_of(run_dir: Path) -> str | None:
    info = SupervisorInfo.read(run_dir)
    return info.state if info else None


def trains(run_dir: Path) -> bool:
    """A started stand-in is training (its pid written) and the supervisor says "running"."""
    return (run_dir / "child.pid").exists() and state_of(run_dir) == "running"


def of_kind(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in events(run_dir) if e.get("event") == kind]


def test_restarts_after_crashes_until_the_command_succeeds(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "behaviour.txt").write_text("exit 70")
    supervisor = supervise(run_dir)
    try:
        wait_for(lambda: len(starts(run_dir)) >= 3, 30, "three starts")
        (run_dir / "behaviour.txt").write_text("train")
        wait_for(lambda: trains(run_dir), 30, "a start that trains")
        child = int((run_dir / "child.pid").read_text())
        series = supervisor_series(run_dir)
        crashes = series[("lossguard_supervisor_crashes_total", (("run_id", "run"),))]
        assert crashes == len(starts(run_dir)) - 1
        supervisor.send_signal(signal.SIGTERM)  # a stop: forwarded, saved, not restarted
        assert supervisor.wait(30) == EXIT_STOPPED
    finally:
        stop_process(supervisor)
    assert (run_dir / "saved.txt").exists() and not pid_alive(child)
    crash = of_kind(run_dir, "crash")[0]
    assert crash["exit"] == "exit code 70" and crash["source"] == "supervisor"
    assert "stand-in: failing on purpose" in crash["stderr_tail"]
    assert crash["resume_from"] is None  # no checkpoints: started afresh
    assert [e["reason"] for e in of_kind(run_dir, "restart")] == ["crash"] * crash_count(run_dir)
    assert of_kind(run_dir, "supervisor_exit")[-1]["stop_signal"] is True
    assert state_of(run_dir) == "exited"


def crash_count(run_dir: Path) -> int:
    return len(of_kind(run_dir, "crash"))


def test_a_completed_run_is_not_restarted(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "behaviour.txt").write_text("exit 0")
    supervisor = supervise(run_dir)
    assert supervisor.wait(30) == 0
    assert len(starts(run_dir)) == 1 and crash_count(run_dir) == 0
    assert state_of(run_dir) == "exited"


def test_crash_loop_stops_restarting_pages_and_waits_for_a_human(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "behaviour.txt").write_text("exit 1")
    supervisor = supervise(run_dir, "--max-restarts", "2", "--window", "1h")
    try:
        wait_for(lambda: state_of(run_dir) == "crash_loop", 30, "the crash loop")
        assert len(starts(run_dir)) == 3  # the first start and two restarts
        series = supervisor_series(run_dir)
        assert series[("lossguard_supervisor_state", (("run_id", "run"), ("state", "crash_loop")))]
        assert series[("lossguard_supervisor_restarts_remaining", (("run_id", "run"),))] == 0
        assert of_kind(run_dir, "crash_loop")
        assert supervisor.poll() is None  # stays up: the page is its state series

        (run_dir / "behaviour.txt").write_text("train")
        restarted = ask(run_dir, "restart", "--reason", "fixed the data path")
        assert restarted.returncode == 0, restarted.stderr
        wait_for(lambda: trains(run_dir), 30, "the human restart")
        assert len(starts(run_dir)) == 4
        request = of_kind(run_dir, "command")[-1]
        assert request["cmd"] == "restart" and request["args"] == {"reason": "fixed the data path"}
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(30) == EXIT_STOPPED
    finally:
        stop_process(supervisor)


def test_a_requested_restart_ends_a_hung_process_group_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "behaviour.txt").write_text("hang")
    supervisor = supervise(run_dir, "--kill-after", "200ms")
    try:
        wait_for(lambda: (run_dir / "child.pid").exists(), 30, "the hung command")
        hung = int((run_dir / "child.pid").read_text())
        (run_dir / "child.pid").unlink()
        (run_dir / "behaviour.txt").write_text("train")
        with ControlClient(socket_path=run_dir / "supervisor.sock", timeout=30) as client:
            first = client.request("restart", {"reason": "TrainingStalled"}, request_id="r-1")
            again = client.request("restart", {"reason": "TrainingStalled"}, request_id="r-1")
        assert first["restarting"] is True and first["killed_pid"] == hung
        assert again == first  # the same id is applied once
        wait_for(lambda: (run_dir / "child.pid").exists(), 30, "the restarted command")
        assert not pid_alive(hung)
        assert len(starts(run_dir)) == 2
        restarts = of_kind(run_dir, "restart")
        assert [r["reason"] for r in restarts] == ["requested"]
        series = supervisor_series(run_dir)
        key = ("lossguard_supervisor_restarts_total", (("reason", "requested"), ("run_id", "run")))
        assert series[key] == 1
    finally:
        stop_process(supervisor)
    # a supervisor started again remembers the id: the request is not applied twice
    supervisor = supervise(run_dir)
    try:
        wait_for(lambda: len(starts(run_dir)) == 3, 30, "the second supervisor's start")
        with ControlClient(socket_path=run_dir / "supervisor.sock", timeout=30) as client:
            assert client.request("restart", {}, request_id="r-1") == first
            assert client.request("status", {})["restarts"] == 0  # nothing was restarted
    finally:
        stop_process(supervisor)


def test_a_killed_supervisor_takes_its_run_along(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "behaviour.txt").write_text("train")
    supervisor = supervise(run_dir)
    wait_for(lambda: (run_dir / "child.pid").exists(), 30, "the command")
    child = int((run_dir / "child.pid").read_text())
    supervisor.kill()
    supervisor.wait(10)
    wait_for(lambda: not pid_alive(child), 10, "the orphaned command to end")


def test_one_supervisor_per_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "behaviour.txt").write_text("train")
    supervisor = supervise(run_dir)
    try:
        wait_for(lambda: state_of(run_dir) == "running", 30, "the first supervisor")
        second = supervise(run_dir)
        _, err = second.communicate(timeout=60)
        assert second.returncode == 1
        assert err.strip().splitlines()[-1] == (
            f"lossguard-supervise: error: supervisor pid {supervisor.pid} already supervises "
            f"{run_dir.resolve()}"
        )
    finally:
        stop_process(supervisor)


def test_status_and_a_missing_command(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    refused = ask(run_dir, "status")
    assert refused.returncode == 1
    assert refused.stderr.startswith(
        f"lossguard-supervise: error: no supervisor answers at {run_dir}"
    )
    usage = subprocess.run(
        supervisor_argv(run_dir, command=[])[:-1], capture_output=True, text=True, timeout=60
    )
    assert usage.returncode == 2 and "the training command is missing" in usage.stderr


def test_budget_doubles_the_backoff_and_refuses_past_the_window() -> None:
    budget = RestartBudget(max_restarts=3, window_s=3600, backoff_s=0.05, backoff_max_s=0.15)
    assert [budget.take(t) for t in (0.0, 1.0, 2.0, 3.0)] == [0.05, 0.1, 0.15, None]
    assert budget.remaining(3.0) == 0
    assert budget.take(3600.5) == 0.15  # the first restart left the window: two remain in it
    assert budget.remaining(3600.5) == 0


def test_env_of_a_start_names_no_stale_resume(tmp_path: Path) -> None:
    """A LOSSGUARD_RESUME in the supervisor's own environment never reaches a fresh start."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "behaviour.txt").write_text("exit 0")
    env = {**os.environ, "LOSSGUARD_RESUME": "step_00000999"}
    argv = supervisor_argv(run_dir, command=stand_in(run_dir))
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert starts(run_dir) == ["-"]
    assert json.loads((run_dir / "supervisor.json").read_text())["state"] == "exited"


def test_a_crash_again_at_the_same_step_resumes_from_an_earlier_checkpoint(
    tmp_path: Path, corpus_cache: Path
) -> None:
    settings = tiny_settings(
        tmp_path / "runs",
        corpus_cache,
        train={"max_steps": 40, "log_every": 1, "eval_every": 1000},
        checkpoint={"every": 10, "keep_last": 100},
        telemetry={"spikes": {"zscore": 1000.0}},  # every checkpoint healthy
    )
    done = run_cli("run", str(write_config(tmp_path / "c.yaml", settings)), "--no-progress")
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "runs/tiny"
    assert step_reached(run_dir) == 40
    planner = ResumePlanner(run_dir)
    chosen = []
    for crash_step in (45, 45, 45, 45, 47, 47):
        planner.crashed(crash_step)
        meta = planner.choose()
        chosen.append(meta.name if meta else None)
    assert chosen == [
        "step_00000040",  # the newest healthy one
        "step_00000030",  # the same step again: before the one resumed from
        "step_00000020",
        "step_00000010",
        "step_00000040",  # a crash elsewhere: the newest again
        "step_00000030",
    ]


TOKEN = "supervisor-token-" + "0" * 16


def token_env(token: str | None) -> dict[str, str]:
    """This environment with ``token`` (None: none) as ``$LOSSGUARD_CONTROL_TOKEN``."""
    env = {k: v for k, v in os.environ.items() if k != "LOSSGUARD_CONTROL_TOKEN"}
    return env if token is None else {**env, "LOSSGUARD_CONTROL_TOKEN": token}


def child_pid(run_dir: Path) -> int | None:
    """The running stand-in's pid (None: none written yet, or being written)."""
    text = (run_dir / "child.pid").read_text() if (run_dir / "child.pid").exists() else ""
    return int(text) if text.isdigit() else None


def refusals(run_dir: Path, reason: str) -> float:
    key = ("lossguard_supervisor_control_refusals_total", (("reason", reason), ("run_id", "run")))
    return supervisor_series(run_dir)[key]


def test_status_and_restart_over_tcp_behind_the_token(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "behaviour.txt").write_text("train")
    supervisor = supervise(run_dir, "--control-tcp", "127.0.0.1:0", env=token_env(TOKEN))
    try:
        wait_for(lambda: trains(run_dir) and child_pid(run_dir), 30, "the command")
        first = child_pid(run_dir)
        recorded = json.loads((run_dir / "supervisor.json").read_text())
        address = recorded["control_tcp"]
        host, _, port = address.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
        assert (run_dir / "control.txt").read_text() == address  # the command is told
        assert TOKEN not in (run_dir / "supervisor.json").read_text()

        status = ask(None, "status", "--tcp", address, "--json", env=token_env(TOKEN))
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["child_pid"] == first

        assert refusals(run_dir, "unauthorized") == 0
        wrong = ask(None, "status", "--tcp", address, env=token_env("x" * 32))
        assert wrong.returncode == 1
        assert wrong.stderr.strip() == (
            "lossguard-supervise: error: unauthorized: a valid token is required over TCP"
        )
        assert refusals(run_dir, "unauthorized") == 1

        restarted = ask(
            None, "restart", "--tcp", address, "--reason", "hung", "--json", env=token_env(TOKEN)
        )
        assert restarted.returncode == 0, restarted.stderr
        assert json.loads(restarted.stdout)["killed_pid"] == first
        wait_for(lambda: child_pid(run_dir) not in (None, first), 30, "the restarted command")
        assert first is not None and not pid_alive(first) and len(starts(run_dir)) == 2
        assert of_kind(run_dir, "command")[-1]["args"] == {"reason": "hung"}
        assert (run_dir / "control.txt").read_text() == address  # every start is told
        assert TOKEN not in (run_dir / "events.jsonl").read_text()
    finally:
        stop_process(supervisor)
    assert supervisor.stderr is not None and TOKEN not in supervisor.stderr.read()


def test_tcp_control_needs_a_token_and_a_host_port(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cases = [
        (
            ["--control-tcp", "127.0.0.1:0"],
            None,
            "--control-tcp: needs a token in the environment variable "
            "LOSSGUARD_CONTROL_TOKEN, which is not set",
        ),
        (
            ["--control-tcp", "127.0.0.1:0", "--token-env", "SHORT"],
            None,
            "--control-tcp: the token in SHORT has 5 characters, fewer than 16: "
            "make one with openssl rand -hex 32",
        ),
        (
            ["--control-tcp", "nohost"],
            TOKEN,
            "--control-tcp: 'nohost' is not HOST:PORT (e.g. 10.0.0.5:9420)",
        ),
    ]
    for options, token, message in cases:
        env = {**token_env(token), "SHORT": "short"}
        done = subprocess.run(
            supervisor_argv(run_dir, *options, command=["true"]),
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert done.returncode == 2
        assert done.stderr.splitlines() == [f"lossguard-supervise: error: {message}"]
    assert not run_dir.exists()  # nothing started
    asked = ask(None, "restart", "--tcp", "127.0.0.1:7071", env=token_env(None))
    assert asked.returncode == 2 and asked.stderr.splitlines() == [
        "lossguard-supervise: error: --tcp: needs a token in the environment variable "
        "LOSSGUARD_CONTROL_TOKEN, which is not set"
    ]


def advertised(run_dir: Path, control: TcpControl) -> tuple[str | None, int]:
    """What a supervisor with ``control`` records as ``control_tcp``, and the port it bound."""
    options = SupervisorOptions(run_dir, ("true",), "run", metrics_port=None, control_tcp=control)
    supervisor = Supervisor(options)
    supervisor._start_services()
    try:
        assert supervisor.server is not None and supervisor.server.tcp_address is not None
        return supervisor.info.control_tcp, supervisor.server.tcp_address[1]
    finally:
        if supervisor.server is not None:
            supervisor.server.close()
        supervisor.events.close()


def test_the_advertised_address_names_this_host_and_the_bound_port(tmp_path: Path) -> None:
    address, port = advertised(tmp_path / "a", TcpControl(("0.0.0.0", 0), TOKEN))
    assert port > 0 and address == f"{socket.gethostname()}:{port}"
    named = TcpControl(("127.0.0.1", 0), TOKEN, advertise="gpu-node-3.example:7071")
    assert advertised(tmp_path / "b", named)[0] == "gpu-node-3.example:7071"  # as given
    assert TOKEN not in repr(named)


def test_every_node_s_command_is_told_node_0_s_control(tmp_path: Path) -> None:
    leader = Leader(Coordination(tmp_path), nnodes=2, control_tcp="node0:7071")
    leader.publish("run", generation=1, resume_from="step_00000010")
    decision = Coordination(tmp_path).decision()  # as a follower reads it
    assert decision is not None and decision.control_tcp == "node0:7071"
    base = {"LOSSGUARD_SUPERVISOR_CONTROL": "stale", "LOSSGUARD_RESUME": "stale", "A": "1"}
    env = command_env(decision.resume_from, decision.control_tcp, base)
    assert env == {
        "A": "1",
        "LOSSGUARD_RESUME": "step_00000010",
        "LOSSGUARD_SUPERVISOR_CONTROL": "node0:7071",
    }
    assert command_env(None, None, base) == {"A": "1"}


def test_a_supervisor_json_without_control_tcp_is_read() -> None:
    old = {"run_id": "r", "pid": 1, "hostname": "h", "started_at": 1.0, "state": "running"}
    info = SupervisorInfo.parse(json.dumps(old))
    assert info.control_tcp is None
