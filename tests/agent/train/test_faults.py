"""Fault injection's replay semantics: a fault comes back whenever a rollback replays its
steps, unless it is marked ``once`` (a transient fault); a slow save holds a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lossguard.agent.config import FaultConfig, parse_config
from lossguard.agent.train.faults import FaultInjector, check_fault_ranks
from lossguard.common.config import ConfigError
from tests.support.processes import run_cli
from tests.support.runs import sliced_settings, write_config

pytestmark = pytest.mark.live


def test_a_once_fault_spares_the_replay_and_a_plain_one_recurs() -> None:
    model = torch.nn.Linear(2, 2)
    recorded: list[tuple[str, int]] = []
    injector = FaultInjector(
        [
            FaultConfig(kind="nonfinite_loss", step=5, duration=2, once=True),
            FaultConfig(kind="lr_scale", step=6),
        ],
        seed=0,
        vocab_size=8,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        event=lambda _event, **fault: recorded.append((fault["kind"], fault["step"])),
    )

    def active(step: int) -> set[str]:
        injector.before_step(step)
        return set(injector.active)

    assert [active(s) for s in (4, 5, 6, 7)] == [
        set(),
        {"nonfinite_loss"},
        {"nonfinite_loss", "lr_scale"},
        set(),
    ]
    # a rollback to step 3 replays 4..7: the transient NaN stays away, the lr fault recurs
    assert [active(s) for s in (4, 5, 6, 7)] == [set(), set(), {"lr_scale"}, set()]
    assert recorded == [("nonfinite_loss", 5), ("lr_scale", 6), ("lr_scale", 6)]
    loss = torch.tensor(1.0)
    injector.before_step(8)
    assert torch.equal(injector.loss(loss), loss)


def test_a_fault_for_one_rank_perturbs_only_it_and_is_audited_by_rank_0() -> None:
    model = torch.nn.Linear(2, 2)
    recorded: list[dict[str, Any]] = []
    nan = FaultConfig(kind="nonfinite_loss", step=3, ranks=[1])
    injectors = [
        FaultInjector(
            [nan],
            seed=0,
            vocab_size=8,
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            event=lambda _event, **fault: recorded.append(fault),
            rank=rank,
        )
        for rank in (0, 1)
    ]
    loss = torch.tensor(1.0)
    for injector in injectors:
        injector.before_step(3)
    assert torch.equal(injectors[0].loss(loss), loss)
    assert torch.isnan(injectors[1].loss(loss))
    assert [fault["ranks"] for fault in recorded] == [[1], [1]]  # rank 0's is the audited one


def test_a_fault_for_a_rank_the_run_lacks_is_refused_in_one_line() -> None:
    cfg = parse_config({"faults": [{"kind": "crash", "step": 1, "ranks": [0, 3]}]})
    check_fault_ranks(cfg, 4)
    with pytest.raises(ConfigError) as refused:
        check_fault_ranks(cfg, 2)
    assert str(refused.value) == "faults[0].ranks: rank 3 is not in this run of 2 ranks"


def test_slow_save_holds_a_synchronous_checkpoint_and_only_it(
    tmp_path: Path, corpus_cache: Path
) -> None:
    settings = sliced_settings(
        tmp_path / "runs",
        corpus_cache,
        train={"max_steps": 30, "log_every": 1, "eval_every": 1000},
        checkpoint={"every": 10, "async": False},
        faults=[{"kind": "slow_save", "step": 20, "seconds": 2.0}],
    )
    done = run_cli("run", str(write_config(tmp_path / "c.yaml", settings)), "--no-progress")
    assert done.returncode == 0, done.stderr
    times = {r["step"]: r["time"] for r in step_records_with_time(tmp_path / "runs/tiny")}
    assert times[21] - times[20] >= 2.0  # the save of step 20 held the loop
    assert times[11] - times[10] < 2.0  # the save of step 10 did not
    assert (tmp_path / "runs/tiny/checkpoints/step_00000020/meta.json").exists()


def step_records_with_time(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]
