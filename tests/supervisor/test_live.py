"""lossguard-supervise around real training: SIGKILLs (of the training process and of the
supervisor) end with bitwise-identical weights, preemption saves and ends the run, a whole
torchrun group is restarted together, and a hung run is restarted when the monitor's
TrainingStalled fires (the short version of ``benchmarks/bench_supervisor.py``)."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_supervisor import chaos, supervise
from lossguard.common.exitcodes import EXIT_STOPPED
from lossguard.common.rundir.supervisor_file import SupervisorInfo
from tests.support.processes import (
    start_monitor,
    stop_process,
    stop_processes,
    supervisor_argv,
    wait_for,
)
from tests.support.runs import (
    events,
    stalled_rules,
    step_records,
    tiny_settings,
    write_config,
    write_monitor_config,
)

pytestmark = pytest.mark.live


def test_killed_training_and_supervisor_end_bitwise_identical(
    tmp_path: Path, corpus_cache: Path
) -> None:
    # one SIGKILL of the training process, then (the new one running) one of the supervisor:
    # the ten kills are benchmarks/bench_supervisor.py's
    result = chaos(tmp_path, corpus_cache, steps=120, kills=1, seed=3)
    assert result["status"] == 0
    assert result["kills"] == 1 and result["restarts"] == 1
    assert result["supervisor_starts"] == 2  # one supervisor was SIGKILLed and replaced
    assert result["identical"]


def test_a_stop_signal_saves_and_nothing_is_restarted(tmp_path: Path, corpus_cache: Path) -> None:
    settings = tiny_settings(
        tmp_path / "runs", corpus_cache, train={"max_steps": 10**6, "log_every": 1}
    )
    run_dir = tmp_path / "runs" / "tiny"
    supervisor = supervise(run_dir, write_config(tmp_path / "c.yaml", settings))
    try:
        wait_for(lambda: step_records(run_dir).keys() >= {5}, 120, "training")
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(120) == EXIT_STOPPED
    finally:
        stop_process(supervisor)
    trail = events(run_dir)
    assert not [e for e in trail if e.get("event") in ("crash", "restart")]
    assert trail[-1]["event"] == "supervisor_exit" and trail[-1]["stop_signal"] is True
    assert json.loads((run_dir / "agent.json").read_text())["exit"] == "stopped"
    assert (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())


def test_a_torchrun_group_is_restarted_together(tmp_path: Path, corpus_cache: Path) -> None:
    settings = tiny_settings(
        tmp_path / "runs",
        corpus_cache,
        train={"max_steps": 60, "log_every": 1, "eval_every": 1000},
        checkpoint={"every": 10},
    )
    config = write_config(tmp_path / "c.yaml", settings)
    run_dir = tmp_path / "runs" / "tiny"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command = [*torchrun, "-m", "lossguard.agent.cli", "run", str(config), "--no-progress"]
    supervisor = subprocess.Popen(
        supervisor_argv(run_dir, "--backoff", "100ms", command=command),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: (run_dir / "checkpoints/step_00000020").exists(), 240, "step 20")
        rank0 = json.loads((run_dir / "agent.json").read_text())["pid"]
        subprocess.run(["kill", "-KILL", str(rank0)], check=True)
        _, err = supervisor.communicate(timeout=600)
        assert supervisor.returncode == 0, err[-2000:]
    finally:
        stop_process(supervisor)
    trail = events(run_dir)
    crash = next(e for e in trail if e.get("event") == "crash")
    assert crash["exit"].startswith("exit code")  # torchrun ended the group and failed
    resumed = [e for e in trail if e.get("event") == "resumed"]
    assert resumed and resumed[-1]["checkpoint"] == crash["resume_from"]
    starts = [e for e in trail if e.get("event") == "start"]
    assert len(starts) == 2 and all(e["world_size"] == 2 for e in starts)
    assert max(step_records(run_dir)) == 60


def test_a_hung_run_is_restarted_when_training_stalled_fires(
    tmp_path: Path, corpus_cache: Path
) -> None:
    """The shipped TrainingStalled with a 3 s threshold and a 2 s ``for``."""
    rules_file = stalled_rules(tmp_path)
    runs = tmp_path / "runs"
    monitor_config, _ = write_monitor_config(
        tmp_path / "monitor.yml", [rules_file], scrape={"runs_root": str(runs)}
    )
    monitor = start_monitor(monitor_config)
    settings = tiny_settings(
        runs,
        corpus_cache,
        run={"id": "hung"},
        train={"max_steps": 10**6, "log_every": 1, "eval_every": 10**6},
        checkpoint={"every": 10},
        faults=[{"kind": "hang", "step": 25}],
    )
    run_dir = runs / "hung"
    supervisor = supervise(
        run_dir, write_config(tmp_path / "c.yaml", settings), "--kill-after", "1s"
    )
    try:
        restart = wait_for(
            lambda: next((e for e in events(run_dir) if e.get("event") == "restart"), None),
            120,
            "the requested restart",
        )
        assert restart["reason"] == "requested" and restart["resume_from"] == "step_00000020"
        wait_for(
            lambda: any(
                e.get("event") == "resumed" and e["time"] > restart["time"] for e in events(run_dir)
            ),
            120,
            "the resumed run",
        )
        command = next(e for e in events(run_dir) if e.get("cmd") == "restart")
        assert command["args"] == {"reason": "alert TrainingStalled"}
        info = SupervisorInfo.read(run_dir)
        assert info is not None and info.restarts == 1
    finally:
        stop_processes(supervisor, monitor)
    with sqlite3.connect(tmp_path / "state.db") as db:
        kind, state = db.execute("SELECT kind, state FROM actions").fetchone()
    assert (kind, state) == ("restart", "applied")
