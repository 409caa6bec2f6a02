"""One line of a run's JSON-lines logs (``metrics.jsonl``, ``events.jsonl``), as every reader
takes it: a JSON object, or nothing (a line torn by a crash, cut by a tail, or garbled)."""

from __future__ import annotations

import json
from typing import Any


def json_object(line: bytes | str) -> dict[str, Any] | None:
    """``line`` as a JSON object; None when it is not one."""
    try:
        record = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None
