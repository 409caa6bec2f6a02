"""A rollback that finds nothing to go back to is an outcome of its own: a real agent without
snapshots or checkpoints answers the monitor's rollback ``not_found``; the action is recorded as
``nothing_to_restore`` with what the run does now, said in words, with the commands that help."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import torch
from torch import nn

from lossguard.agent import Guard
from lossguard.agent.config import parse_config
from lossguard.monitor.actions.describe import describe
from lossguard.monitor.actions.endpoints import Endpoints
from lossguard.monitor.actions.model import ActionRecord
from lossguard.monitor.actions.next_steps import next_steps
from lossguard.monitor.actions.runner import ActionRunner
from tests.monitor.actions.test_engine import Pipeline, alert


class Batches:
    """A data position that a rollback can skip forward (what the monitor's rollback asks)."""

    def __init__(self) -> None:
        self.position = 0

    def skip(self, count: int) -> None:
        self.position += count

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def test_a_rollback_with_nothing_to_restore_says_so_and_what_helps(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    cfg = parse_config(
        {
            "telemetry": {"host": "127.0.0.1", "port": 0},  # discovery lists its metrics URL
            "snapshot": {"every": None},
            "checkpoint": {"every_seconds": None, "save_on_exit": False},
        }
    )
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    data = Batches()
    guard = Guard(runs / "r1", model=model, optimizer=opt, data=data, config=cfg, progress=False)
    stop = threading.Event()

    def train() -> None:
        x = torch.randn(8, 4)
        while not stop.is_set():
            data.position += 1
            model(x).pow(2).mean().backward()
            guard.after_backward(torch.tensor(1.0), tokens=8)
            opt.step()
            opt.zero_grad()
            guard.end_step()
            guard.poll()

    loop = threading.Thread(target=train)
    loop.start()
    pipeline = Pipeline(tmp_path)
    done: list[ActionRecord] = []
    try:
        now = time.time()
        [record] = pipeline.plan(alert(starts_at=now), at=now)
        runner = ActionRunner(
            pipeline.store,
            Endpoints(pipeline.config, runs, timeout_s=10.0),
            retry_for_s=3600.0,
            observe=lambda kind, result: pipeline.observed.append((kind, result)),
            on_done=done.append,
        )
        assert runner.send(record) is None
    finally:
        stop.set()
        loop.join(timeout=30)
        guard.close()
    [outcome] = done
    assert outcome.state == "nothing_to_restore"
    assert "no checkpoint matches target 'last_good'" in outcome.reason
    assert outcome.result["run_id"] == "r1" and outcome.result["paused"] is False
    text = describe(outcome)
    assert re.fullmatch(
        r"nothing to roll back to: no healthy state \(in-memory snapshot or checkpoint\) "
        r"exists, so the run was left as it is; it is at step \d+, training on"
        r"(, last train loss \S+)?",
        text,
    ), text
    ctl = f"lossguard-ctl --run-dir {runs / 'r1'}"
    steps = next_steps(
        "r1", [outcome], ctl_target=["--run-dir", str(runs / "r1")], config_path=None
    )
    assert steps[1:4] == (
        f"if the run looks healthy, save its state now: {ctl} save",
        f"or hold it where it is: {ctl} pause",
        f"or end it (it saves first): {ctl} stop",
    )
    assert pipeline.observed == [("rollback", "nothing_to_restore")]
