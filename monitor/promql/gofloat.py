"""Float64 arithmetic with Go's results where Python raises: Inf and NaN, never exceptions."""

from __future__ import annotations

import math


def divide(x: float, y: float) -> float:
    try:
        return x / y
    except ZeroDivisionError:
        if x == 0 or math.isnan(x):
            return math.nan
        return math.copysign(math.inf, x) * math.copysign(1.0, y)


def modulo(x: float, y: float) -> float:
    """Go's ``math.Mod``: the sign of ``x``; NaN for ``y == 0`` or infinite ``x``."""
    try:
        return math.fmod(x, y)
    except ValueError:
        return math.nan


def power(x: float, y: float) -> float:
    """Go's ``math.Pow`` special cases (±0 to a negative power is ±Inf, overflow is Inf)."""
    try:
        return math.pow(x, y)
    except OverflowError:
        return -math.inf if x < 0 and _odd_integer(y) else math.inf
    except ValueError:
        if x == 0:
            return math.copysign(math.inf, x) if _odd_integer(y) else math.inf
        return math.nan


def _odd_integer(y: float) -> bool:
    return math.isfinite(y) and abs(y) < 2**53 and y == int(y) and int(y) % 2 == 1
