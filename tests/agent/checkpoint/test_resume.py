"""Checkpoints in real training processes: bit-exact resume after SIGKILL, bit-exact rollback,
stop and preemption, and resume errors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lossguard.common.control.client import ControlClient
from lossguard.common.exitcodes import EXIT_CODES, EXIT_STOPPED
from tests.support.processes import run_cli, start_agent, wait_for
from tests.support.runs import events, sliced_settings, step_records, write_config

pytestmark = pytest.mark.live

STEPS = 40


def exact_settings(tmp_path: Path, cache: Path, dtype: str = "fp32") -> dict[str, Any]:
    """Slow enough per step (~40 ms) that a test can act between checkpoints."""
    return sliced_settings(
        tmp_path / "runs",
        cache,
        train={"max_steps": STEPS, "batch_size": 32, "log_every": 1, "eval_every": 1000},
        model={"dropout": 0.1},  # dropout makes the torch RNG state matter
        precision={"dtype": dtype},
        checkpoint={"every": 5, "keep_last": 100},
    )


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    state = torch.load(
        run_dir / f"checkpoints/step_{STEPS:08d}/state.pt", map_location="cpu", weights_only=True
    )
    return state["state"]["model"]


def train_records(run_dir: Path) -> dict[int, dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["kind"] == "train"}


def has_checkpoint(run_dir: Path, step: int) -> bool:
    return (run_dir / f"checkpoints/step_{step:08d}/meta.json").exists()


def client(run_dir: Path) -> ControlClient:
    return ControlClient(socket_path=run_dir / "control.sock", timeout=60)


def test_resume_after_sigkill_is_bit_exact(tmp_path: Path, corpus_cache: Path) -> None:
    """In bf16: its autocast runs the same checkpoint, RNG and data-order restore as fp32 does,
    and fp32's replays from a checkpoint are bit-exact below (rollbacks, ``--resume 10``)."""
    config = write_config(tmp_path / "c.yaml", exact_settings(tmp_path, corpus_cache, "bf16"))
    runs = tmp_path / "runs"
    assert run_cli("run", str(config), "--set", "run.id=whole").returncode == 0

    agent = start_agent(config, "--set", "run.id=killed")
    wait_for(lambda: has_checkpoint(runs / "killed", 15), 120, "checkpoint step 15")
    agent.send_signal(signal.SIGKILL)
    assert agent.wait(30) == -signal.SIGKILL
    assert max(step_records(runs / "killed")) < STEPS  # really killed mid-run

    resumed = run_cli("run", str(config), "--set", "run.id=killed", "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr
    whole, killed = step_records(runs / "whole"), step_records(runs / "killed")
    assert sorted(killed) == list(range(1, STEPS + 1))
    assert killed == whole  # every step's loss, bit for bit
    a, b = final_weights(runs / "whole"), final_weights(runs / "killed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def rollback_run(config: Path, run_dir: Path, run_id: str, **args: Any) -> dict[str, Any]:
    """Train, pause after checkpoint 10, roll back to step 10 with ``args``, finish."""
    agent = start_agent(config, "--set", f"run.id={run_id}")
    wait_for(lambda: has_checkpoint(run_dir, 10), 120, "checkpoint step 10")
    with client(run_dir) as ctl:
        paused = ctl.request("pause")
        assert paused["paused"] and 10 <= paused["step"] < STEPS
        result = ctl.request("rollback", {"target": 10, **args})
        assert ctl.request("status")["step"] == 10
        ctl.request("resume")
    _, stderr = agent.communicate(timeout=120)
    assert agent.returncode == 0, stderr
    return result | {"paused_at": paused["step"]}


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory: pytest.TempPathFactory, corpus_cache: Path) -> Path:
    """An uninterrupted fp32 run of ``exact_settings`` (run id ``whole``), for the rollback
    tests to compare with; their config file."""
    root = tmp_path_factory.mktemp("whole")
    config = write_config(root / "c.yaml", exact_settings(root, corpus_cache))
    assert run_cli("run", str(config), "--set", "run.id=whole").returncode == 0
    return config


def copy_whole(whole_run: Path, tmp_path: Path, corpus_cache: Path) -> Path:
    """``tmp_path``'s config (the same settings) with the whole run copied into its runs."""
    shutil.copytree(whole_run.parent / "runs/whole", tmp_path / "runs/whole")
    return write_config(tmp_path / "c.yaml", exact_settings(tmp_path, corpus_cache))


def test_rollback_is_bit_exact(tmp_path: Path, corpus_cache: Path, whole_run: Path) -> None:
    config = copy_whole(whole_run, tmp_path, corpus_cache)
    runs = tmp_path / "runs"
    whole = step_records(runs / "whole")

    result = rollback_run(config, runs / "back", "back")
    assert result["to_step"] == 10 and result["checkpoint"] == "step_00000010"
    assert result["from_step"] == result["paused_at"]
    assert step_records(runs / "back") == whole  # steps 11.. replayed bit for bit
    rollbacks = [e for e in events(runs / "back") if e["event"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["to_step"] == 10

    # With skip_batches n: the same as resuming the uninterrupted run's step 10, skipping n.
    skipped = rollback_run(config, runs / "skip", "skip", skip_batches=3)
    assert skipped["skipped_batches"] == 3
    shutil.copytree(runs / "whole/checkpoints", runs / "ref/checkpoints")
    shutil.copy(runs / "whole/config.yaml", runs / "ref/config.yaml")
    ref = run_cli(
        "run", str(config), "--set", "run.id=ref", "--resume", "10", "--skip-batches", "3"
    )
    assert ref.returncode == 0, ref.stderr
    after = {s: v for s, v in step_records(runs / "skip").items() if s > 10}
    assert after == step_records(runs / "ref")
    assert after.keys() == set(range(11, STEPS + 1))
    assert all(after[s] != whole[s] for s in after)  # the skip really changed the data


def test_rollback_lr_scale_is_kept(tmp_path: Path, corpus_cache: Path, whole_run: Path) -> None:
    config = copy_whole(whole_run, tmp_path, corpus_cache)
    runs = tmp_path / "runs"
    result = rollback_run(config, runs / "half", "half", lr_scale=0.5)
    assert result["lr_scale"] == 0.5
    whole, half = train_records(runs / "whole"), train_records(runs / "half")
    assert half[11]["train_loss"] == whole[11]["train_loss"]  # same weights at step 10
    for step in range(11, STEPS + 1):
        assert half[step]["lr"] == pytest.approx(0.5 * whole[step]["lr"], rel=1e-12)
    # a later checkpoint keeps the scale: resuming from it continues at half the schedule
    final = torch.load(
        runs / f"half/checkpoints/step_{STEPS:08d}/state.pt", map_location="cpu", weights_only=True
    )
    assert final["state"]["progress"]["lr_scale"] == 0.5


def start_long_run(tmp_path: Path, cache: Path) -> tuple[subprocess.Popen[str], Path]:
    """A run that would go on for a long time, once its first checkpoint exists."""
    settings = exact_settings(tmp_path, cache)
    settings["train"]["max_steps"] = 100_000
    agent = start_agent(write_config(tmp_path / "c.yaml", settings))
    run_dir = tmp_path / "runs/tiny"
    wait_for(lambda: has_checkpoint(run_dir, 5), 120, "first checkpoint")
    return agent, run_dir


def test_an_applied_request_id_is_not_applied_again_after_a_restart(
    tmp_path: Path, corpus_cache: Path
) -> None:
    """A client that retries a command after the agent crashed and was resumed gets the first
    reply; the command is not applied a second time. Then the stop command saves and the agent
    exits cleanly (stopped)."""
    agent, run_dir = start_long_run(tmp_path, corpus_cache)
    with client(run_dir) as ctl:
        first = ctl.request("set_lr_scale", {"scale": 0.5}, request_id="once")
    agent.send_signal(signal.SIGKILL)
    assert agent.wait(30) == -signal.SIGKILL

    resumed = start_agent(tmp_path / "c.yaml", "--resume", "latest")
    wait_for(lambda: any(e["event"] == "resumed" for e in events(run_dir)), 120, "the resume")
    with client(run_dir) as ctl:
        again = ctl.request("set_lr_scale", {"scale": 0.25}, request_id="once")
        status = ctl.request("status")
        stopped = ctl.request("stop")
    _, stderr = resumed.communicate(timeout=60)
    assert resumed.returncode == EXIT_STOPPED, stderr
    assert stopped["checkpoint"] == f"step_{stopped['step']:08d}"
    assert has_checkpoint(run_dir, stopped["step"])
    assert not (run_dir / "control.sock").exists()
    assert json.loads((run_dir / "agent.json").read_text())["exit"] == "stopped"
    assert again == first == {"lr_scale": 0.5, "lr": first["lr"]}
    assert status["lr_scale"] != 0.25
    applied = [e for e in events(run_dir) if e["event"] == "command" and e["id"] == "once"]
    assert len(applied) == 1


@pytest.mark.parametrize(
    ("signum", "outcome", "reason"),
    [
        (signal.SIGTERM, "stopped", "signal"),
        (signal.SIGUSR1, "preempted", "preempted"),
    ],
)
def test_a_stop_or_preempt_signal_saves_then_exits_with_its_code(
    tmp_path: Path, corpus_cache: Path, signum: signal.Signals, outcome: str, reason: str
) -> None:
    """SIGINT takes SIGTERM's path (one handler for every stop signal, agent/stop_signals.py);
    tests/agent/test_stop_signals.py sends it to a real agent."""
    agent, run_dir = start_long_run(tmp_path, corpus_cache)
    agent.send_signal(signum)
    _, stderr = agent.communicate(timeout=60)
    assert agent.returncode == EXIT_CODES[outcome], stderr  # type: ignore[index]
    log = events(run_dir)
    signalled = [(e["signal"], e["preempted"]) for e in log if e["event"] == "signal"]
    assert signalled == [(signum.name, outcome == "preempted")]
    saved = [e for e in log if e["event"] == "checkpoint" and e["reason"] == reason]
    assert len(saved) == 1 and has_checkpoint(run_dir, saved[0]["checkpoint_step"])
    assert json.loads((run_dir / "agent.json").read_text())["exit"] == outcome


def refused_before_torch(*args: str, resume_env: str = "") -> subprocess.CompletedProcess[str]:
    """``lossguard-agent ARGS`` (``$LOSSGUARD_RESUME``: ``resume_env``) with Python's import
    log on: asserts it ended without importing torch; returns the run with the log taken out
    of its stderr."""
    done = run_cli(*args, PYTHONPROFILEIMPORTTIME="1", LOSSGUARD_RESUME=resume_env)
    imports = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert imports and not [line for line in imports if line.endswith("| torch")], done.stderr
    rest = "".join(line + "\n" for line in done.stderr.splitlines() if line not in imports)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout, rest)


def test_resume_problems_are_reported(tmp_path: Path, corpus_cache: Path) -> None:
    settings = exact_settings(tmp_path, corpus_cache)
    settings["train"]["max_steps"] = 12
    config = write_config(tmp_path / "c.yaml", settings)
    run_dir = tmp_path / "runs/tiny"

    # what one process can tell from its arguments and run directory, it says before torch loads
    missing = refused_before_torch("run", str(config), "--resume", "latest")
    assert missing.returncode == 2 and "no run directory" in missing.stderr
    assert refused_before_torch("run", str(config), "--resume", "../x").returncode == 2

    assert run_cli("run", str(config)).returncode == 0  # checkpoints at 5, 10 and final 12
    again = refused_before_torch("run", str(config))
    assert again.returncode == 2 and again.stderr.count("\n") == 1
    assert again.stderr.startswith(
        f"lossguard-agent: error: run.id: run directory {run_dir} already has checkpoints "
        "(newest: step_00000012): use --resume latest"
    )
    assert "--overwrite to start over" in again.stderr
    both = refused_before_torch("run", str(config), "--resume", "latest", "--overwrite")
    assert both.returncode == 2 and "--overwrite: not with --resume" in both.stderr
    finished = json.loads((run_dir / "agent.json").read_text())
    assert finished["exit"] == "completed" and finished["finished_at"] > finished["started_at"]
    state = run_dir / "checkpoints/step_00000012/state.pt"
    blob = bytearray(state.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    state.write_bytes(bytes(blob))
    resumed = run_cli("run", str(config), "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr
    assert "step_00000012" in resumed.stderr  # the warning names the corrupt checkpoint
    assert [e for e in events(run_dir) if e["event"] == "resumed"][-1]["step"] == 10

    none = run_cli("run", str(config), "--resume", "7")
    assert none.returncode == 1 and "cannot resume" in none.stderr
    bad_env = refused_before_torch("run", str(config), resume_env="/tmp/step_00000010")
    assert bad_env.returncode == 2 and "LOSSGUARD_RESUME: must be one of" in bad_env.stderr


def test_restarts_resume_from_lossguard_resume_or_start_again(
    tmp_path: Path, corpus_cache: Path
) -> None:
    """What a supervisor relies on: a run that crashed before its first checkpoint starts
    again with the same command, and $LOSSGUARD_RESUME makes the same command resume (winning
    over --resume); --overwrite starts over and keeps the old run."""
    settings = exact_settings(tmp_path, corpus_cache)
    settings["train"]["max_steps"] = 12
    config = write_config(tmp_path / "c.yaml", settings)
    run_dir = tmp_path / "runs/tiny"

    crashed = run_cli("run", str(config), "--set", "faults=[{kind: crash, step: 3}]")
    assert crashed.returncode == 70 and not (run_dir / "checkpoints/step_00000005").exists()
    assert run_cli("run", str(config)).returncode == 0  # checkpoints at 5, 10 and final 12

    restarted = run_cli("run", str(config), "--resume", "latest", LOSSGUARD_RESUME="step_00000005")
    assert restarted.returncode == 0, restarted.stderr
    resumed = [e for e in events(run_dir) if e["event"] == "resumed"]
    assert [(e["checkpoint"], e["source"]) for e in resumed] == [
        ("step_00000005", "LOSSGUARD_RESUME")
    ]
    assert "resumed from step_00000005 at step 5 (target 5 from $LOSSGUARD_RESUME)" in (
        restarted.stderr
    )
    by_name = run_cli("run", str(config), "--resume", "step_00000010")
    assert by_name.returncode == 0, by_name.stderr
    assert [e for e in events(run_dir) if e["event"] == "resumed"][-1]["step"] == 10

    over = run_cli("run", str(config), "--overwrite")
    assert over.returncode == 0, over.stderr
    (aside,) = run_dir.glob("overwritten-*")
    assert (aside / "checkpoints/step_00000010/meta.json").exists()
    assert [e["event"] for e in events(run_dir)][:2] == ["start", "overwritten"]


def test_rollback_under_torchrun_leaves_ranks_identical(tmp_path: Path, corpus_cache: Path) -> None:
    settings = exact_settings(tmp_path, corpus_cache)
    settings["train"]["batch_size"] = 16
    config = write_config(tmp_path / "c.yaml", settings)
    run_dir = tmp_path / "runs/tiny"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    agent = subprocess.Popen(
        [*torchrun, "-m", "lossguard.agent.cli", "run", str(config), "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    wait_for(lambda: has_checkpoint(run_dir, 10), 120, "checkpoint step 10")
    with client(run_dir) as ctl:
        paused = ctl.request("pause")
        result = ctl.request("rollback", {"target": 10})
        ctl.request("resume")
    _, stderr = agent.communicate(timeout=120)
    assert agent.returncode == 0, stderr[-3000:]
    assert paused["step"] >= 10 and result["to_step"] == 10
    ranks = result["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert [r["step"] for r in ranks] == [10, 10]
    saved = torch.load(run_dir / "checkpoints/step_00000010/state.pt", weights_only=True)
    expected = weights_digest_of(saved["state"]["model"])
    assert [r["weights"] for r in ranks] == [expected, expected]
    assert sorted(step_records(run_dir)) == list(range(1, STEPS + 1))


def weights_digest_of(state: dict[str, torch.Tensor]) -> str:
    """What ``weights_digest`` computes, from a saved state dict."""
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def test_rollback_to_last_good_goes_back_past_the_update_that_made_the_loss_spike(
    tmp_path: Path, corpus_cache: Path
) -> None:
    """The checkpoint of step 40 holds step 40's update, made at 1000x the learning rate: it is
    saved healthy (the loss it causes shows only at step 41), so ``last_good`` must mean the
    newest healthy checkpoint before the step ahead of the episode: step 20."""
    settings = sliced_settings(
        tmp_path / "runs",
        corpus_cache,
        train={"max_steps": 100_000, "log_every": 1, "eval_every": 10**6},
        checkpoint={"every": 20, "keep_last": 100},
        telemetry={"spikes": {"zscore": 25.0}},
        faults=[{"kind": "lr_scale", "step": 40, "duration": 50, "factor": 1000, "once": True}],
    )
    agent = start_agent(write_config(tmp_path / "c.yaml", settings))
    run_dir = tmp_path / "runs/tiny"
    try:
        spike = wait_for(
            lambda: next(
                (e for e in events(run_dir) if e["event"] == "spike" and e["signal"] == "loss"),
                None,
            ),
            120,
            "the loss spike",
        )
        assert spike["diagnosis"]["step"] == 41
        saved = run_dir / "checkpoints/step_00000040/meta.json"  # it may still be publishing
        meta = json.loads(wait_for(lambda: saved.exists() and saved.read_text(), 60, "step 40"))
        assert meta["healthy"] is True
        with client(run_dir) as ctl:
            result = ctl.request("rollback", {"target": "last_good"})
        assert result["to_step"] == 20 and result["checkpoint"] == "step_00000020"
    finally:
        agent.terminate()
        agent.wait(60)
