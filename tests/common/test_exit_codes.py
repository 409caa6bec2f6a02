"""The exit-code contract (lossguard.common.exitcodes, docs/exit-codes.md): each outcome ends
with its code, from the Guard helper, ``lossguard-agent run`` and ``lossguard-supervise``.
(The agent's stop and preemption signals: tests/agent/checkpoint/test_resume.py; on Slurm:
tests/deploy/test_slurm_live.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from lossguard.agent import Guard
from lossguard.agent.train.trainer import Trainer
from lossguard.common.exitcodes import (
    EXIT_CODES,
    EXIT_CONFIG,
    EXIT_PERMANENT,
    EXIT_PREEMPTED,
    EXIT_RETRYABLE,
    EXIT_STOPPED,
    Outcome,
)
from tests.agent.test_guard import guard_config
from tests.support.processes import REPO, run_cli, supervisor_argv
from tests.support.runs import tiny_settings, write_config

pytestmark = pytest.mark.live


def test_the_documented_table_is_the_code_table() -> None:
    text = (REPO / "docs" / "exit-codes.md").read_text()
    rows = dict(re.findall(r"^\| (\w+) \| (\d+) \|", text, flags=re.MULTILINE))
    assert {k: int(v) for k, v in rows.items()} == EXIT_CODES


def _guard(tmp_path: Path) -> Guard:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Guard(tmp_path, model=model, optimizer=opt, config=guard_config(), progress=False)


def _step(guard: Guard) -> None:
    assert guard.optimizer is not None
    loss = guard.state["model"](torch.ones(2, 4)).sum()  # type: ignore[operator]
    loss.backward()
    guard.after_backward(loss, tokens=2)
    guard.optimizer.step()
    guard.optimizer.zero_grad()
    guard.end_step()
    guard.poll()


@pytest.mark.parametrize(
    ("how", "outcome"),
    [("completed", "completed"), ("stop", "stopped"), ("SIGUSR1", "preempted")],
)
def test_the_guard_helper_maps_how_the_loop_ended(
    tmp_path: Path, how: str, outcome: Outcome
) -> None:
    with _guard(tmp_path) as guard:
        _step(guard)
        if how == "stop":
            guard.commands.stop(reason="test")
        elif how == "SIGUSR1":
            os.kill(os.getpid(), signal.SIGUSR1)  # caught by the Guard's handler
            _step(guard)
        assert guard.outcome == outcome
        assert guard.exit_code() == EXIT_CODES[outcome]
        assert guard.exit_code(failed=True) == EXIT_RETRYABLE
    assert json.loads((tmp_path / "agent.json").read_text())["exit"] == outcome


def test_the_agent_ends_a_bad_config_with_2_and_a_training_error_with_75(
    tmp_path: Path, corpus_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_config(tmp_path / "c.yaml", tiny_settings(tmp_path / "runs", corpus_cache))
    bad = run_cli("run", str(config), "--set", "train.lr=-1")
    assert bad.returncode == EXIT_CONFIG and "train.lr" in bad.stderr

    def fail(self: Trainer) -> None:
        raise RuntimeError("NCCL timeout (injected)")

    monkeypatch.setattr(Trainer, "fit", fail)
    from lossguard.agent.cli import main

    assert main(["run", str(config), "--no-progress"]) == EXIT_RETRYABLE
    agent = json.loads((tmp_path / "runs" / "tiny" / "agent.json").read_text())
    assert agent["exit"] == "failed"


def _supervise(run_dir: Path, script: str, *options: str) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = supervisor_argv(
        run_dir, "--backoff", "10ms", *options, command=[sys.executable, "-c", script]
    )
    return subprocess.run(argv, capture_output=True, timeout=60, check=False).returncode


@pytest.mark.parametrize("code", [0, EXIT_STOPPED, EXIT_PREEMPTED, EXIT_CONFIG])
def test_the_supervisor_ends_with_a_run_ending_code_of_its_command(
    tmp_path: Path, code: int
) -> None:
    assert _supervise(tmp_path / "run", f"import sys; sys.exit({code})") == code
    assert not (tmp_path / "run" / "events.jsonl").read_text().count('"event": "crash"')


def test_the_supervisor_reads_a_stop_that_torchrun_reported_as_1(tmp_path: Path) -> None:
    """torchrun exits 1 whatever its workers' codes: agent.json says the run was preempted."""
    agent: dict[str, object] = {"run_id": "run", "metrics_urls": [], "exit": "preempted"}
    script = (
        "import json, sys, time, pathlib; "
        f"agent = {agent!r}; agent['finished_at'] = time.time(); "
        f"pathlib.Path({str(tmp_path / 'run' / 'agent.json')!r}).write_text(json.dumps(agent)); "
        "sys.exit(1)"
    )
    assert _supervise(tmp_path / "run", script) == EXIT_PREEMPTED
    stale = {**agent, "exit": "stopped", "finished_at": time.time() - 3600}
    (tmp_path / "run2").mkdir()
    (tmp_path / "run2" / "agent.json").write_text(json.dumps(stale))
    # an agent.json from before this start is not this run's word: a crash, then a crash loop
    code = _supervise(
        tmp_path / "run2", "import sys; sys.exit(1)", "--max-restarts", "1", "--give-up"
    )
    assert code == EXIT_PERMANENT


@pytest.mark.parametrize(
    ("torchrun", "says"),
    [
        (["--nnodes=2", "--max-restarts=3"], "--max-restarts 3: under lossguard-supervise"),
        (["--nnodes", "1:4"], "elastic node counts are not supervised"),
        (["--nnodes=2", "--node-rank=2"], "node rank 2 is not below the node count 2"),
    ],
)
def test_the_supervisor_refuses_a_torchrun_it_cannot_supervise(
    tmp_path: Path, torchrun: list[str], says: str
) -> None:
    command = ["torchrun", *torchrun, "train.py"]
    argv = supervisor_argv(tmp_path / "run", command=command)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == EXIT_CONFIG
    (line,) = done.stderr.strip().splitlines()  # one line naming the problem
    assert line.startswith("lossguard-supervise: error: ") and says in line
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
