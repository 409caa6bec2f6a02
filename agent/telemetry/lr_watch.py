"""The learning rate each optimizer step used, against the configured schedule: host floats
read in an optimizer step pre-hook (inside ``optimizer.step()``, so a change made around that
call is seen), never a device read. Diagnoses name a departure from the schedule; warm-up and
decay, being the schedule, are not one."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

OFF_SCHEDULE = 1.5
"""A step's learning rate at least this many times the schedule's (upward only: a lower rate,
such as a rollback's cut, does not make a run diverge)."""


@dataclass(frozen=True)
class LrDeparture:
    """A run of consecutive steps above the schedule: its first step (``step``), its newest
    (``last``), and the two rates at its first step."""

    step: int
    last: int
    lr: float
    scheduled: float

    @property
    def ratio(self) -> float:
        return self.lr / self.scheduled


class LrWatch:
    """Watches ``optimizer``'s steps against ``scheduler.get_last_lr()``; ``departure`` is the
    newest run of consecutive steps above the schedule by ``OFF_SCHEDULE`` times or more, from
    where it began (None: none since the last ``reset``). ``step_of``: the number of the step
    being taken."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, scheduler: Any, step_of: Callable[[], int]
    ) -> None:
        self.scheduler = scheduler
        self.step_of = step_of
        self.departure: LrDeparture | None = None
        self._handle = optimizer.register_step_pre_hook(self._seen)

    def _seen(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        lr = float(optimizer.param_groups[0]["lr"])
        scheduled = float(self.scheduler.get_last_lr()[0])
        if not (math.isfinite(lr) and scheduled > 0 and lr > 0):
            return
        if lr / scheduled < OFF_SCHEDULE:
            return
        step, departure = self.step_of(), self.departure
        if departure is not None and departure.last + 1 == step:  # the same departure goes on
            self.departure = replace(departure, last=step)
        else:
            self.departure = LrDeparture(step, step, lr, scheduled)

    def reset(self) -> None:
        """After a restore: what the abandoned steps used does not count."""
        self.departure = None

    def close(self) -> None:
        self._handle.remove()


def lr_watch(
    optimizer: torch.optim.Optimizer | None, scheduler: Any, step_of: Any
) -> LrWatch | None:
    """A watch where there is a schedule to judge against (a scheduler with ``get_last_lr``)."""
    if optimizer is None or not callable(getattr(scheduler, "get_last_lr", None)):
        return None
    return LrWatch(optimizer, scheduler, step_of)
