"""The end of a log interval, on the host: the one read of what the Guard added up on the device,
the ``train`` record, the audit of the spike episodes and non-finite values found since the
last read, each with its diagnosis, and of the level shifts taken as the detectors' new
baseline."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import astuple
from typing import Any

import torch

from lossguard.agent.distributed import all_gather_objects
from lossguard.agent.restored import Restored
from lossguard.agent.run_context import RunContext
from lossguard.agent.telemetry.batch_tokens import BatchTokens
from lossguard.agent.telemetry.diagnosis import IntervalContext, PrecisionHistory, diagnose
from lossguard.agent.telemetry.hub import SignalStats, signal_stats
from lossguard.agent.telemetry.interval import DetectionAudit, Interval, IntervalTotals
from lossguard.agent.telemetry.level_shift import LevelShift, accept_level_shift
from lossguard.agent.telemetry.lr_watch import LrWatch
from lossguard.common.catalogue import OPTIMIZER_COUNTERS
from lossguard.common.rundir.events import EXPECTED_CHANGE, LEVEL_SHIFT, NONFINITE

log = logging.getLogger("lossguard.agent")


class IntervalLog:
    """What the Guard reads and records at the end of each log interval.

    ``episode``: the diagnosis of the latest spike episode or non-finite value since the last
    restore (``telemetry.diagnosis``): the ``status`` command's ``episode``."""

    def __init__(
        self,
        ctx: RunContext,
        interval: Interval,
        *,
        optimizer: torch.optim.Optimizer | None,
        scaler: torch.amp.GradScaler | None,
        state: Mapping[str, object],
        fp16_unscaled: bool,
        lr_watch: LrWatch | None = None,
        tokens: BatchTokens | None = None,
    ) -> None:
        self.ctx = ctx
        self.interval = interval
        self.telemetry = ctx.telemetry
        self.world_size = ctx.world_size
        self.optimizer = optimizer
        self.scaler = scaler
        self.state = state
        self.fp16_unscaled = fp16_unscaled
        self.event = ctx.event
        self.detections = DetectionAudit()
        self.episode: dict[str, Any] | None = None
        self.lr_before: float | None = None  # at the end of the last log interval
        self.precision = PrecisionHistory()  # loss scale and FP8 overflow at earlier intervals
        self.lr_watch = lr_watch  # each step's lr against the schedule
        self.tokens = tokens  # each step's token statistics, read at detections only
        self.start: tuple[int, int | None] = (0, None)  # (step, data position)
        self.logged_healthy: bool | None = True  # as of the last interval (None: unknown)
        # an optimizer's own counters (SPAM: momentum resets, clipped entries), on the device
        self.optimizer_totals: torch.Tensor | None = getattr(optimizer, "metric_totals", None)
        if self.optimizer_totals is not None:
            self.telemetry.count_optimizer()

    def learning_rate(self) -> float | None:
        if self.optimizer is None:
            return None
        return float(self.optimizer.param_groups[0]["lr"])

    def data_position(self) -> int | None:
        position = getattr(self.state.get("data"), "position", None)
        return None if position is None else int(position)

    def end(self, step: int, tokens_before: int) -> dict[str, Any] | None:
        """The ``train`` record of the interval ending at ``step`` (None: no step since the
        last one), after the one host read and the audit of new detections. ``tokens``: the
        run's total, ``tokens_before`` plus this interval's."""
        if self.interval.steps == 0:
            return None
        stats = self.telemetry.stats()  # None: no detectors (telemetry off)
        totals = self.interval.read(stats, self.optimizer_totals)  # the one sync
        elapsed = totals.elapsed
        record: dict[str, Any] = {
            "kind": "train",
            "step": step,
            "time": time.time(),
            "train_loss": totals.loss_sum / (totals.steps * self.world_size),
            "grad_norm": totals.grad_norm_last / self.world_size,
            "grad_norm_max": totals.grad_norm_max / self.world_size,
            "lr": self.learning_rate(),
            "tokens": tokens_before + int(totals.tokens),
            "tokens_per_second": totals.tokens / elapsed if elapsed > 0 else 0.0,
            "step_time_seconds": elapsed / totals.steps,
        }
        position = self.data_position()
        if position is not None:
            record["data_position"] = position
        if self.scaler is not None:
            record["loss_scale"] = float(self.scaler.get_scale())
        record["skipped_steps"] = int(totals.skipped / self.world_size)
        record["skipped_spikes"] = int(totals.skipped_spikes / self.world_size)
        for name, total in zip(OPTIMIZER_COUNTERS, totals.optimizer, strict=False):
            record[name] = int(total)  # this rank's, since the process started
        active = False
        if stats is not None:
            by_signal = signal_stats(totals.stats)
            shift = accept_level_shift(self.telemetry.detectors, by_signal, step)
            self.telemetry.publish(record, by_signal, float(totals.local_tokens), elapsed)
            self.audit(by_signal, totals, step)
            if shift is not None:
                self._level_shift(shift, step)
            active = any(s["active"] for s in by_signal.values())
            if self.telemetry.fp8_overflow is not None:
                self.precision.fp8_seen(self.telemetry.fp8_overflow[1])
        self.logged_healthy = math.isfinite(record["train_loss"]) and not active
        self.interval.reset()
        self.lr_before = record["lr"]
        self.precision.loss_scale_seen(record.get("loss_scale"))
        self.start = (step, position)
        return record

    def audit(self, stats: SignalStats, totals: IntervalTotals, step: int) -> None:
        """Audit the spike episodes and non-finite values new since the last read, each with
        its diagnosis; the most telling one of them becomes ``episode``."""
        found = self.detections.new(stats)
        if not found:
            return
        context = self._context(totals, step)
        candidates = []
        for event, fields in found:
            signal_name, nonfinite = fields["signal"], event == NONFINITE
            diagnosis = diagnose(signal_name, nonfinite=nonfinite, stats=stats, context=context)
            self.event(event, **fields, diagnosis=diagnosis)
            if nonfinite and not self.telemetry.detectors[signal_name].nonfinite_opens_episode:
                continue  # routine (fp16 GradScaler overflow): no episode
            rank = (diagnosis["step"], nonfinite, signal_name == "loss")
            candidates.append((rank, diagnosis))
        if candidates:
            self.episode = max(candidates, key=lambda item: item[0])[1]

    def _level_shift(self, shift: LevelShift, step: int) -> None:
        """Audit and log a level shift, declared at ``step``."""
        self.event(
            LEVEL_SHIFT,
            signal=shift.signal,
            began=shift.began,
            mean_before=shift.mean_before,
            level=shift.level,
            trend=shift.trend,
        )
        if self.ctx.main:
            log.info(
                "%s level shift: from %.4g to %.4g since step %d, flat or falling for %d steps "
                "(rise %.2f of the jump); taken as the new level, the episode ended",
                shift.signal,
                shift.mean_before,
                shift.level,
                shift.began,
                step - shift.began + 1,
                shift.trend,
            )

    def expect_change(self, step: int, reason: str, request_id: str | None) -> dict[str, Any]:
        """An operator's word that the level changes from ``step`` on (``request_id``: the
        control command's; None: the training loop's own call): the detectors take the current
        level as their baseline, audited and logged. Returns the reply's result."""
        self.telemetry.rebase()
        self.logged_healthy = None  # the episode the last interval saw has ended: judge anew
        by = {"by": "api"} if request_id is None else {"by": "control", "id": request_id}
        self.event(EXPECTED_CHANGE, reason=reason, **by)
        if self.ctx.main:
            log.info(
                "expected change at step %d (%s%s): the spike detectors start again from the "
                "current level",
                step,
                by["by"],
                f", {reason!r}" if reason else "",
            )
        return {"step": step}

    def _context(self, totals: IntervalTotals, step: int) -> IntervalContext:
        """What a diagnosis needs beside the detector statistics (at detections only: the
        loss scale and the token statistics are one more host read each)."""
        grad_norm_max = totals.grad_norm_max / self.world_size
        fp8 = self.telemetry.fp8_overflow
        departure = self.lr_watch.departure if self.lr_watch is not None else None
        start_step, start_position = self.start
        return IntervalContext(
            step=step,
            lr=self.learning_rate(),
            lr_before=self.lr_before,
            loss_scale=float(self.scaler.get_scale()) if self.scaler is not None else None,
            loss_scale_before=self.precision.loss_scale_before,
            loss_scale_low=self.precision.loss_scale_low,
            fp16_unscaled=self.fp16_unscaled,
            grad_norm_max=grad_norm_max if math.isfinite(grad_norm_max) else None,
            fp8_overflow=fp8,
            fp8_overflow_high=self.precision.fp8_high,
            scheduled=self.lr_watch is not None,
            lr_departure=astuple(departure) if departure is not None else None,
            start_step=start_step,
            start_position=start_position,
            end_position=self.data_position(),
            batch_tokens=self._batch_tokens(step),
        )

    def _batch_tokens(self, step: int) -> list[dict[int, tuple[float, ...]]] | None:
        """Every rank's token statistics up to ``step``, by rank (collective: every rank
        audits the same detections)."""
        if self.tokens is None:
            return None
        return all_gather_objects(
            self.tokens.read(step),
            self.ctx.group,
            "all_gather_object: token statistics of a detection",
        )

    def healthy(self, last_train_loss: float | None) -> bool:
        """This rank: false inside a spike episode, or when the current interval or the last
        logged one (``last_train_loss``) saw a non-finite loss (docs/design.md ``last_good``). Right
        after a log interval (no step since) that interval's reading answers, with no host
        read."""
        if self.interval.steps == 0 and self.logged_healthy is not None:
            return self.logged_healthy
        interval_finite = self.interval.finite()
        last = last_train_loss
        in_episode = self.telemetry.episode_active()
        return interval_finite and (last is None or math.isfinite(last)) and not in_episode

    def before_rollback(self, step: int) -> tuple[dict[str, Any] | None, int | None]:
        """Before a rollback from ``step``: audit what the detectors saw since the last log
        interval (one collective read), so the steps about to be abandoned have their
        diagnosis. Returns the latest ``episode`` and the first step of the earliest spike
        episode still open on this rank (None: none is; one more host read)."""
        if self.interval.steps:
            stats = self.telemetry.stats()
            if stats is not None:
                totals = self.interval.read(stats)
                self.audit(signal_stats(totals.stats), totals, step)
        return self.episode, self._episode_start(step)

    def _episode_start(self, step: int) -> int | None:
        own = self.telemetry.stats()  # this rank's
        if own is None:
            return None
        starts = [
            step - int(s["duration"]) + 1
            for s in signal_stats(own.tolist()).values()
            if s["active"]
        ]
        return min(starts, default=None)

    def restored(self, restored: Restored) -> None:
        """After a restore: a new timeline; what was seen after its step did not happen, the
        detectors' counters count on from the restored totals, and diagnoses compare with the
        state training goes on from (its skipped batches and lr scale included)."""
        self.interval.reset()
        self.episode = None
        self.logged_healthy = None
        if self.lr_watch is not None:
            self.lr_watch.reset()
        self.detections.resync(self.telemetry.resync_totals(restored.step))
        self.lr_before = self.learning_rate()
        scale = float(self.scaler.get_scale()) if self.scaler is not None else None
        self.precision.loss_scale_before = scale
        self.start = (restored.step, restored.position)

    def close(self) -> None:
        if self.lr_watch is not None:
            self.lr_watch.close()
