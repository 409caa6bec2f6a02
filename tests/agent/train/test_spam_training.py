"""SPAM (``optim.name: spam``) in the built-in trainer and under the Guard: resumed mid-run it
trains on bit for bit, across a momentum reset; its resets and clipped entries are counters
that an AdamW run does not have."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import generate_latest
from torch import nn

from lossguard.agent import Guard
from lossguard.agent.config import parse_config
from lossguard.agent.train.spam import SPAM
from lossguard.agent.train.trainer import Trainer
from tests.agent.telemetry.test_live_metrics import promtool_findings
from tests.support.runs import sliced_settings, step_records

pytestmark = pytest.mark.live

STEPS = 16
RESUME_AT = 7  # in the warm-up after the reset at step 6; the next reset (12) comes after it


def spam_settings(runs: Path, cache: Path, run_id: str) -> dict[str, Any]:
    return sliced_settings(
        runs,
        cache,
        run={"id": run_id},
        model={"dropout": 0.1},  # the RNG states matter
        train={"max_steps": STEPS, "log_every": 1, "eval_every": 1000},
        optim={
            "name": "spam",
            "reset_every": 6,
            "reset_warmup": 3,
            "clip_after": 2,
            "threshold": 4,
        },
        checkpoint={"every": RESUME_AT, "keep_last": 100},
    )


def fit(settings: dict[str, Any], resume: int | None = None) -> Trainer:
    trainer = Trainer(parse_config(settings), progress=False, resume=resume)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer


def last_train_record(run_dir: Path) -> dict[str, Any]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"][-1]


def test_a_resumed_spam_run_trains_on_bit_for_bit(tmp_path: Path, corpus_cache: Path) -> None:
    runs = tmp_path / "runs"
    whole = fit(spam_settings(runs, corpus_cache, "whole"))
    assert isinstance(whole.optimizer, SPAM)
    record = last_train_record(runs / "whole")
    assert record["optimizer_momentum_resets"] == 2  # steps 6 and 12
    assert record["optimizer_clipped_entries"] > 0

    resumed_dir = runs / "resumed"
    shutil.copytree(runs / "whole/checkpoints", resumed_dir / "checkpoints")
    shutil.copy(runs / "whole/config.yaml", resumed_dir / "config.yaml")
    resumed = fit(spam_settings(runs, corpus_cache, "resumed"), resume=RESUME_AT)
    expected = {s: v for s, v in step_records(runs / "whole").items() if s > RESUME_AT}
    assert step_records(resumed_dir) == expected  # every step's loss, bit for bit
    assert last_train_record(resumed_dir)["optimizer_momentum_resets"] == 1  # step 12
    for a, b in zip(whole.raw_model.parameters(), resumed.raw_model.parameters(), strict=True):
        assert torch.equal(a, b)


def guarded_regression(run_dir: Path, optimizer: str) -> Guard:
    """A linear regression under the Guard, 60 steps; step 45's batch is 1000x larger."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    if optimizer == "spam":
        opt: torch.optim.Optimizer = SPAM(model.parameters(), lr=1e-2, reset_every=20, clip_after=2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    cfg = parse_config({"telemetry": {"host": "127.0.0.1", "port": 0}, "snapshot": {"every": None}})
    generator = torch.Generator().manual_seed(1)
    with Guard(run_dir, model=model, optimizer=opt, config=cfg, progress=False) as guard:
        for step in range(1, 61):
            x = torch.randn(16, 8, generator=generator) * (1000 if step == 45 else 1)
            loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            loss.backward()
            guard.after_backward(loss, tokens=16)
            opt.step()
            opt.zero_grad()
            guard.end_step()
            guard.poll()
    return guard


def test_resets_and_clipped_entries_are_counters_only_for_spam(tmp_path: Path) -> None:
    spam = guarded_regression(tmp_path / "spam", "spam")
    adamw = guarded_regression(tmp_path / "adamw", "adamw")
    for guard, run_id in ((spam, "spam"), (adamw, "adamw")):
        assert guard.telemetry is not None
        registry = guard.telemetry.metrics.registry
        labels = {"run_id": run_id, "rank": "0"}
        resets = registry.get_sample_value("lossguard_optimizer_momentum_resets_total", labels)
        clipped = registry.get_sample_value("lossguard_optimizer_clipped_entries_total", labels)
        record = last_train_record(tmp_path / run_id)
        if run_id == "adamw":  # absent, not zero
            assert resets is None and clipped is None
            assert "optimizer_momentum_resets" not in record
            continue
        assert promtool_findings(generate_latest(registry).decode()) == ""
        assert isinstance(guard.optimizer, SPAM)
        totals = guard.optimizer.metric_totals.tolist()
        assert resets == totals[0] == 3  # steps 20, 40 and 60
        assert clipped == totals[1] == record["optimizer_clipped_entries"]
        assert clipped is not None and clipped >= 1  # step 45's spike
