"""Level shifts: a loss that stepped up and stays there while training is otherwise calm (a
planned data-mix change) is a new level, not a divergence.

Judged at the log interval from the detector statistics already reduced over ranks (the worst
rank's, ``Interval.read``), so every rank takes the same decision and re-bases its own loss
detector. The fit it rests on is ``SpikeDetector``'s (``shift_trend``, ``shift_level``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from lossguard.agent.telemetry.spikes import SpikeDetector

MAX_TREND = 0.25
"""The most a level shift's episode may rise, over its whole length (the least-squares line's
rise), as a fraction of its jump (its mean less the window mean before it)."""


@dataclass(frozen=True)
class LevelShift:
    """An episode taken as a new level: where it began and the levels before and after."""

    signal: str
    began: int  # the episode's first step: the jump
    mean_before: float  # the window mean before the jump
    level: float  # the fitted line's value at the last step
    trend: float  # the fitted rise over the episode, as a fraction of the jump


def judge(
    stats: Mapping[str, Mapping[str, float]], step: int, after: int, *, grad_nonfinite_opens: bool
) -> LevelShift | None:
    """The loss episode at ``step`` (``stats``: each signal's statistics by name, reduced over
    ranks) as a level shift, or None. It is one once it has lasted ``after`` steps, when it was
    opened by a spike, every value in it was finite and it rose by at most ``MAX_TREND`` of its
    jump since (``shift_trend``, +inf otherwise), and the gradient norm stayed calm: no episode
    of it open, and none opened (by a spike, or by a non-finite value where those open one:
    ``grad_nonfinite_opens``) from the step before the jump on, since the gradient of step s
    moves the loss of step s + 1."""
    loss, grad = stats["loss"], stats["grad_norm"]
    if not loss["active"] or loss["duration"] < after or not loss["shift_trend"] <= MAX_TREND:
        return None
    began = step - int(loss["duration"]) + 1
    calm_since = began - 1
    grad_opened = grad["spike_step"] >= calm_since or (
        grad_nonfinite_opens and grad["nonfinite_step"] >= calm_since
    )
    if grad["active"] or grad_opened:
        return None
    return LevelShift(
        signal="loss",
        began=began,
        mean_before=loss["spike_mean"],
        level=loss["shift_level"],
        trend=loss["shift_trend"],
    )


def accept_level_shift(
    detectors: Mapping[str, SpikeDetector], stats: dict[str, dict[str, float]], step: int
) -> LevelShift | None:
    """At the log interval ending at ``step``: a loss episode that ``judge`` takes for a level
    shift ends, its detector taking the new level as its baseline (``SpikeDetector.rebase``, on
    this rank); ``stats`` (reduced over ranks) then say so, as the detector would."""
    after = detectors["loss"].cfg.level_shift_after
    grad_opens = detectors["grad_norm"].nonfinite_opens_episode
    shift = judge(stats, step, after, grad_nonfinite_opens=grad_opens)
    if shift is not None:
        detectors[shift.signal].rebase(shift_began=shift.began)
        values = stats[shift.signal]
        values.update(active=0.0, duration=0.0, shift_trend=-math.inf, shift_level=-math.inf)
        values["level_shifts_total"] += 1
        values["level_shift_step"] = float(shift.began)
    return shift
