"""Spike diagnosis: what was going on when a spike episode opened or a value went non-finite,
and its probable causes by simple rules. Built at log intervals from numbers already read to the
host (never on the per-step path). Torch-free.

A diagnosis is a JSON-ready dict (no NaN: what is unknown or non-finite is None):

    signal, step, nonfinite, value, zscore, window_mean, window_std,
    grad_norm, grad_norm_ratio, lr, lr_before, lr_ratio, loss_scale, fp8_overflow_ratio,
    data_position, batch_tokens, causes

``batch_tokens``: the statistics of the step's token ids against the run's (``batch_judge``),
or None where the step's ids were not seen or the history is too short. ``causes`` is a list
of short English sentences, most telling first; when no rule applies, one sentence saying that
nothing stands out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lossguard.agent.telemetry.batch_judge import BatchJudgement, judge_ranks

LR_RISE = 1.5
"""Without a schedule to judge against: a learning rate at least this many times the previous
interval's is a probable cause."""
LR_HORIZON = 100
"""A learning rate off its schedule until up to this many steps before a detection may explain
it."""
FP8_RISE = 2.0
"""An FP8 overflow ratio at least this many times the highest of the run's earlier samples (or
any, after none)."""
GRAD_NORM_RISE = 5.0
"""A gradient norm at least this many times its window mean is a probable cause."""


def finite_or_none(value: Any) -> float | None:
    """``value`` as a float, or None when it is missing or not finite."""
    if value is None or isinstance(value, bool):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return finite_or_none(numerator / denominator)


def _step(value: Any) -> int | None:
    number = finite_or_none(value)
    return int(number) if number is not None and number >= 0 else None


@dataclass(frozen=True)
class IntervalContext:
    """What the Guard knows at the end of a log interval, beside the detector statistics."""

    step: int  # the interval's last step
    lr: float | None
    lr_before: float | None  # at the end of the previous interval
    loss_scale: float | None  # fp16 GradScaler scale now
    loss_scale_before: float | None  # at the end of the previous interval
    loss_scale_low: float | None  # the lowest at the end of an earlier interval (None: none)
    fp16_unscaled: bool  # fp16 training without a GradScaler
    grad_norm_max: float | None  # the interval's largest pre-clip norm (mean over ranks)
    fp8_overflow: tuple[str, float] | None  # (tensor, worst overflow ratio) of the last sample
    fp8_overflow_high: float | None  # the highest of the earlier samples' worst ratios
    scheduled: bool  # the learning rate follows a known schedule (a scheduler)
    # (first step, newest step, lr, scheduled lr at the first): the newest run of steps above it
    lr_departure: tuple[int, int, float, float] | None
    start_step: int  # the last step before this interval
    start_position: int | None  # the data position then
    end_position: int | None  # the data position now
    # each rank's token statistics by step (None: the input ids were not seen)
    batch_tokens: Sequence[Mapping[int, tuple[float, ...]]] | None = None

    def position_of(self, step: int) -> int | None:
        """The data position of ``step``'s batch, when the interval's positions say how many
        positions a step takes (the built-in sampler: one)."""
        start, end = self.start_position, self.end_position
        steps = self.step - self.start_step
        if start is None or end is None or steps <= 0 or not self.start_step < step <= self.step:
            return end
        per_step, rest = divmod(end - start, steps)
        if rest or per_step <= 0:
            return end
        return start + (step - self.start_step - 1) * per_step


@dataclass
class PrecisionHistory:
    """The fp16 loss scale and FP8 overflow at earlier log intervals, what a diagnosis judges
    them against: the scale at the previous interval's end and the lowest at any, the highest
    of the FP8 samples' worst overflow ratios."""

    loss_scale_before: float | None = None
    loss_scale_low: float | None = None
    fp8_high: float | None = None

    def loss_scale_seen(self, scale: float | None) -> None:
        """The scale at an interval's end (None: no GradScaler)."""
        self.loss_scale_before = scale
        if scale is not None:
            low = self.loss_scale_low
            self.loss_scale_low = scale if low is None else min(low, scale)

    def fp8_seen(self, ratio: float) -> None:
        """The worst overflow ratio of the newest FP8 sample."""
        self.fp8_high = ratio if self.fp8_high is None else max(self.fp8_high, ratio)


def diagnose(
    signal: str,
    *,
    nonfinite: bool,
    stats: Mapping[str, Mapping[str, float]],
    context: IntervalContext,
) -> dict[str, Any]:
    """The diagnosis of ``signal``'s newest spike episode (``nonfinite``: its newest non-finite
    value) from the detectors' statistics (``stats``: by signal, as ``Telemetry.publish``
    returns them)."""
    own = stats[signal]
    if nonfinite:
        step = _step(own.get("nonfinite_step"))
        value = zscore = None
        mean, std = finite_or_none(own.get("mean")), finite_or_none(own.get("std"))
    else:
        step = _step(own.get("spike_step"))
        value = finite_or_none(own.get("spike_value"))
        mean, std = finite_or_none(own.get("spike_mean")), finite_or_none(own.get("spike_std"))
        zscore = _ratio(None if value is None or mean is None else value - mean, std)
    if step is None:  # not recorded (a detector state from an older lossguard)
        step = context.step
    grad_norm, grad_norm_ratio = _grad_norm_at(step, stats.get("grad_norm", {}), context)
    lr_ratio = _ratio(context.lr, context.lr_before)
    position = context.position_of(step)
    tokens = judge_ranks(step, context.batch_tokens) if context.batch_tokens else None
    diagnosis: dict[str, Any] = {
        "signal": signal,
        "step": step,
        "nonfinite": nonfinite,
        "value": value,
        "zscore": zscore,
        "window_mean": mean,
        "window_std": std,
        "grad_norm": grad_norm,
        "grad_norm_ratio": grad_norm_ratio,
        "lr": finite_or_none(context.lr),
        "lr_before": finite_or_none(context.lr_before),
        "lr_ratio": lr_ratio,
        "loss_scale": finite_or_none(context.loss_scale),
        "fp8_overflow_ratio": context.fp8_overflow[1] if context.fp8_overflow else None,
        "data_position": position,
        "batch_tokens": tokens.as_dict() if tokens is not None else None,
    }
    diagnosis["causes"] = causes(diagnosis, context, tokens)
    return diagnosis


def _grad_norm_at(
    step: int, grad: Mapping[str, float], context: IntervalContext
) -> tuple[float | None, float | None]:
    """The gradient norm at ``step`` and its ratio to the window mean: the grad-norm detector's
    own record where it spiked or went non-finite at that step, else the interval's largest."""
    if _step(grad.get("spike_step")) == step:
        value = finite_or_none(grad.get("spike_value"))
        return value, _ratio(value, finite_or_none(grad.get("spike_mean")))
    if _step(grad.get("nonfinite_step")) == step:
        return None, None
    value = finite_or_none(context.grad_norm_max)
    return value, _ratio(value, finite_or_none(grad.get("mean")))


def causes(
    diagnosis: Mapping[str, Any],
    context: IntervalContext,
    tokens: BatchJudgement | None = None,
) -> list[str]:
    """Probable causes, each judged against what is expected: the learning rate against its
    schedule (warm-up and decay are not causes), the batch's tokens against the run's
    (``tokens``), the gradient norm against its window, the loss scale and FP8 overflow
    against their own history. When nothing stands out, says so."""
    position = diagnosis["data_position"]
    batch = f"the batch at data position {position}" if position is not None else "the batch"
    lr_cause = _lr_cause(diagnosis, context)
    found = [lr_cause] if lr_cause is not None else []
    if tokens is not None and tokens.unlike:
        unlike = ", ".join(judged.describe() for judged in tokens.unlike)
        found.append(f"{batch}{_shares(tokens, context)} is unlike the run's data: {unlike}")
    grad_ratio = diagnosis["grad_norm_ratio"]
    burst = None
    if grad_ratio is not None and grad_ratio >= GRAD_NORM_RISE:
        burst = f"gradient norm {grad_ratio:.0f}x its window mean"
        found.append(burst)
    found.extend(_precision_causes(context))
    lr = "learning rate on schedule" if context.scheduled else "no learning-rate rise"
    ordinary = tokens is not None  # judged, and not unlike (else it is in found)
    if burst is not None and found == [burst]:
        if ordinary:
            return [
                f"{burst} on {batch}, with {lr}, no precision change and tokens like the run's data"
            ]
        return [f"{burst}, with {lr} and no precision change: {batch}"]
    if found:
        return found
    quiet = f"{lr}, no gradient-norm or precision change" + (
        ", tokens like the run's data" if ordinary else ""
    )
    if diagnosis["nonfinite"]:
        return [
            f"nothing stands out ({quiet}): the non-finite value arose in the forward or "
            f"backward pass of {batch}"
        ]
    return [f"nothing stands out ({quiet}): {batch} is what is left to check"]


def _shares(tokens: BatchJudgement, context: IntervalContext) -> str:
    """Under torchrun, whose share of the batch is unlike the run's data (the numbers given
    are the first's)."""
    if context.batch_tokens is None or len(context.batch_tokens) < 2:
        return ""
    ranks = [tokens.rank, *(r for r in tokens.unlike_ranks if r != tokens.rank)]
    if len(ranks) == 1:
        return f" (rank {ranks[0]}'s share)"
    return f" (the shares of ranks {', '.join(map(str, ranks))})"


def _precision_causes(context: IntervalContext) -> list[str]:
    """fp16 without loss scaling, a loss scale below its own history, FP8 overflow above its
    own history."""
    found = []
    if context.fp16_unscaled:
        found.append("fp16 training without loss scaling (no GradScaler)")
    scale, before, low = context.loss_scale, context.loss_scale_before, context.loss_scale_low
    if scale is not None and before is not None and scale < before:
        if low is None:
            found.append(f"fp16 loss scale fell from {before:g} to {scale:g} (gradient overflow)")
        elif scale < low:
            found.append(
                f"fp16 loss scale fell from {before:g} to {scale:g} (gradient overflow), below "
                f"its lowest of the run so far ({low:g})"
            )
    if context.fp8_overflow is not None and _fp8_rose(context):
        tensor, ratio = context.fp8_overflow
        found.append(f"FP8 overflow in {100 * ratio:.2g}% of values ({tensor})")
    return found


def _lr_cause(diagnosis: Mapping[str, Any], context: IntervalContext) -> str | None:
    """A learning rate above its schedule from a step at or before the detection, until at
    most ``LR_HORIZON`` steps before it, named by where the departure began; without a
    schedule, a rise since the previous interval."""
    if not context.scheduled:
        lr_ratio = diagnosis["lr_ratio"]
        if lr_ratio is not None and lr_ratio >= LR_RISE:
            return f"learning rate rose {lr_ratio:.1f}x since the previous interval"
        return None
    if context.lr_departure is None:
        return None
    first, last, lr, scheduled = context.lr_departure
    if not (first <= diagnosis["step"] and diagnosis["step"] - last <= LR_HORIZON):
        return None
    ratio = lr / scheduled
    times = f"{ratio:.0f}" if ratio >= 10 else f"{ratio:.1f}"
    rates = f"{lr:.3g} instead of {scheduled:.3g}"
    if first == last:
        return f"learning rate {times}x its schedule at step {first} ({rates})"
    until = "on" if last >= context.step else f"to {last}"  # on: to the newest step taken
    return f"learning rate {times}x its schedule from step {first} {until} ({rates} at {first})"


def _fp8_rose(context: IntervalContext) -> bool:
    """FP8 overflow above its own history: any after none, else FP8_RISE times the highest
    of the earlier samples."""
    assert context.fp8_overflow is not None
    ratio, high = context.fp8_overflow[1], context.fp8_overflow_high
    if ratio <= 0:
        return False
    return high is None or high <= 0 or ratio >= FP8_RISE * high
