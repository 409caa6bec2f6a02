"""What the framework callbacks share (agent/integrations/adapter.py), without a framework: the
input ids found in batches, and the settings a callback refuses with a one-line reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lossguard.agent.config import parse_config
from lossguard.agent.integrations.adapter import (
    FrameworkRun,
    batch_inputs,
    framework_wandb_conflict,
    token_ids,
)
from lossguard.common.rundir.supervisor_file import RESUME_ENV


def test_the_input_ids_are_found_in_the_batch() -> None:
    ids = torch.zeros(4, 16, dtype=torch.long)
    assert batch_inputs({"input_ids": ids, "labels": ids}) is ids
    assert batch_inputs(ids) is ids
    assert batch_inputs([ids, torch.zeros(4)]) is ids
    assert batch_inputs({"pixels": ids}) is None
    assert batch_inputs([]) is None
    assert token_ids(ids) is ids  # ids feed the diagnosis's token statistics
    assert token_ids(torch.zeros(4, 3)) is None and token_ids(None) is None  # features do not


def start(run_dir: Path, **options: object) -> FrameworkRun:
    model = nn.Linear(2, 1)
    arguments: dict[str, object] = {
        "framework": "Frame",
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "scheduler": None,
        "config": None,
        "max_steps": 10,
        "global_step": 0,
        **options,
    }
    return FrameworkRun.start(run_dir, **arguments)  # type: ignore[arg-type]


def test_bad_settings_are_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=r"^tokens_per_step: must be >= 1 or None, not 0$"):
        start(tmp_path / "a", tokens_per_step=0)
    monkeypatch.setenv(RESUME_ENV, "latest")
    with pytest.raises(ValueError, match=rf"^\${RESUME_ENV} is set: under Frame, resume with"):
        start(tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    config = parse_config({"wandb": {"enabled": True}})
    with pytest.raises(ValueError, match=r"^wandb.enabled: Frame already logs to W&B"):
        framework_wandb_conflict("Frame", config)
    framework_wandb_conflict("Frame", parse_config({}))  # lossguard's W&B off: no conflict


def test_a_step_hands_guard_the_input_ids_of_its_micro_batches(tmp_path: Path) -> None:
    config = parse_config({"telemetry": {"host": "127.0.0.1", "port": 0}})
    run = start(tmp_path / "run", config=config)
    try:
        loss = run.guard.model(torch.ones(1, 2)).sum()
        loss.backward()
        run.micro_batch(loss, 2, summed=True, inputs=torch.tensor([[3, 1]]))
        run.micro_batch(loss, 2, summed=True, inputs=torch.tensor([[1, 2]]))
        run.micro_batch(loss, 2, summed=True, inputs=torch.zeros(1, 2))  # features: left out
        run.optimizer_step()
        assert run.guard.log.tokens is not None
        assert run.guard.log.tokens.read(1) == {1: pytest.approx((1.5, 0.75))}
    finally:
        run.guard.close()
