"""The learning rate of each optimizer step against the schedule: warm-up is the schedule, a
departure is named from the step where it began, for as long as it lasts."""

from __future__ import annotations

import pytest
import torch

from lossguard.agent.telemetry.lr_watch import LrDeparture, lr_watch
from lossguard.agent.train.faults import scaled_lr


def test_a_departure_is_kept_from_where_it_began() -> None:
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    done = [0]
    watch = lr_watch(optimizer, warmup, lambda: done[0] + 1)
    assert watch is not None
    lrs = []

    def step(factor: float = 1.0) -> None:
        weight.grad = torch.ones(2)
        with scaled_lr(optimizer, factor):
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
        warmup.step()
        done[0] += 1

    for _ in range(5):  # warm-up: the lr rises 5x, on schedule
        step()
    assert watch.departure is None
    for _ in range(4):  # steps 6 to 9 at 1000x
        step(1000.0)
    assert watch.departure == LrDeparture(6, 9, lrs[5], lrs[5] / 1000)
    step()
    step(2.0)  # step 10 on schedule, 11 a new departure: the newest one is kept
    newest = watch.departure
    assert newest is not None and (newest.step, newest.last, newest.lr) == (11, 11, lrs[10])
    assert newest.ratio == pytest.approx(2.0)
    watch.reset()  # a restore: what the abandoned steps used does not count
    assert watch.departure is None
    watch.close()
    step(1000.0)
    assert watch.departure is None  # the hook is gone
    assert lr_watch(optimizer, None, lambda: 0) is None  # no schedule to judge against
