"""Label matchers: ``=``, ``!=``, ``=~``, ``!~`` (regexes are anchored, RE2 syntax)."""

from __future__ import annotations

from dataclasses import dataclass

from lossguard.monitor.promql.re2 import compile_re2

MATCH_OPS = ("=", "!=", "=~", "!~")


@dataclass(frozen=True)
class Matcher:
    """Matches the value of label ``name`` ("" when the label is absent)."""

    name: str
    op: str
    value: str

    def __post_init__(self) -> None:
        if self.op not in MATCH_OPS:
            raise ValueError(f"unknown match operator {self.op!r}")
        if self.op in ("=~", "!~"):
            compile_re2(self.value)

    def matches(self, value: str) -> bool:
        if self.op == "=":
            return value == self.value
        if self.op == "!=":
            return value != self.value
        found = compile_re2(self.value).fullmatch(value) is not None
        return found if self.op == "=~" else not found
