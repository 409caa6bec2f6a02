"""JSON from the network, nested no deeper than a limit: Python's parser recurses once per
level, and a body of a few thousand ``[`` would exhaust the stack (a RecursionError instead of a
clean refusal). The requests lossguard takes are a few levels deep."""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 32
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


class TooDeep(ValueError):
    """JSON nested deeper than the limit (one line)."""


def load_bounded(data: bytes | str, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(data)``, refusing (TooDeep) anything nested deeper than ``max_depth``
    arrays and objects before it is parsed; other errors are json.loads's own."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    depth = 0
    for match in _BRACKET.finditer(_STRING.sub(b'""', raw)):
        depth += 1 if match.group() in b"[{" else -1
        if depth > max_depth:
            raise TooDeep(f"JSON nested deeper than {max_depth} levels")
    return json.loads(data)
