"""In-memory snapshots: retention, rollback targets over memory and disk, exact restores, the
memory budget, the listing, and the periodic checkpoint's time cadence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lossguard.agent import Guard
from lossguard.agent.checkpoint.snapshots import SnapshotStore
from lossguard.agent.config import Config, parse_config
from lossguard.common.control.protocol import Request
from lossguard.common.rundir.checkpoints import list_checkpoints
from lossguard.common.rundir.targets import listing
from tests.support.runs import events

LISTING = Request("t1", "checkpoints", {})


def config(**sections: dict[str, Any]) -> Config:
    return parse_config({"telemetry": {"host": "127.0.0.1", "port": 0}, **sections})


def make_guard(
    run_dir: Path, cfg: Config, device: str = "cpu"
) -> tuple[Guard, nn.Module, torch.optim.Optimizer]:
    """A seeded model with dropout (so the RNG states matter) and a fused AdamW."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 1))
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = Guard(run_dir, model=model, optimizer=opt, config=cfg, progress=False)
    return guard, model, opt


def train(
    guard: Guard, model: nn.Module, opt: torch.optim.Optimizer, steps: int, nan_at: int = -1
) -> list[float]:
    """``steps`` steps on fresh random batches (drawn from the torch RNG); their losses."""
    losses = []
    device = next(model.parameters()).device
    for _ in range(steps):
        x = torch.randn(16, 8, device=device)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        loss.backward()
        guard.after_backward(loss * float("nan") if guard.step + 1 == nan_at else loss, tokens=16)
        opt.step()
        opt.zero_grad()
        guard.end_step()
        guard.poll()
        losses.append(loss.item())
    return losses


def snapshot_metric(guard: Guard, name: str) -> float | None:
    assert guard.telemetry is not None
    labels = {"run_id": guard.run_id, "rank": "0"}
    return guard.telemetry.metrics.registry.get_sample_value(f"lossguard_{name}", labels)


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.gpu,
    ),  # pinned buffers and a side stream
]


@pytest.mark.parametrize("device", DEVICES)
def test_restore_from_memory_replays_like_one_from_disk(tmp_path: Path, device: str) -> None:
    cfg = config(
        train={"log_every": 5}, checkpoint={"every": 10}, snapshot={"every": 10, "keep": 2}
    )
    guard, model, opt = make_guard(tmp_path, cfg, device)
    with guard:
        first = train(guard, model, opt, 25)
        from_memory = guard.rollback(10, skip_batches=0, lr_scale=1.0)
        assert from_memory["checkpoint"] == "memory/step_00000010"
        assert train(guard, model, opt, 15) == first[10:]
        assert guard.recovery.snapshots is not None
        guard.recovery.snapshots.clear()
        from_disk = guard.rollback(10, skip_batches=0, lr_scale=1.0)
        assert from_disk["checkpoint"] == "step_00000010"
        assert train(guard, model, opt, 15) == first[10:]


def test_last_good_is_the_newest_healthy_state_in_memory_or_on_disk(tmp_path: Path) -> None:
    cfg = config(
        train={"log_every": 5},
        checkpoint={"every": 20},
        snapshot={"every": 5, "keep": 2},
        telemetry={"host": "127.0.0.1", "port": 0, "spikes": {"recover_steps": 50}},
    )
    guard, model, opt = make_guard(tmp_path, cfg)
    with guard:
        train(guard, model, opt, 12)
        assert guard.commands._checkpoints(LISTING, print)["last_good"] == "memory/step_00000010"
        train(guard, model, opt, 20, nan_at=14)  # later snapshots and checkpoints: unhealthy
        assert guard.checkpoints is not None and guard.recovery.snapshots is not None
        guard.checkpoints.wait()  # step 20's is written in the background: published once done
        kept = [(m.name, m.healthy) for m in guard.recovery.snapshots.list()]
        assert kept == [
            ("memory/step_00000010", True),
            ("memory/step_00000025", False),
            ("memory/step_00000030", False),
        ]
        listed = guard.commands._checkpoints(LISTING, print)
        assert listed["last_good"] == "memory/step_00000010"
        assert listed["latest"] == "memory/step_00000030"
        assert [(c["name"], c["in_memory"]) for c in listed["checkpoints"]] == [
            ("memory/step_00000010", True),
            ("step_00000015", False),  # the non-finite post-mortem
            ("step_00000020", False),
            ("memory/step_00000025", True),
            ("memory/step_00000030", True),
        ]
        labels = {"run_id": guard.run_id, "rank": "0", "kind": "last_good"}
        assert guard.telemetry is not None
        registry = guard.telemetry.metrics.registry
        assert registry.get_sample_value("lossguard_checkpoint_step", labels) == 10
        result = guard.rollback("last_good", skip_batches=0, lr_scale=0.5)
        assert (result["from_step"], result["to_step"]) == (32, 10)
        assert result["checkpoint"] == "memory/step_00000010"
        # the abandoned timeline is gone from memory and superseded on disk
        assert [m.name for m in guard.recovery.snapshots.list()] == ["memory/step_00000010"]
        disk = list_checkpoints(tmp_path / "checkpoints")
        assert [m.extra.get("superseded") for m in disk] == [True, True]
        train(guard, model, opt, 5)
        assert guard.step == 15


def test_rollbacks_to_one_state_compound_their_lr_scales(tmp_path: Path) -> None:
    """The monitor's attempts (lr_scale 1, then 0.5, 0.5: "later attempts halve it again")
    often go back to the same state, which predates them: each scales the lr in force."""
    cfg = config(train={"log_every": 5}, snapshot={"every": 10, "keep": 2})
    guard, model, opt = make_guard(tmp_path, cfg)
    with guard:
        train(guard, model, opt, 12)
        lr = opt.param_groups[0]["lr"]
        scales = []
        for attempt in (1.0, 0.5, 0.5):
            scales.append(guard.rollback(10, skip_batches=0, lr_scale=attempt)["lr_scale"])
            assert opt.param_groups[0]["lr"] == pytest.approx(lr * scales[-1])
            train(guard, model, opt, 2)
    assert scales == [1.0, 0.5, 0.25]


def test_store_keeps_the_newest_and_the_newest_healthy_and_hands_out_copies() -> None:
    store = SnapshotStore(keep=2, budget_bytes=10**6)
    weights = torch.zeros(4)
    for step, healthy in [(5, True), (10, False), (15, False), (20, False)]:
        weights.fill_(step)
        store.take(
            step,
            {"state": {"w": weights}},
            tokens=0,
            healthy=healthy,
            train_loss=None,
            val_loss=None,
        )
    assert [m.step for m in store.list()] == [5, 15, 20]
    payload = store.payload("memory/step_00000005")
    assert payload["state"]["w"].tolist() == [5.0] * 4
    payload["state"]["w"].fill_(-1)  # training changes what a restore hands it
    assert store.payload("memory/step_00000005")["state"]["w"].tolist() == [5.0] * 4
    assert store.discard_after(10) == ["memory/step_00000015", "memory/step_00000020"]
    named = listing([], store.list())
    assert named["latest"] == named["last_good"] == "memory/step_00000005"


def test_over_budget_snapshots_turn_off_once_and_training_goes_on(tmp_path: Path) -> None:
    cfg = config(train={"log_every": 5}, snapshot={"every": 5, "budget": "1KiB"})
    guard, model, opt = make_guard(tmp_path, cfg)
    with guard:
        train(guard, model, opt, 20)
        assert guard.step == 20
        assert guard.recovery.snapshots is not None
        assert not guard.recovery.snapshots.enabled
        assert snapshot_metric(guard, "snapshots_enabled") == 0
    off = [e for e in events(tmp_path) if e["event"] == "snapshots_off"]
    assert len(off) == 1 and "over the budget of 1.0 KiB (snapshot.budget" in off[0]["reason"]


def test_checkpoints_follow_the_time_cadence_when_every_is_unset(tmp_path: Path) -> None:
    cfg = config(
        train={"log_every": 5},
        checkpoint={"every_seconds": 1e-6, "save_on_exit": False},
        snapshot={"every": None},
    )
    guard, model, opt = make_guard(tmp_path, cfg)
    with guard:
        train(guard, model, opt, 12)
    saved = [e for e in events(tmp_path) if e["event"] == "checkpoint"]
    assert [(e["checkpoint_step"], e["reason"]) for e in saved] == [
        (5, "periodic"),
        (10, "periodic"),
    ]
