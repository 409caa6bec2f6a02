"""Fault injection's replay semantics: a fault comes back whenever a rollback replays its
steps, unless it is marked ``once`` (a transient fault)."""

from __future__ import annotations

import torch

from lossguard.agent.config import FaultConfig
from lossguard.agent.train.faults import FaultInjector


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
