"""Go RE2 regular expressions on Python's ``re``: the translation label matchers need.

RE2 scopes a mid-pattern ``(?i)`` to the rest of its group, which Python rejects, and knows
POSIX classes (``[[:alpha:]]``) and ``\\z``. Python-only syntax (look-around, backreferences)
is refused, as RE2 refuses it. Character classes are ASCII, as in RE2 (``re.ASCII``).
"""

from __future__ import annotations

import functools
import re

_POSIX = {
    "alnum": "0-9A-Za-z",
    "alpha": "A-Za-z",
    "ascii": "\\x00-\\x7f",
    "blank": "\\t ",
    "cntrl": "\\x00-\\x1f\\x7f",
    "digit": "0-9",
    "graph": "!-~",
    "lower": "a-z",
    "print": " -~",
    "punct": "!-/:-@\\[-`{-~",
    "space": "\\t\\n\\v\\f\\r ",
    "upper": "A-Z",
    "word": "0-9A-Za-z_",
    "xdigit": "0-9A-Fa-f",
}
_FLAG_GROUP = re.compile(r"\(\?([ims]*)(?:-([ims]*))?([:)])")
_NAMED_GROUP = re.compile(r"\(\?P<[A-Za-z_][A-Za-z0-9_]*>")
_BAD_ESCAPES = set("pPQEC123456789")


@functools.lru_cache(maxsize=1024)
def compile_re2(pattern: str) -> re.Pattern[str]:
    """Compile an RE2 pattern for ``fullmatch`` (Prometheus anchors label regexes).

    Raises ``ValueError`` for patterns that RE2 or this translation rejects.
    """
    try:
        return re.compile(_translate(pattern), re.ASCII)
    except re.error as exc:
        raise ValueError(str(exc)) from None


def _translate(pattern: str) -> str:
    out: list[str] = []
    scopes: list[list[str]] = [[]]  # per open group: flags scoped to the rest of that group
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            out.append(_escape(pattern[i : i + 2]))
            i += 2
        elif char == "[":
            end = _class_end(pattern, i)
            out.append(_char_class(pattern[i:end]))
            i = end
        elif char == "(":
            flags = _FLAG_GROUP.match(pattern, i)
            named = _NAMED_GROUP.match(pattern, i)
            if flags and flags.group(3) == ")":
                scoped = flags.group(1) + (f"-{flags.group(2)}" if flags.group(2) else "")
                scopes[-1].append(scoped)
                out.append(f"(?{scoped}:")
                i = flags.end()
                continue
            if pattern.startswith("(?", i) and not flags and not named:
                raise ValueError(f"unsupported group syntax at position {i}")
            match = flags or named
            out.append(match.group(0) if match else "(")
            i = match.end() if match else i + 1
            scopes.append([])
        elif char == ")":
            out.append(")" * len(scopes.pop() if len(scopes) > 1 else []) + ")")
            i += 1
        elif char == "|":
            out.append(")" * len(scopes[-1]) + "|" + "".join(f"(?{f}:" for f in scopes[-1]))
            i += 1
        else:
            out.append(char)
            i += 1
    out.append(")" * len(scopes[0]))
    return "".join(out)


def _escape(escape: str) -> str:
    if escape[1:] in _BAD_ESCAPES:
        raise ValueError(f"unsupported escape {escape}")
    return "\\Z" if escape == "\\z" else escape


def _class_end(pattern: str, start: int) -> int:
    """Index just past the ``]`` closing the class that opens at ``start``."""
    i = start + 1
    if pattern.startswith("^", i):
        i += 1
    if pattern.startswith("]", i):
        i += 1
    while i < len(pattern):
        if pattern[i] == "\\":
            i += 2
        elif pattern.startswith("[:", i) and (close := pattern.find(":]", i + 2)) != -1:
            i = close + 2
        elif pattern[i] == "]":
            return i + 1
        else:
            i += 1
    raise ValueError("missing closing ]")


def _char_class(text: str) -> str:
    body = text[1:-1]
    negated = body.startswith("^")
    out: list[str] = ["[^" if negated else "["]
    i = 1 if negated else 0
    while i < len(body):
        if body[i] == "\\":
            out.append(_escape(body[i : i + 2]))
            i += 2
        elif body.startswith("[:", i) and (close := body.find(":]", i + 2)) != -1:
            name = body[i + 2 : close]
            if name not in _POSIX:
                raise ValueError(f"invalid character class [:{name}:]")
            out.append(_POSIX[name])
            i = close + 2
        else:
            out.append("\\" + body[i] if body[i] in "[&~|" else body[i])
            i += 1
    return "".join(out) + "]"
