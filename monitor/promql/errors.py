"""PromQL errors: one line each, with the line:column of the offending part where known."""

from __future__ import annotations


class PromQLError(ValueError):
    """An expression that cannot be parsed, lies outside the subset, or fails to evaluate."""

    def __init__(self, message: str, expr: str = "", pos: int | None = None) -> None:
        self.message = message
        self.expr = expr
        self.pos = pos
        super().__init__(f"{self.location}: {message}" if pos is not None else message)

    @property
    def location(self) -> str:
        """``line:column`` (both from 1) of the error in the expression."""
        before = self.expr[: self.pos or 0]
        return f"{before.count(chr(10)) + 1}:{len(before) - before.rfind(chr(10))}"


class ParseError(PromQLError):
    """Not valid PromQL (syntax or types)."""


class UnsupportedError(PromQLError):
    """Valid PromQL that the embedded evaluator does not implement."""


class EvaluationError(PromQLError):
    """The expression failed at evaluation time (e.g. duplicate output series)."""
