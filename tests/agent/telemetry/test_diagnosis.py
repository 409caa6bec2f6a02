"""Spike diagnoses, the last non-finite step and rollbacks that skip the abandoned batches: the
rules on their own, then a live training run with a NaN that a rollback leaves behind."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

from lossguard.agent import Guard
from lossguard.agent.config import parse_config
from lossguard.agent.telemetry.diagnosis import IntervalContext, diagnose
from lossguard.common.control.client import ControlClient, ControlError
from lossguard.common.control.protocol import ProtocolError, validate_args
from lossguard.common.exitcodes import EXIT_STOPPED
from tests.support.processes import ctl_cli, start_agent, wait_for
from tests.support.runs import events, sliced_settings, write_config

pytestmark = pytest.mark.live

INF = float("inf")


def context(**changes: Any) -> IntervalContext:
    """A quiet interval (steps 100..110, one data position per step) unless changed."""
    fields: dict[str, Any] = {
        "step": 110,
        "lr": 1e-3,
        "lr_before": 1e-3,
        "loss_scale": None,
        "loss_scale_before": None,
        "loss_scale_low": None,
        "fp16_unscaled": False,
        "grad_norm_max": 1.0,
        "fp8_overflow": None,
        "fp8_overflow_high": None,
        "scheduled": True,
        "lr_departure": None,
        "start_step": 100,
        "start_position": 500,
        "end_position": 510,
    }
    return IntervalContext(**{**fields, **changes})


def stats(**signals: dict[str, float]) -> dict[str, dict[str, float]]:
    """Detector statistics by signal: nothing seen, a window at mean 2 (std 0.1) and grad
    norms at mean 1, except as given."""
    quiet = {"nonfinite_step": -1.0, "mean": 2.0, "std": 0.1, "spike_step": -1.0}
    quiet.update(spike_value=-INF, spike_mean=-INF, spike_std=-INF)
    base = {"loss": dict(quiet), "grad_norm": {**quiet, "mean": 1.0}}
    for name, values in signals.items():
        base[name].update(values)
    return base


def test_a_nan_with_nothing_else_going_on_points_at_the_data() -> None:
    seen = stats(loss={"nonfinite_step": 105.0}, grad_norm={"nonfinite_step": 105.0})
    diagnosis = diagnose("loss", nonfinite=True, stats=seen, context=context())
    assert diagnosis == {
        "signal": "loss",
        "step": 105,
        "nonfinite": True,
        "value": None,
        "zscore": None,
        "window_mean": 2.0,
        "window_std": 0.1,
        "grad_norm": None,  # it was not finite either
        "grad_norm_ratio": None,
        "lr": 1e-3,
        "lr_before": 1e-3,
        "lr_ratio": 1.0,
        "loss_scale": None,
        "fp8_overflow_ratio": None,
        "data_position": 504,  # step 101 took position 500
        "batch_tokens": None,  # the loop did not pass its input ids
        "causes": [
            "nothing stands out (learning rate on schedule, no gradient-norm or precision "
            "change): the non-finite value arose in the forward or backward pass of the batch "
            "at data position 504"
        ],
    }
    json.dumps(diagnosis, allow_nan=False)  # JSON as it is


def test_a_spike_after_an_lr_rise_with_a_gradient_burst() -> None:
    seen = stats(
        loss={"spike_step": 107.0, "spike_value": 9.0, "spike_mean": 2.0, "spike_std": 0.5},
        grad_norm={"spike_step": 107.0, "spike_value": 12.0, "spike_mean": 1.0},
    )
    unscheduled = context(lr=3e-3, scheduled=False)  # a loop without a scheduler
    diagnosis = diagnose("loss", nonfinite=False, stats=seen, context=unscheduled)
    assert (diagnosis["step"], diagnosis["value"], diagnosis["zscore"]) == (107, 9.0, 14.0)
    assert (diagnosis["window_mean"], diagnosis["window_std"]) == (2.0, 0.5)
    assert (diagnosis["grad_norm"], diagnosis["grad_norm_ratio"]) == (12.0, 12.0)
    assert diagnosis["lr_ratio"] == pytest.approx(3.0)
    assert diagnosis["causes"] == [
        "learning rate rose 3.0x since the previous interval",
        "gradient norm 12x its window mean",
    ]


def test_the_learning_rate_is_judged_against_its_schedule() -> None:
    seen = stats(loss={"spike_step": 107.0, "spike_value": 9.0, "spike_mean": 2.0})
    warmup = context(lr=3e-3)  # the schedule tripled it (warm-up): no departure, no cause
    assert diagnose("loss", nonfinite=False, stats=seen, context=warmup)["causes"][0].startswith(
        "nothing stands out (learning rate on schedule"
    )
    jumped = context(lr_departure=(100, 100, 1.0, 1e-3))  # x1000 at step 100, back since
    assert diagnose("loss", nonfinite=False, stats=seen, context=jumped)["causes"] == [
        "learning rate 1000x its schedule at step 100 (1 instead of 0.001)"
    ]
    # named by where the departure began, long before the spike: from step 2 on to now (110)
    ongoing = context(lr_departure=(2, 110, 1.0, 1e-3))
    assert diagnose("loss", nonfinite=False, stats=seen, context=ongoing)["causes"] == [
        "learning rate 1000x its schedule from step 2 on (1 instead of 0.001 at 2)"
    ]
    ended = context(lr_departure=(2, 50, 1.0, 1e-3))
    assert diagnose("loss", nonfinite=False, stats=seen, context=ended)["causes"] == [
        "learning rate 1000x its schedule from step 2 to 50 (1 instead of 0.001 at 2)"
    ]
    later = context(lr_departure=(108, 110, 1.0, 1e-3))  # it began after the spike (107)
    assert (
        "nothing stands out"
        in diagnose("loss", nonfinite=False, stats=seen, context=later)["causes"][0]
    )
    long_ago = context(lr_departure=(2, 2, 1.0, 1e-3))  # ended over LR_HORIZON steps before
    assert (
        "nothing stands out"
        in diagnose("loss", nonfinite=False, stats=seen, context=long_ago)["causes"][0]
    )


def test_precision_causes() -> None:
    seen = stats(loss={"nonfinite_step": 103.0})
    fp8 = context(fp8_overflow=("grad_output", 0.125), fp8_overflow_high=0.0)
    assert diagnose("loss", nonfinite=True, stats=seen, context=fp8)["causes"] == [
        "FP8 overflow in 12% of values (grad_output)"
    ]
    usual = context(fp8_overflow=("grad_output", 0.125), fp8_overflow_high=0.1)
    assert (
        "nothing stands out"
        in diagnose("loss", nonfinite=True, stats=seen, context=usual)["causes"][0]
    )  # no more overflow than the run has had before (its highest): its own normal
    fp16 = context(loss_scale=1024.0, loss_scale_before=65536.0)  # the first intervals
    diagnosis = diagnose("loss", nonfinite=True, stats=seen, context=fp16)
    assert diagnosis["loss_scale"] == 1024.0
    assert diagnosis["causes"] == ["fp16 loss scale fell from 65536 to 1024 (gradient overflow)"]
    routine = context(loss_scale=32768.0, loss_scale_before=65536.0, loss_scale_low=32768.0)
    assert (
        "nothing stands out"
        in diagnose("loss", nonfinite=True, stats=seen, context=routine)["causes"][0]
    )  # the scaler backing off to where it has been before: its own normal
    lower = context(loss_scale=8192.0, loss_scale_before=65536.0, loss_scale_low=32768.0)
    assert diagnose("loss", nonfinite=True, stats=seen, context=lower)["causes"] == [
        "fp16 loss scale fell from 65536 to 8192 (gradient overflow), below its lowest of the "
        "run so far (32768)"
    ]
    unscaled = context(fp16_unscaled=True)
    assert diagnose("loss", nonfinite=True, stats=seen, context=unscaled)["causes"] == [
        "fp16 training without loss scaling (no GradScaler)"
    ]


def test_a_spike_with_no_other_change_and_unknowns() -> None:
    seen = stats(loss={"spike_step": 104.0, "spike_value": 3.0, "spike_mean": 2.0})
    seen["loss"]["spike_std"] = 0.0  # a flat window: no z-score
    quiet = context(lr_before=None, grad_norm_max=INF, start_position=None)
    diagnosis = diagnose("loss", nonfinite=False, stats=seen, context=quiet)
    assert diagnosis["zscore"] is None and diagnosis["lr_ratio"] is None
    assert diagnosis["grad_norm"] is None and diagnosis["data_position"] == 510  # the end's
    assert diagnosis["causes"] == [
        "nothing stands out (learning rate on schedule, no gradient-norm or precision "
        "change): the batch at data position 510 is what is left to check"
    ]


def test_skip_batches_is_a_count_or_abandoned() -> None:
    assert validate_args("rollback", {"skip_batches": "abandoned"})["skip_batches"] == "abandoned"
    assert validate_args("rollback", {"skip_batches": 7})["skip_batches"] == 7
    assert validate_args("rollback", {})["skip_batches"] == 0
    for bad in (-1, "7", "all", True, 1.5, None):
        with pytest.raises(ProtocolError, match="skip_batches") as refused:
            validate_args("rollback", {"skip_batches": bad})
        assert refused.value.code.value == "bad_request"


# ------------------------------------------------------------------ a live run


NAN_STEP = 13


class NanRun:
    """A training process that hits one NaN loss at step 13 (not on replay), checkpointing
    every 5 steps and logging every step; from the NaN on a step takes a second, so that the
    rollback comes before a healthy checkpoint after it (the update was skipped: the run is
    healthy again once the episode ends)."""

    def __init__(self, tmp_path: Path, cache: Path) -> None:
        settings = sliced_settings(
            tmp_path / "runs",
            cache,
            train={"max_steps": 1_000_000, "log_every": 1, "eval_every": 1_000_000},
            checkpoint={"every": 5, "async": False},
            faults=[
                {"kind": "nonfinite_loss", "step": NAN_STEP, "duration": 1, "once": True},
                {"kind": "slow_step", "step": NAN_STEP, "duration": 10**6, "seconds": 1.0},
            ],
        )
        self.run_dir = tmp_path / "runs/tiny"
        self.process = start_agent(write_config(tmp_path / "c.yaml", settings))

    def request(self, cmd: str, args: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        with ControlClient(socket_path=self.run_dir / "control.sock", timeout=60) as client:
            return client.request(cmd, args, **kw)

    def nonfinite_step(self) -> dict[str, float]:
        """The scraped ``lossguard_nonfinite_step`` by signal."""
        url = json.loads((self.run_dir / "agent.json").read_text())["metrics_url"]
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        return {
            sample.labels["signal"]: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "lossguard_nonfinite_step"
        }

    def train_records(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [r for r in map(json.loads, lines) if r["kind"] == "train"]


@pytest.fixture
def nan_run(tmp_path: Path, corpus_cache: Path) -> Iterator[NanRun]:
    run = NanRun(tmp_path, corpus_cache)
    try:
        yield run
    finally:
        if run.process.poll() is None:
            run.process.kill()
        run.process.communicate()


def started(run: NanRun) -> bool:
    return (run.run_dir / "agent.json").exists() and (run.run_dir / "control.sock").exists()


def test_rollback_leaves_the_nan_behind_and_skips_exactly_its_batches(nan_run: NanRun) -> None:
    wait_for(lambda: started(nan_run), 120, "the agent to start")
    assert nan_run.nonfinite_step() == {"loss": -1.0, "grad_norm": -1.0}  # from the start
    seen = wait_for(
        lambda: (s := nan_run.nonfinite_step())["loss"] >= 0 and s, 120, "the NaN to be exported"
    )
    assert seen == {"loss": NAN_STEP, "grad_norm": NAN_STEP}
    records = {r["step"]: r for r in nan_run.train_records()}
    assert records[NAN_STEP]["loss_nonfinite_step"] == NAN_STEP
    assert records[NAN_STEP - 1]["loss_nonfinite_step"] == -1

    episode = nan_run.request("status")["episode"]
    assert episode["signal"] == "loss" and episode["step"] == NAN_STEP
    assert episode["nonfinite"] is True and episode["value"] is None
    assert episode["data_position"] == NAN_STEP - 1  # step 1 took position 0
    audit = [e for e in events(nan_run.run_dir) if e["event"] == "nonfinite"]
    assert [e["diagnosis"]["step"] for e in audit] == [NAN_STEP, NAN_STEP]  # loss, grad norm

    back = ctl_cli(
        "--run-dir",
        str(nan_run.run_dir),
        "--json",
        "rollback",
        "last_good",
        "--skip-batches",
        "abandoned",
        "--lr-scale",
        "0.5",
    )
    assert back.returncode == 0, back.stderr
    result = json.loads(back.stdout)
    from_step = result["from_step"]
    assert from_step > NAN_STEP
    assert (result["to_step"], result["checkpoint"]) == (10, "step_00000010")
    # the data position then was from_step (one per step), the restored one 10
    assert result["skipped_batches"] == from_step - 10
    assert result["lr_scale"] == 0.5
    abandoned = result["abandoned"]
    assert {k: abandoned[k] for k in ("signal", "step", "nonfinite", "value")} == {
        "signal": "loss",
        "step": NAN_STEP,
        "nonfinite": True,
        "value": None,
    }
    assert {"zscore", "window_mean", "window_std", "grad_norm_ratio", "lr_ratio"} <= set(abandoned)
    assert abandoned["causes"] == [  # the nonfinite_loss drill, in warm-up: not the lr
        "nothing stands out (learning rate on schedule, no gradient-norm or precision change): "
        "the non-finite value arose in the forward or backward pass of the batch at data "
        f"position {NAN_STEP - 1}"
    ]

    # at once: the restored detectors never saw the NaN, so LossNonFinite resolves
    assert nan_run.nonfinite_step() == {"loss": -1.0, "grad_norm": -1.0}
    assert nan_run.request("status")["episode"] is None

    # the replay goes on from the first batch after the abandoned ones, and the NaN
    # (a transient fault) stays behind
    def replayed() -> list[dict[str, Any]]:
        rolled = [r for r in nan_run.train_records() if r["step"] <= from_step]
        after = rolled[[r["step"] for r in rolled].index(from_step) + 1 :]
        return after if any(r["step"] > NAN_STEP for r in after) else []

    after = wait_for(replayed, 120, "the replay past the NaN's step")
    assert after[0]["step"] == 11 and after[0]["data_position"] == from_step + 1
    assert all(r["data_position"] == from_step + r["step"] - 10 for r in after)
    assert all(r["loss_nonfinite_step"] == -1 for r in after)
    assert nan_run.nonfinite_step()["loss"] == -1

    # the same request id is answered from the first result, never applied twice
    commands = [e for e in events(nan_run.run_dir) if e["event"] == "command"]
    rollback = next(c for c in commands if c["cmd"] == "rollback")
    assert rollback["args"] == {"target": "last_good", "skip_batches": "abandoned", "lr_scale": 0.5}
    again = nan_run.request("rollback", rollback["args"], request_id=rollback["id"])
    assert again == json.loads(json.dumps(result))
    assert len([e for e in events(nan_run.run_dir) if e["event"] == "rollback"]) == 1

    nan_run.request("stop")
    nan_run.process.communicate(timeout=60)
    assert nan_run.process.returncode == EXIT_STOPPED


def test_abandoned_needs_data_that_knows_its_position(tmp_path: Path) -> None:
    """A user loop whose data cannot say which batches the abandoned steps used."""

    class Skippable:
        def __init__(self) -> None:
            self.skipped = 0

        def skip(self, n: int) -> None:
            self.skipped += n

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = parse_config(
        {
            "telemetry": {"host": "127.0.0.1", "port": 0},
            "train": {"max_steps": 10, "log_every": 5},
            "checkpoint": {"every": 5, "save_on_exit": False, "async": False},
        }
    )
    data = Skippable()
    with Guard(tmp_path, model=model, optimizer=opt, data=data, config=cfg, progress=False) as g:
        x = torch.randn(8, 4)
        for _ in range(8):
            model(x).pow(2).mean().backward()
            g.after_backward(model(x).pow(2).mean(), tokens=8)
            opt.step()
            opt.zero_grad()
            g.end_step()
            g.poll()
        socket_path = tmp_path / "control.sock"
        with (
            ControlClient(socket_path=socket_path, timeout=60) as client,
            ThreadPoolExecutor(1) as pool,
        ):
            sent = pool.submit(client.request, "rollback", {"skip_batches": "abandoned"})

            def applied() -> bool:
                g.poll()  # the loop applies the command at its next step boundary
                return sent.done()

            wait_for(applied, 60, "the rollback's reply")
            with pytest.raises(ControlError) as refused:
                sent.result()
        assert refused.value.code == "bad_request"
        assert "position" in refused.value.message
        assert g.step == 8 and data.skipped == 0  # nothing was restored or skipped

        data.batches_per_step = 2  # type: ignore[attr-defined]
        result = g.rollback(5, skip_batches="abandoned", lr_scale=1.0)
        assert (result["to_step"], result["skipped_batches"]) == (5, 6)
        assert data.skipped == 6 and result["abandoned"] is None  # nothing went wrong
