"""Alertmanager's label matchers: ``name="value"``, ``!=``, ``=~``, ``!~``, as routes, inhibition
rules and silences write them.

Follows Alertmanager 0.25's ``pkg/labels`` (parse.go, matcher.go), quirks included: names may
hold colons; the value may be unquoted, surrounding whitespace is dropped; in a quoted value
``\\"``, ``\\n`` and ``\\\\`` are escapes and any other backslash is literal; a list is
``{a="b", c=~"d"}`` with optional braces and a trailing comma. Regexes are RE2, anchored as
``^(?:regex)$``. An absent label matches as the empty string.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lossguard.monitor.promql.re2 import compile_re2

OPS = ("=", "!=", "=~", "!~")  # in Alertmanager's MatchType order (used when sorting)
_GO_SPACE = "[\t\n\f\r ]"  # RE2's \s
_MATCHER = re.compile(
    rf"{_GO_SPACE}*([a-zA-Z_:][a-zA-Z0-9_:]*){_GO_SPACE}*(=~|=|!=|!~){_GO_SPACE}*(.*?){_GO_SPACE}*",
    re.DOTALL,
)
# Go's unicode.IsSpace, which strings.TrimSpace strips from the last item of a list.
_UNICODE_SPACE = "\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000" + "".join(
    chr(c) for c in range(0x2000, 0x200B)
)
_UNESCAPE = {"n": "\n", '"': '"', "\\": "\\"}
_ESCAPE = str.maketrans({"\\": "\\\\", "\n": "\\n", '"': '\\"'})


@dataclass(frozen=True)
class Matcher:
    """Matches the value of label ``name`` ("" when the alert does not have it). Not the PromQL
    label matcher: Alertmanager pastes the regex into ``^(?:...)$`` as text, so ``a)|(b`` is a
    valid (unanchored) pattern here, and amtool agrees."""

    name: str
    op: str
    value: str

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown match operator {self.op!r}")
        if self.op in ("=~", "!~"):
            _regex(self.value)

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.name, "")
        if self.op == "=":
            return value == self.value
        if self.op == "!=":
            return value != self.value
        found = _regex(self.value).search(value) is not None
        return found if self.op == "=~" else not found

    def __str__(self) -> str:
        """``name="value"`` with ``\\``, newline and ``"`` escaped, as Alertmanager prints it."""
        return f'{self.name}{self.op}"{self.value.translate(_ESCAPE)}"'

    def sort_key(self) -> tuple[str, str, int]:
        """Alertmanager's order of matchers (``Matchers.Less``): name, value, operator."""
        return self.name, self.value, OPS.index(self.op)


def _regex(value: str) -> re.Pattern[str]:
    """Alertmanager compiles ``^(?:value)$``; matched with ``search`` (``$`` is ``\\z``)."""
    try:
        return compile_re2(f"^(?:{value})\\z")
    except ValueError as exc:
        raise ValueError(f"invalid regex {value!r}: {exc}") from None


def parse_matcher(text: str) -> Matcher:
    """One matcher (Alertmanager's ``ParseMatcher``); ValueError naming the text and why."""
    try:
        return _parse(text)
    except ValueError as exc:
        raise ValueError(f"bad matcher {text!r}: {exc}") from None


def parse_matchers(texts: Sequence[str]) -> list[Matcher]:
    """The matchers of each text, which may be one matcher or a ``{a="b", c=~"d"}`` list
    (Alertmanager's ``ParseMatchers``, as in the ``matchers:`` of a route)."""
    matchers: list[Matcher] = []
    for text in texts:
        for item in _split(text):
            try:
                matchers.append(_parse(item))
            except ValueError as exc:
                where = "" if item == text else f"{item!r}: "
                raise ValueError(f"bad matcher {text!r}: {where}{exc}") from None
    return matchers


def matches_all(matchers: Sequence[Matcher], labels: Mapping[str, str]) -> bool:
    return all(m.matches(labels) for m in matchers)


def format_matchers(matchers: Sequence[Matcher]) -> str:
    """``{a="b",c=~"d"}``: Alertmanager's ``Matchers.String()`` (no space after the comma)."""
    return "{" + ",".join(str(m) for m in matchers) + "}"


def _parse(text: str) -> Matcher:
    found = _MATCHER.fullmatch(text)
    if found is None:
        if not text.strip():
            raise ValueError("empty matcher")
        raise ValueError("expected a label name, one of = != =~ !~, and a value")
    name, op, raw = found.groups()
    quoted = raw.startswith('"')
    if quoted:
        raw = raw[1:]
    value: list[str] = []
    escaped, closed = False, not quoted
    for i, char in enumerate(raw):
        last = i == len(raw) - 1
        if escaped:
            escaped = False
            value.append(_UNESCAPE.get(char, "\\" + char))
        elif char == "\\" and not last:
            escaped = True
        elif char == '"':
            if closed or not last:
                raise ValueError('unescaped " in the value (write \\")')
            closed = True
        else:
            value.append(char)
    if not closed:
        raise ValueError('the value has no closing "')
    return Matcher(name, op, "".join(value))


def _split(text: str) -> list[str]:
    """The items of a list at the commas outside double quotes (as ParseMatchers does)."""
    body = text.removeprefix("{").removesuffix("}")
    items: list[str] = []
    item: list[str] = []
    inside = escaped = False
    for char in body:
        if char == "," and not inside:
            items.append("".join(item))
            item = []
            continue
        if char == '"':
            inside = inside if escaped else not inside
            escaped = False
        elif char == "\\":
            escaped = not escaped
        elif char != ",":  # a quoted comma leaves `escaped` as it was, as in Alertmanager
            escaped = False
        item.append(char)
    last = "".join(item).strip(_UNICODE_SPACE)
    return [*items, last] if last else items
