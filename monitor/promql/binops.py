"""Binary operators on scalars and instant vectors (Prometheus 2.42 engine.go semantics)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

from lossguard.monitor.promql import gofloat
from lossguard.monitor.promql.errors import EvaluationError
from lossguard.monitor.promql.model import (
    METRIC_NAME,
    Labels,
    Sample,
    drop_metric_name,
    format_labels,
)
from lossguard.monitor.promql.nodes import VectorMatching

ARITHMETIC: dict[str, Callable[[float, float], float]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": gofloat.divide,
    "%": gofloat.modulo,
    "^": gofloat.power,
}
COMPARISON: dict[str, Callable[[float, float], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    "<": operator.lt,
    ">=": operator.ge,
    "<=": operator.le,
}


def scalar_binop(op: str, lhs: float, rhs: float) -> float:
    """Scalar op scalar; comparisons (which need ``bool``) give 1 or 0."""
    if op in COMPARISON:
        return 1.0 if COMPARISON[op](lhs, rhs) else 0.0
    return ARITHMETIC[op](lhs, rhs)


def _element(op: str, lhs: float, rhs: float) -> tuple[float, bool]:
    """(value, keep): arithmetic always keeps; a comparison keeps the lhs value if true."""
    if op in COMPARISON:
        return lhs, COMPARISON[op](lhs, rhs)
    return ARITHMETIC[op](lhs, rhs), True


def vector_scalar(
    op: str, vector: Sequence[Sample], scalar: float, swap: bool, return_bool: bool
) -> list[Sample]:
    """Vector op scalar (``swap``: scalar op vector). Filters keep the vector's value."""
    out = []
    for sample in vector:
        lhs, rhs = (scalar, sample.value) if swap else (sample.value, scalar)
        value, keep = _element(op, lhs, rhs)
        if op in COMPARISON:
            value = sample.value
        if return_bool:
            value, keep = (1.0 if keep else 0.0), True
        if keep:
            drop = op in ARITHMETIC or return_bool
            labels = drop_metric_name(sample.labels) if drop else sample.labels
            out.append(Sample(labels, value))
    return out


def signature(labels: Labels, matching: VectorMatching) -> Labels:
    """The labels two samples must share to match: ``on`` these, or all but ``ignoring``
    these and the metric name."""
    if matching.on:
        return tuple(p for p in labels if p[0] in matching.labels)
    return tuple(p for p in labels if p[0] not in matching.labels and p[0] != METRIC_NAME)


def vector_vector(
    op: str,
    lhs: Sequence[Sample],
    rhs: Sequence[Sample],
    matching: VectorMatching,
    return_bool: bool,
) -> list[Sample]:
    """Arithmetic or comparison with one-to-one matching."""
    if not lhs or not rhs:
        return []
    right: dict[Labels, Sample] = {}
    for sample in rhs:
        sig = signature(sample.labels, matching)
        if sig in right:
            raise EvaluationError(
                f"found duplicate series for the match group {format_labels(sig)} on the right "
                f"hand-side of the operation: [{format_labels(sample.labels)}, "
                f"{format_labels(right[sig].labels)}];many-to-many matching not allowed: "
                "matching labels must be unique on one side"
            )
        right[sig] = sample
    matched: set[Labels] = set()
    out = []
    for sample in lhs:
        sig = signature(sample.labels, matching)
        other = right.get(sig)
        if other is None:
            continue
        value, keep = _element(op, sample.value, other.value)
        if return_bool:
            value = 1.0 if keep else 0.0
        elif not keep:
            continue
        if sig in matched:
            raise EvaluationError(
                "multiple matches for labels: many-to-one matching must be explicit "
                "(group_left/group_right)"
            )
        matched.add(sig)
        out.append(Sample(_result_labels(sample.labels, op, matching, return_bool), value))
    return out


def _result_labels(labels: Labels, op: str, matching: VectorMatching, return_bool: bool) -> Labels:
    if op in ARITHMETIC or return_bool:
        labels = drop_metric_name(labels)
    if matching.on:
        return tuple(p for p in labels if p[0] in matching.labels)
    return tuple(p for p in labels if p[0] not in matching.labels)


def set_operation(
    op: str, lhs: Sequence[Sample], rhs: Sequence[Sample], matching: VectorMatching
) -> list[Sample]:
    """``and`` / ``or`` / ``unless``, matching on signatures (many-to-many)."""
    right = {signature(s.labels, matching) for s in rhs}
    if op == "and":
        return [s for s in lhs if signature(s.labels, matching) in right]
    if op == "unless":
        return [s for s in lhs if signature(s.labels, matching) not in right]
    left = {signature(s.labels, matching) for s in lhs}
    return [*lhs, *(s for s in rhs if signature(s.labels, matching) not in left)]
