"""Functions over the samples of one series in a range (Prometheus 2.42 functions.go)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Point = tuple[int, float]
"""(timestamp in milliseconds, value); never a staleness marker."""


@dataclass(frozen=True)
class Window:
    """The selected range ``[start_ms, end_ms]`` (offset applied) and its length in seconds."""

    start_ms: int
    end_ms: int

    @property
    def seconds(self) -> float:
        """As Go's ``Duration.Seconds()``: whole seconds plus the fraction, added."""
        whole, millis = divmod(self.end_ms - self.start_ms, 1000)
        return float(whole) + millis * 1_000_000 / 1e9


def extrapolated_rate(
    points: Sequence[Point], window: Window, is_counter: bool, is_rate: bool
) -> float | None:
    """rate/increase/delta: the change over the samples, with counter resets added back,
    extrapolated towards the window edges (at most half an average interval past a sample
    when the gap exceeds 1.1 intervals; for counters never below zero)."""
    if len(points) < 2:
        return None
    (first_t, first_v), (last_t, last_v) = points[0], points[-1]
    result = last_v - first_v
    if is_counter:
        previous = first_v
        for _, value in points[1:]:
            if value < previous:
                result += previous
            previous = value
    to_start = (first_t - window.start_ms) / 1000
    to_end = (window.end_ms - last_t) / 1000
    sampled = (last_t - first_t) / 1000
    average = sampled / (len(points) - 1)
    if is_counter and result > 0 and first_v >= 0:
        to_start = min(to_start, sampled * (first_v / result))
    threshold = average * 1.1
    interval = sampled
    interval += to_start if to_start < threshold else average / 2
    interval += to_end if to_end < threshold else average / 2
    factor = interval / sampled
    if is_rate:
        factor /= window.seconds
    return result * factor


def changes(points: Sequence[Point]) -> float:
    count = 0
    previous = points[0][1]
    for _, value in points[1:]:
        if value != previous and not (math.isnan(value) and math.isnan(previous)):
            count += 1
        previous = value
    return float(count)


def resets(points: Sequence[Point]) -> float:
    count = 0
    previous = points[0][1]
    for _, value in points[1:]:
        if value < previous:
            count += 1
        previous = value
    return float(count)


def max_over_time(points: Sequence[Point]) -> float:
    result = points[0][1]
    for _, value in points:
        if value > result or math.isnan(result):
            result = value
    return result


def min_over_time(points: Sequence[Point]) -> float:
    result = points[0][1]
    for _, value in points:
        if value < result or math.isnan(result):
            result = value
    return result


def avg_over_time(points: Sequence[Point]) -> float:
    """Incremental mean with Kahan-Neumaier compensation; infinities kept as they are."""
    mean = count = compensation = 0.0
    for _, value in points:
        count += 1
        if math.isinf(mean) and (
            (math.isinf(value) and (mean > 0) == (value > 0))
            or not (math.isinf(value) or math.isnan(value))
        ):
            continue
        mean, compensation = _kahan_add(value / count - mean / count, mean, compensation)
    return mean if math.isinf(mean) else mean + compensation


def _kahan_add(increment: float, total: float, compensation: float) -> tuple[float, float]:
    new_total = total + increment
    if abs(total) >= abs(increment):
        compensation += (total - new_total) + increment
    else:
        compensation += (increment - new_total) + total
    return new_total, compensation


RangeFunction = Callable[[Sequence[Point], Window], float | None]

RANGE_FUNCTIONS: dict[str, RangeFunction] = {
    "rate": lambda points, window: extrapolated_rate(points, window, True, True),
    "increase": lambda points, window: extrapolated_rate(points, window, True, False),
    "delta": lambda points, window: extrapolated_rate(points, window, False, False),
    "changes": lambda points, _: changes(points),
    "resets": lambda points, _: resets(points),
    "max_over_time": lambda points, _: max_over_time(points),
    "min_over_time": lambda points, _: min_over_time(points),
    "avg_over_time": lambda points, _: avg_over_time(points),
}
"""Range function -> implementation, given at least one point; ``None`` means no output."""
