"""The series notation of promtool rule tests and Prometheus test files.

``metric{a="b"}`` names a series. ``0+10x3 _ stale 5 1-1x2`` expands to values: ``a+bxN`` (or
``a-bxN``) is N+1 values from ``a`` in steps of ``b``, ``axN`` repeats ``a`` N+1 times, ``_`` is a
missing sample (``_xN``: N of them) and ``stale`` a staleness marker.
"""

from __future__ import annotations

import re

from lossguard.monitor.promql.errors import ParseError
from lossguard.monitor.promql.lexer import IDENT, STRING, Token, tokens
from lossguard.monitor.promql.literals import unquote
from lossguard.monitor.promql.model import METRIC_NAME, Labels, make_labels
from lossguard.monitor.promql.storage import STALE_NAN

_NUMBER = r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[iI][nN][fF]|[nN][aA][nN]"
_ITEM = re.compile(rf"(?P<start>[+-]?(?:{_NUMBER}))(?:(?P<step>[+-](?:{_NUMBER}))?x(?P<n>[0-9]+))?")
_MISSING = re.compile(r"_(?:x(?P<n>[0-9]+))?")


def parse_series(text: str) -> tuple[Labels, str]:
    """The label set that starts ``text`` (``metric{a="b"}``, ``metric`` or ``{a="b"}``) and
    the text after it."""
    lexer = tokens(text)
    pairs: dict[str, str] = {}
    token = next(lexer)
    if token.kind == IDENT:
        pairs[METRIC_NAME] = token.text
        end = token.pos + len(token.text)
        if not text[end:].lstrip().startswith("{"):
            return make_labels(pairs), text[end:]
        token = next(lexer)
    _expect(token, "{", text)
    while (token := next(lexer)).kind != "}":
        name = _expect(token, IDENT, text).text
        _expect(next(lexer), "=", text)
        pairs[name] = unquote(_expect(next(lexer), STRING, text).text)
        if (token := next(lexer)).kind == "}":
            break
        _expect(token, ",", text)
    return make_labels(pairs), text[token.pos + 1 :]


def _expect(token: Token, kind: str, text: str) -> Token:
    if token.kind != kind:
        raise ParseError(f'unexpected {token.describe()} (expected "{kind}")', text, token.pos)
    return token


def expand_values(text: str) -> list[float | None]:
    """The values of the notation, one per step; ``None`` where a sample is missing."""
    values: list[float | None] = []
    for item in text.split():
        if item == "stale":
            values.append(STALE_NAN)
        elif missing := _MISSING.fullmatch(item):
            values.extend([None] * int(missing["n"] or 1))
        elif match := _ITEM.fullmatch(item):
            value, step = float(match["start"]), float(match["step"] or 0)
            for _ in range(int(match["n"]) + 1 if match["n"] else 1):
                values.append(value)
                value += step
        else:
            raise ValueError(f"invalid series value {item!r}")
    return values
