"""Memory sizes as configs write them (torch-free): ``8GiB``, ``512MB``, ``1048576``, ``25%``;
:class:`MemoryBudget` is one parsed once, as a config value."""

from __future__ import annotations

import os
import re

from lossguard.common.config import ParsedText

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")
_PERCENT_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*%\s*$")


def parse_budget(text: str) -> int | float:
    """Bytes (an int) for a size, or a fraction of physical memory (a float in (0, 1]) for a
    percentage. ValueError says what a size looks like."""
    if percent := _PERCENT_RE.fullmatch(text):
        fraction = float(percent.group(1)) / 100
        if not 0 < fraction <= 1:
            raise ValueError(f"a percentage must be in (0, 100], not {text!r}")
        return fraction
    size = _SIZE_RE.fullmatch(text)
    unit = size.group(2).lower() if size else None
    if size is None or unit not in _UNITS:
        raise ValueError(
            f"must be a size such as 8GiB, 512MB or 1048576, or a percentage such as 25%, "
            f"not {text!r}"
        )
    return int(float(size.group(1)) * _UNITS[unit])


class MemoryBudget(ParsedText):
    """A host-memory budget as written (``8GiB``, ``25%``) and its ``amount``: bytes (an int)
    or a fraction of physical memory (a float in (0, 1])."""

    amount: int | float

    def __new__(cls, text: str) -> MemoryBudget:
        value = super().__new__(cls, text)
        value.amount = parse_budget(text)
        return value


def physical_memory() -> int:
    """Bytes of physical memory on this host."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def budget_bytes(budget: MemoryBudget, sharers: int) -> int:
    """The bytes ``budget`` grants one of ``sharers`` processes on this host."""
    value = budget.amount
    total = int(value * physical_memory()) if isinstance(value, float) else value
    return total // max(1, sharers)


def format_bytes(count: int) -> str:
    """``1.5 GiB``-style text for logs and messages."""
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
