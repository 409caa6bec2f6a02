"""A run's JSON-lines logs (``metrics.jsonl``, ``events.jsonl``) read whole, as a report needs
them: every object line, and a count of the lines that are not one (a line torn by a crash)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lossguard.common.rundir.jsonl import json_object


@dataclass(frozen=True)
class JsonLines:
    """The objects of a JSON-lines file, in file order, and how many lines were unreadable."""

    records: tuple[dict[str, Any], ...]
    unreadable: int


def read_jsonl(path: Path) -> JsonLines:
    """``path``'s JSON objects; a missing file has none. Blank lines are ignored; a line that
    is not a JSON object (torn, cut, garbled) is counted and skipped."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return JsonLines((), 0)
    records: list[dict[str, Any]] = []
    unreadable = 0
    for line in data.splitlines():
        if not line.strip():
            continue
        record = json_object(line)
        if record is not None:
            records.append(record)
        else:
            unreadable += 1
    return JsonLines(tuple(records), unreadable)
