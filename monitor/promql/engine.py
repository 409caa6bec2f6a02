"""Instant evaluation of a parsed expression against a :class:`Storage`."""

from __future__ import annotations

import math

from lossguard.monitor.promql.aggregation import aggregate
from lossguard.monitor.promql.binops import (
    scalar_binop,
    set_operation,
    vector_scalar,
    vector_vector,
)
from lossguard.monitor.promql.errors import EvaluationError
from lossguard.monitor.promql.model import (
    METRIC_NAME,
    Labels,
    Sample,
    drop_metric_name,
    make_labels,
)
from lossguard.monitor.promql.nodes import (
    Aggregation,
    Binary,
    Call,
    Expr,
    MatrixSelector,
    NumberLiteral,
    Unary,
    VectorMatching,
    VectorSelector,
)
from lossguard.monitor.promql.parser import SET_OPERATORS, parse
from lossguard.monitor.promql.rangefuncs import RANGE_FUNCTIONS, Point, Window
from lossguard.monitor.promql.storage import Storage, is_stale

LOOKBACK_MS = 5 * 60 * 1000
"""How far back an instant selector looks for a sample (Prometheus's default lookback delta)."""

Value = float | list[Sample]


def evaluate(expr: str | Expr, storage: Storage, t: float) -> Value:
    """Evaluate ``expr`` at ``t`` (seconds): a scalar, or an instant vector.

    Raises :class:`PromQLError` (parse errors, unsupported syntax, evaluation errors).
    """
    node = parse(expr) if isinstance(expr, str) else expr
    return _Evaluator(storage, round(t * 1000)).eval(node)


def absent_labels(selector: VectorSelector) -> Labels:
    """The labels ``absent()`` reports: those fixed by ``=`` matchers, unless a label is
    matched more than once."""
    fixed: dict[str, str] = {}
    dropped: set[str] = set()
    for matcher in selector.matchers:
        if matcher.name == METRIC_NAME:
            continue
        if matcher.op == "=" and matcher.name not in fixed:
            fixed[matcher.name] = matcher.value
        else:
            dropped.add(matcher.name)
    return make_labels((k, v) for k, v in fixed.items() if k not in dropped)


class _Evaluator:
    def __init__(self, storage: Storage, ts_ms: int) -> None:
        self.storage = storage
        self.ts = ts_ms

    def eval(self, node: Expr) -> Value:
        if isinstance(node, NumberLiteral):
            return node.value
        if isinstance(node, VectorSelector):
            return self.instant(node)
        if isinstance(node, Call):
            return self.call(node)
        if isinstance(node, Aggregation):
            param = None if node.param is None else self.scalar(node.param)
            vector = self.vector(node.expr)
            return _unique(aggregate(node.op, vector, node.grouping, node.without, param))
        if isinstance(node, Unary):
            operand = self.eval(node.expr)
            if isinstance(operand, float):
                return -operand
            return _unique([Sample(drop_metric_name(s.labels), -s.value) for s in operand])
        if isinstance(node, Binary):
            return self.binary(node)
        raise EvaluationError(f"cannot evaluate a {type(node).__name__} here")

    def vector(self, node: Expr) -> list[Sample]:
        value = self.eval(node)
        assert isinstance(value, list), "the parser admits only vectors here"
        return value

    def scalar(self, node: Expr) -> float:
        value = self.eval(node)
        assert isinstance(value, float), "the parser admits only scalars here"
        return value

    def select(
        self, selector: VectorSelector, start_ms: int, end_ms: int, *, latest: bool = False
    ) -> list[tuple[Labels, list[Point]]]:
        """Series by labels with their samples (staleness markers included) in the window;
        with ``latest``, only each series' last sample in it."""
        return list(self.storage.select(list(selector.matchers), start_ms, end_ms, latest=latest))

    def instant(self, selector: VectorSelector) -> list[Sample]:
        """The latest sample at most the lookback old, unless it is a staleness marker."""
        end = self.ts - selector.offset_ms
        return [
            Sample(labels, points[-1][1])
            for labels, points in self.select(selector, end - LOOKBACK_MS, end, latest=True)
            if points and not is_stale(points[-1][1])
        ]

    def call(self, node: Call) -> Value:
        if node.name == "time":
            return self.ts / 1000
        arg = node.args[0]
        if isinstance(arg, MatrixSelector):
            return self.range_call(node.name, arg)
        if node.name == "vector":
            return [Sample((), self.scalar(arg))]
        vector = self.vector(arg)
        if node.name == "scalar":
            return vector[0].value if len(vector) == 1 else math.nan
        if vector:  # absent()
            return []
        return [Sample(absent_labels(arg) if isinstance(arg, VectorSelector) else (), 1.0)]

    def range_call(self, name: str, matrix: MatrixSelector) -> list[Sample]:
        start = self.ts - matrix.selector.offset_ms - matrix.range_ms
        window = Window(start, start + matrix.range_ms)
        series = []
        for labels, points in self.select(matrix.selector, window.start_ms, window.end_ms):
            fresh = [p for p in points if p[1] == p[1] or not is_stale(p[1])]
            if fresh:
                series.append((labels, fresh))
        if name == "absent_over_time":
            return [] if series else [Sample(absent_labels(matrix.selector), 1.0)]
        function = RANGE_FUNCTIONS[name]
        out = []
        for labels, points in series:
            value = function(points, window)
            if value is not None:
                out.append(Sample(drop_metric_name(labels), value))
        return _unique(out)

    def binary(self, node: Binary) -> Value:
        lhs, rhs = self.eval(node.lhs), self.eval(node.rhs)
        if isinstance(lhs, float) and isinstance(rhs, float):
            return scalar_binop(node.op, lhs, rhs)
        if isinstance(lhs, float):
            assert isinstance(rhs, list)
            return _unique(vector_scalar(node.op, rhs, lhs, True, node.return_bool))
        if isinstance(rhs, float):
            return _unique(vector_scalar(node.op, lhs, rhs, False, node.return_bool))
        matching = node.matching or VectorMatching()
        if node.op in SET_OPERATORS:
            return _unique(set_operation(node.op, lhs, rhs, matching))
        return _unique(vector_vector(node.op, lhs, rhs, matching, node.return_bool))


def _unique(vector: list[Sample]) -> list[Sample]:
    """Prometheus refuses a result with two samples of the same label set."""
    if len({s.labels for s in vector}) != len(vector):
        raise EvaluationError("vector cannot contain metrics with the same labelset")
    return vector
