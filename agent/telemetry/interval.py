"""One log interval, kept on the device: what the Guard adds up at every step without a host
sync, and the one collective read at the interval's end."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lossguard.agent.distributed import all_reduce_max_tensor, all_reduce_sum
from lossguard.common.rundir.events import NONFINITE, SPIKE


@dataclass(frozen=True)
class IntervalTotals:
    """An interval as read at its end: sums over ranks, except ``stats`` (worst rank)."""

    loss_sum: float
    grad_norm_last: float
    grad_norm_max: float
    tokens: float
    skipped: float  # updates skipped as non-finite since this process started
    skipped_spikes: float  # updates skipped as spikes (mitigation.skip_spikes), likewise
    stats: list[float]  # the spike detectors' statistics
    steps: int
    local_tokens: int  # this rank's
    elapsed: float
    optimizer: tuple[float, ...] = ()  # this rank's optimizer counters (``read``'s ``local``)


class Interval:
    """Loss, gradient norms, tokens and steps since the last log interval, on the device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.skipped = torch.zeros((), device=device)  # kept across intervals
        self.skipped_spikes = torch.zeros((), device=device)  # likewise
        self.reset()

    def reset(self) -> None:
        zero = torch.zeros((), device=self.device)
        self.loss_sum = zero.clone()
        self.grad_norm_last = zero.clone()
        self.grad_norm_max = zero.clone()
        self.steps = 0
        self.tokens = 0
        self.started = time.perf_counter()
        self._pending_tokens = 0

    def exclude(self, seconds: float) -> None:
        """Time that was not training (evaluation, a pause)."""
        self.started += seconds

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor, tokens: int) -> None:
        """A step's loss and pre-clip gradient norm (device tensors) and its tokens."""
        self.loss_sum += loss.detach().float()
        self.grad_norm_last = grad_norm
        self.grad_norm_max = torch.maximum(self.grad_norm_max, grad_norm)
        self._pending_tokens = int(tokens)

    def step_done(self) -> None:
        self.steps += 1
        self.tokens += self._pending_tokens
        self._pending_tokens = 0

    def finite(self) -> bool:
        """Whether every loss of this interval so far was finite (one host read)."""
        return bool(torch.isfinite(self.loss_sum).item())

    def read(self, stats: torch.Tensor | None, local: torch.Tensor | None = None) -> IntervalTotals:
        """Reduce over ranks and read everything at once: the interval's one host sync.
        Collective under torchrun. ``stats``: the detectors' flags (the worst rank wins);
        ``local``: this rank's optimizer counters, read as they are (not reduced)."""
        summed = torch.stack(
            [
                self.loss_sum,
                self.grad_norm_last,
                self.grad_norm_max,
                torch.tensor(float(self.tokens), device=self.device),
                self.skipped,
                self.skipped_spikes,
            ]
        ).double()
        parts = [all_reduce_sum(summed, "all_reduce: log interval totals")]
        if stats is not None:  # flags: the worst rank wins, so every rank agrees
            parts.append(
                all_reduce_max_tensor(stats, "all_reduce: log interval detector statistics")
            )
        own = 0 if local is None else local.numel()
        if local is not None:
            parts.append(local.double())
        values = torch.cat(parts).tolist()
        loss_sum, norm_last, norm_max, tokens, skipped, skipped_spikes = values[:6]
        return IntervalTotals(
            loss_sum=loss_sum,
            grad_norm_last=norm_last,
            grad_norm_max=norm_max,
            tokens=tokens,
            skipped=skipped,
            skipped_spikes=skipped_spikes,
            stats=values[6 : len(values) - own],
            steps=self.steps,
            local_tokens=self.tokens,
            elapsed=time.perf_counter() - self.started,
            optimizer=tuple(values[len(values) - own :]),
        )


class DetectionAudit:
    """Which spike episodes and non-finite values are new since the last interval, from the
    detectors' running totals (for the audit trail)."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def new(self, stats: Mapping[str, Mapping[str, float]]) -> list[tuple[str, dict[str, Any]]]:
        """``(event, fields)`` for each signal whose spike or non-finite total went up;
        ``stats``: each signal's detector statistics, by name in ``SIGNALS`` order
        (``Telemetry.publish``; none while telemetry is off)."""
        found: list[tuple[str, dict[str, Any]]] = []
        for signal_name, values in stats.items():
            for event, counter in ((SPIKE, "spikes_total"), (NONFINITE, "nonfinite_total")):
                key = f"{signal_name}_{counter}"
                total, seen = int(values[counter]), self._seen.get(key, 0)
                if total > seen:
                    fields = {"signal": signal_name, "total": total, "zscore": values["zscore"]}
                    found.append((event, fields))
                self._seen[key] = total
        return found

    def resync(self, stats: Mapping[str, Mapping[str, float]]) -> None:
        """After a restore the totals are the checkpoint's: what goes beyond them is new."""
        self.new(stats)
