"""Text from the network or from files, made fit for one line of a log or an audit trail: a
request id, a run id or a label value can then never start a line of its own."""

from __future__ import annotations

LIMIT = 200


def escaped(value: object, limit: int = LIMIT) -> str:
    """``value`` as text on one line: backslashes and every character that is not printable
    (newlines, carriage returns, other controls, line and paragraph separators) written as
    Python escapes; longer than ``limit`` characters, cut and ended with ``...``."""
    text = str(value)
    out = "".join(
        char if char.isprintable() and char != "\\" else char.encode("unicode_escape").decode()
        for char in text[: limit + 1]
    )
    return out if len(text) <= limit else f"{out[:limit]}..."
