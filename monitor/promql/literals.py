"""PromQL literals with Go semantics: numbers and quoted strings (durations:
``lossguard.common.config.parse_duration``)."""

from __future__ import annotations

import re

_SIMPLE_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


def parse_number(text: str) -> float:
    """A number as Go's ``ParseInt(s, 0, 64)`` then ``ParseFloat`` read it (0x hex, 0 octal)."""
    if re.fullmatch(r"0[xX][0-9a-fA-F]+", text):
        return float(int(text, 16))
    if re.fullmatch(r"0[0-7]+", text):
        return float(int(text, 8))
    if not re.fullmatch(r"[0-9]*\.?[0-9]*(?:[eE][+-]?[0-9]+)?|[iI][nN][fF]|[nN][aA][nN]", text):
        raise ValueError(f"invalid number {text!r}")
    return float(text)


def unquote(text: str) -> str:
    """The value of a quoted PromQL string: ``"..."`` or ``'...'`` with Go escapes, or raw
    ``\\`...\\```."""
    quote, body = text[:1], text[1:-1]
    if len(text) < 2 or text[-1] != quote or quote not in "\"'`":
        raise ValueError("unterminated quoted string")
    if quote == "`":
        return body
    out: list[str] = []
    i = 0
    while i < len(body):
        if body[i] != "\\":
            out.append(body[i])
            i += 1
            continue
        escape = body[i + 1 : i + 2]
        if escape in _SIMPLE_ESCAPES or escape in ("\\", quote):
            out.append(_SIMPLE_ESCAPES.get(escape, escape))
            i += 2
        elif escape in _HEX_ESCAPES:
            digits = body[i + 2 : i + 2 + _HEX_ESCAPES[escape]]
            if len(digits) != _HEX_ESCAPES[escape] or not re.fullmatch(r"[0-9a-fA-F]+", digits):
                raise ValueError(f"invalid escape \\{escape}{digits}")
            out.append(chr(int(digits, 16)))
            i += 2 + len(digits)
        elif re.fullmatch(r"[0-3][0-7][0-7]", body[i + 1 : i + 4]):
            out.append(chr(int(body[i + 1 : i + 4], 8)))
            i += 4
        else:
            raise ValueError(f"unknown escape sequence \\{escape}")
    return "".join(out)
