"""Level shifts and expected changes in real training: a loss that steps up with its gradients
unchanged (the ``loss_shift`` fault) is taken as a new level long before LossSpikeNotRecovering's
300 steps; a learning rate 1000 times too high is not; ``expect_change`` (lossguard-ctl, Guard)
re-bases the detectors at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lossguard.agent.config import Config, parse_config
from lossguard.agent.train.trainer import Trainer
from lossguard.common.control.client import ControlClient
from lossguard.common.exitcodes import EXIT_STOPPED
from tests.support.processes import ctl_cli, start_agent, stop_process, wait_for
from tests.support.runs import events, json_lines, sliced_settings, write_config

pytestmark = pytest.mark.live

# Small windows, so that a few seconds of training hold a whole episode.
SPIKES = {"window": 32, "min_history": 16, "recover_steps": 10, "level_shift_after": 40}
SHIFT_AT = 60
LOSS_SHIFT = {"kind": "loss_shift", "step": SHIFT_AT, "duration": 1_000_000, "amount": 3.0}


def settings(runs: Path, cache: Path, *faults: dict[str, Any], **train: Any) -> dict[str, Any]:
    return sliced_settings(
        runs,
        cache,
        train={"max_steps": 130, "log_every": 5, "eval_every": 100_000, **train},
        telemetry={"spikes": SPIKES},
        faults=list(faults),
    )


def config(tmp_path: Path, cache: Path, *faults: dict[str, Any], **train: Any) -> Config:
    return parse_config(settings(tmp_path / "runs", cache, *faults, **train))


def train_records(run_dir: Path) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in json_lines(run_dir / "metrics.jsonl") if r["kind"] == "train"}


def of_kind(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in events(run_dir) if e["event"] == kind]


def exported(trainer: Trainer, name: str, **labels: str) -> float | None:
    assert trainer.guard.telemetry is not None
    registry = trainer.guard.telemetry.metrics.registry
    return registry.get_sample_value(name, {"run_id": "tiny", "rank": "0", **labels})


def test_a_loss_that_steps_up_with_unchanged_gradients_is_a_level_shift(
    tmp_path: Path, corpus_cache: Path
) -> None:
    trainer = Trainer(config(tmp_path, corpus_cache, LOSS_SHIFT), progress=False)
    try:
        trainer.fit()
        shifts = exported(trainer, "lossguard_level_shifts_total", signal="loss")
        shift_step = exported(trainer, "lossguard_level_shift_step", signal="loss")
        duration = exported(trainer, "lossguard_spike_duration_steps", signal="loss")
    finally:
        trainer.close()
    run_dir = trainer.run_path
    (shift,) = of_kind(run_dir, "level_shift")
    declared = SHIFT_AT + SPIKES["level_shift_after"]  # the first interval with 40 steps of it
    assert (shift["signal"], shift["began"], shift["step"]) == ("loss", SHIFT_AT, declared)
    assert shift["level"] - shift["mean_before"] == pytest.approx(3.0, abs=0.6)
    assert shift["trend"] <= 0.25
    (spike,) = of_kind(run_dir, "spike")  # the episode it ended, and nothing since
    assert (spike["signal"], spike["diagnosis"]["step"]) == ("loss", SHIFT_AT)
    train = train_records(run_dir)
    assert all(train[s]["loss_spike_active"] for s in range(SHIFT_AT, declared, 5))
    assert not any(r["loss_spike_active"] for s, r in train.items() if s >= declared)
    assert train[declared]["loss_level_shifts_total"] == 1
    assert (shifts, shift_step, duration) == (1, SHIFT_AT, 0)
    assert min(r["train_loss"] for s, r in train.items() if s > SHIFT_AT) > 4  # still shifted


@pytest.mark.parametrize("duration", [1, 1_000_000])
def test_a_learning_rate_1000_times_too_high_is_no_level_shift(
    tmp_path: Path, corpus_cache: Path, duration: int
) -> None:
    """The demo's divergence (and a single such step): the loss jumps and then falls, but the
    gradient norm jumps with it, so the episode stays open for LossSpikeNotRecovering."""
    fault = {"kind": "lr_scale", "step": SHIFT_AT, "duration": duration, "factor": 1000.0}
    trainer = Trainer(config(tmp_path, corpus_cache, fault), progress=False)
    try:
        trainer.fit()
    finally:
        trainer.close()
    run_dir = trainer.run_path
    assert of_kind(run_dir, "level_shift") == []
    last = train_records(run_dir)[130]
    assert last["loss_spike_active"] and last["loss_level_shifts_total"] == 0
    assert last["grad_norm_spikes_total"] >= 1
    assert {e["signal"] for e in of_kind(run_dir, "spike")} == {"loss", "grad_norm"}


def test_expect_change_from_lossguard_ctl_rebases_a_live_run(
    tmp_path: Path, corpus_cache: Path
) -> None:
    """The operator's word ends the episode at once (level_shift_after is far off here)."""
    run_dir = tmp_path / "runs/tiny"
    spikes = {**SPIKES, "level_shift_after": 250}
    live = settings(tmp_path / "runs", corpus_cache, LOSS_SHIFT, max_steps=1_000_000, log_every=1)
    live["telemetry"]["spikes"] = spikes
    agent = start_agent(write_config(tmp_path / "c.yaml", live))
    try:
        wait_for(
            lambda: any(r["loss_spike_active"] for r in train_records(run_dir).values()),
            120,
            "the loss episode",
        )
        argv = ["--run-dir", str(run_dir), "expect-change", "--reason", "data mix v2"]
        done = ctl_cli(*argv)
        assert done.returncode == 0, done.stderr
        step = int(done.stdout.split()[4].rstrip(":"))
        assert done.stdout == (
            f"change expected at step {step}: the spike detectors start again from the "
            "current level\n"
        )
        after = wait_for(
            lambda: train_records(run_dir).get(step + 20), 120, "20 steps after the command"
        )
        with ControlClient(socket_path=run_dir / "control.sock", timeout=60) as ctl:
            ctl.request("stop")
        assert agent.wait(60) == EXIT_STOPPED
    finally:
        stop_process(agent)
    (expected,) = of_kind(run_dir, "expected_change")
    who = (expected["step"], expected["by"], expected["reason"])
    assert who == (step, "control", "data mix v2")
    (command,) = [e for e in of_kind(run_dir, "command") if e["cmd"] == "expect_change"]
    assert command["id"] == expected["id"] and command["id"].startswith("ctl-")
    assert (command["ok"], command["result"]) == (True, {"step": step})
    train = train_records(run_dir)
    assert train[step]["loss_spike_active"]  # the episode, until the command
    first = train[step + 1]  # both windows emptied: nothing is scored until they refill
    assert not first["loss_spike_active"] and first["loss_zscore"] == 0
    assert first["grad_norm_zscore"] == 0
    assert not any(train[s]["loss_spike_active"] for s in range(step + 1, step + 21))
    assert after["loss_zscore"] != 0 and after["loss_spikes_total"] == 1  # scored again
    assert of_kind(run_dir, "level_shift") == []


def test_guard_expect_change_rebases_the_detectors_and_audits_it(
    tmp_path: Path, corpus_cache: Path
) -> None:
    trainer = Trainer(config(tmp_path, corpus_cache, LOSS_SHIFT), progress=False)
    guard = trainer.guard
    try:
        while guard.step < SHIFT_AT + 10:
            trainer.train_step()
        assert guard.telemetry is not None
        detectors = guard.telemetry.detectors
        assert detectors["loss"].stats_dict()["active"] == 1
        with pytest.raises(ValueError, match="printable text on one line"):
            guard.expect_change("two\nlines")
        assert guard.expect_change("data mix v2") == {"step": SHIFT_AT + 10}
        for detector in detectors.values():
            assert detector.stats_dict()["active"] == 0
            assert detector.state_dict()["count"] == 0
        trainer.fit()
    finally:
        trainer.close()
    run_dir = trainer.run_path
    (expected,) = of_kind(run_dir, "expected_change")
    assert (expected["step"], expected["reason"], expected["by"]) == (70, "data mix v2", "api")
    assert "id" not in expected
    train = train_records(run_dir)
    assert not any(r["loss_spike_active"] for s, r in train.items() if s > SHIFT_AT + 10)
    assert train[130]["loss_spikes_total"] == 1  # the new level opened no episode
    assert of_kind(run_dir, "level_shift") == []
