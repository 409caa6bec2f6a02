"""lossguard-ctl when no agent answers: checkpoints read from the run directory, and one line
for a dead agent (its pid, last step, its supervisor, or the command that resumes it)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lossguard.agent import Guard
from lossguard.agent.config import parse_config
from lossguard.common.control.client import ControlClient
from lossguard.common.rundir.agent_file import AgentInfo
from lossguard.common.rundir.names import SUPERVISOR_FILE
from lossguard.common.rundir.supervisor_file import SupervisorInfo
from lossguard.ctl.cli import main
from lossguard.ctl.offline import resume_command
from tests.support.processes import REPO, start_agent, wait_for
from tests.support.runs import events, sliced_settings, write_config

pytestmark = pytest.mark.live


def ctl(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def online_checkpoints(guard: Guard) -> dict[str, Any]:
    """The live agent's ``checkpoints`` answer: asked from a thread, applied at ``poll``."""
    answer: list[dict[str, Any]] = []
    assert guard.control is not None
    client = ControlClient(socket_path=guard.control.socket_path, timeout=30)
    asker = threading.Thread(target=lambda: answer.append(client.request("checkpoints")))
    asker.start()
    deadline = time.monotonic() + 30
    while asker.is_alive() and time.monotonic() < deadline:
        guard.poll()  # takes queued commands without waiting
    asker.join()
    client.close()
    return answer[0]


def run_with_marks(run_dir: Path) -> dict[str, Any]:
    """A finished run whose latest, best and last good checkpoints differ; returns the live
    agent's listing of them."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = parse_config(
        {
            "telemetry": {"enabled": False},
            "checkpoint": {"every": 5, "keep_last": 10, "save_on_exit": False},
            "snapshot": {"every": None},  # what is on disk only, as after the agent is gone
        }
    )
    guard = Guard(run_dir, model=model, optimizer=opt, config=cfg, progress=False)
    x = torch.randn(8, 4)
    for step in range(1, 16):
        model(x).pow(2).mean().backward()
        guard.after_backward(torch.tensor(1.0), tokens=8)
        opt.step()
        opt.zero_grad()
        guard.end_step()
        if step in (5, 10):
            guard.record_eval(2.0 if step == 5 else 3.0)  # step 5 is the best
        guard.poll()
    guard.save("manual", healthy=False, wait=True)  # replaces step 15's: the latest, not good
    listed = online_checkpoints(guard)
    guard.close()
    return listed


def test_checkpoints_are_read_from_disk_when_no_agent_answers(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    online = run_with_marks(run_dir)
    assert (online["latest"], online["best"], online["last_good"]) == (
        "step_00000015",
        "step_00000005",
        "step_00000010",
    )
    code, out, err = ctl(capsys, "--run-dir", str(run_dir), "checkpoints")
    assert (code, err) == (0, "")
    note, header, *rows = out.splitlines()
    assert note == (
        f"no agent answered at {run_dir}/control.sock: checkpoints read from {run_dir}/checkpoints"
    )
    assert header.split()[0] == "name" and header.endswith("marks")
    marks = {row.split()[0]: row.split("  ")[-1].strip() for row in rows}
    assert marks == {
        "step_00000005": "best",
        "step_00000010": "last_good",
        "step_00000015": "latest",
    }
    code, out, err = ctl(capsys, "--run-dir", str(run_dir), "--json", "checkpoints")
    assert code == 0 and err.startswith("no agent answered at ")
    assert json.loads(out) == online  # what the agent answered while it ran


def dead_pid() -> int:
    """The pid of a process that has ended."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_no_answer_from_a_missing_run_is_the_plain_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = ctl(capsys, "--run-dir", str(tmp_path / "gone"), "checkpoints")
    assert (code, out) == (3, "")
    assert err == (
        f"lossguard-ctl: error: cannot connect to the agent at {tmp_path}/gone/control.sock: "
        "No such file or directory\n"
    )


def test_a_dead_agent_gets_one_line_that_resumes_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, corpus_cache: Path
) -> None:
    """A run killed mid-way: every command that needs the agent says so in one line, naming
    the supervisor when one is restarting the run, else the command that resumes it; that
    command works."""
    settings = sliced_settings(
        tmp_path / "runs",
        corpus_cache,
        train={"max_steps": 40, "batch_size": 32, "log_every": 1, "eval_every": 1000},
        checkpoint={"every": 5, "keep_last": 100},
        telemetry={"spikes": {"zscore": 25.0}},  # the tiny model's drift is no episode
    )
    config = write_config(tmp_path / "c.yaml", settings)
    run_dir = tmp_path / "runs/tiny"
    agent = start_agent(config)
    wait_for(lambda: (run_dir / "checkpoints/step_00000010").exists(), 120, "checkpoint 10")
    agent.send_signal(signal.SIGKILL)
    assert agent.wait(30) == -signal.SIGKILL
    last_step = [r["step"] for r in log_lines(run_dir) if r["kind"] == "train"][-1]
    metas = [json.loads(p.read_text()) for p in (run_dir / "checkpoints").glob("*/meta.json")]
    good = max((m for m in metas if m["healthy"]), key=lambda m: m["seq"])["name"]

    for command in (["status"], ["stop"], ["rollback", "step_00000005"]):
        code, out, err = ctl(capsys, "--run-dir", str(run_dir), *command)
        assert (code, out) == (3, ""), command
        assert err == (
            f"lossguard-ctl: error: agent pid {agent.pid} is not running (last step {last_step}); "
            f"resume with: lossguard-agent run {run_dir}/config.yaml --resume {good}\n"
        )

    supervisor = SupervisorInfo(
        run_id="tiny",
        pid=os.getpid(),  # alive: this test
        hostname=socket.gethostname(),
        started_at=time.time(),
        state="backoff",
    )
    (run_dir / SUPERVISOR_FILE).write_text(supervisor.to_json())
    code, _, err = ctl(capsys, "--run-dir", str(run_dir), "status")
    assert code == 3 and err.endswith(
        f"(last step {last_step}); the supervisor (pid {os.getpid()}) is restarting it\n"
    )
    (run_dir / SUPERVISOR_FILE).write_text(supervisor.with_state("crash_loop").to_json())
    code, _, err = ctl(capsys, "--run-dir", str(run_dir), "status")
    assert f"the supervisor (pid {os.getpid()}) stopped restarting it (crash loop); " in err
    assert err.endswith(f"--resume {good}\n")
    (run_dir / SUPERVISOR_FILE).write_text(
        supervisor.with_state("running", pid=dead_pid()).to_json()
    )
    code, _, err = ctl(capsys, "--run-dir", str(run_dir), "status")
    assert "supervisor" not in err and err.endswith(f"--resume {good}\n")  # it died too

    words = shlex.split(err.split("resume with: ", 1)[1])
    script = Path(sys.executable).with_name(words[0])
    resumed = subprocess.run(
        [str(script), *words[1:], "--no-progress"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert [e["checkpoint"] for e in events(run_dir) if e["event"] == "resumed"] == [good]
    code, _, err = ctl(capsys, "--run-dir", str(run_dir), "status")
    assert err.startswith(f"lossguard-ctl: error: agent pid {resumed_pid(run_dir)} is not ")
    assert "(completed, last step 40)" in err


def log_lines(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records (a line torn by the SIGKILL left out)."""
    records = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def resumed_pid(run_dir: Path) -> int | None:
    return AgentInfo.parse((run_dir / "agent.json").read_bytes()).pid


def write_run(run_dir: Path, argv: list[str], run: dict[str, str]) -> None:
    """The files ``resume_command`` reads: env.json's argv and config.yaml's run section."""
    run_dir.mkdir(parents=True)
    (run_dir / "env.json").write_text(json.dumps({"argv": argv}))
    (run_dir / "config.yaml").write_text(json.dumps({"run": run}))  # JSON is YAML


def test_the_resume_command_is_the_one_the_run_was_started_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = tmp_path / "own"
    write_run(own, ["train.py", "--lr", "3e-4"], {"dir": str(tmp_path), "id": "own"})
    assert resume_command(own, 1, "step_00000150") == (
        "LOSSGUARD_RESUME=step_00000150 python train.py --lr 3e-4"
    )
    assert resume_command(own, 2, "step_00000150") == (
        "LOSSGUARD_RESUME=step_00000150 torchrun --nproc_per_node 2 train.py --lr 3e-4"
    )
    built_in = tmp_path / "runs" / "exp 1"
    write_run(built_in, ["/x/bin/lossguard-agent", "run", "c.yaml"], {"dir": "runs", "id": "exp 1"})
    monkeypatch.chdir(tmp_path)  # where its relative run.dir leads to it
    config = shlex.quote(f"{built_in}/config.yaml")
    assert resume_command(built_in, 1, "step_00000010") == (
        f"lossguard-agent run {config} --resume step_00000010"
    )
    assert resume_command(built_in, 4, "step_00000010") == (
        f"torchrun --nproc_per_node 4 -m lossguard.agent.cli run {config} --resume step_00000010"
    )
    monkeypatch.chdir(own)  # elsewhere: run.dir must be given
    assert resume_command(built_in, 1, "step_00000010") == (
        f"lossguard-agent run {config} --resume step_00000010 --set run.dir={tmp_path}/runs"
    )
