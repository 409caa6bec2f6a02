"""The syntax tree of the supported subset (parentheses leave no node; positions don't compare)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

from lossguard.monitor.promql.matchers import Matcher


class ValueType(str, Enum):
    SCALAR = "scalar"
    VECTOR = "instant vector"
    MATRIX = "range vector"
    STRING = "string"


@dataclass(frozen=True)
class NumberLiteral:
    value: float
    pos: int = field(default=0, compare=False)
    type = ValueType.SCALAR


@dataclass(frozen=True)
class VectorSelector:
    """``name{matchers} offset ...``; ``matchers`` include ``__name__="name"``."""

    name: str | None
    matchers: tuple[Matcher, ...]
    offset_ms: int = 0
    pos: int = field(default=0, compare=False)
    type = ValueType.VECTOR


@dataclass(frozen=True)
class MatrixSelector:
    """``selector[range]``, only as the argument of a range function."""

    selector: VectorSelector
    range_ms: int
    pos: int = field(default=0, compare=False)
    type = ValueType.MATRIX


@dataclass(frozen=True)
class Call:
    name: str
    args: tuple[Expr, ...]
    type: ValueType
    pos: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Aggregation:
    """``op by|without (grouping) ([param,] expr)``; ``param`` (a scalar) for topk and bottomk."""

    op: str
    expr: Expr
    grouping: tuple[str, ...] = ()
    without: bool = False
    param: Expr | None = None
    pos: int = field(default=0, compare=False)
    type = ValueType.VECTOR


@dataclass(frozen=True)
class Unary:
    """Negation of an instant vector (negated numbers fold into literals; unary + vanishes)."""

    expr: Expr
    pos: int = field(default=0, compare=False)
    op = "-"

    @property
    def type(self) -> ValueType:
        return self.expr.type


@dataclass(frozen=True)
class VectorMatching:
    """``on(labels)`` or ``ignoring(labels)``; no modifier is ``ignoring()``."""

    on: bool = False
    labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class Binary:
    """``lhs op [bool] [on|ignoring(...)] rhs``; ``matching`` only between two vectors."""

    op: str
    lhs: Expr
    rhs: Expr
    return_bool: bool = False
    matching: VectorMatching | None = None
    pos: int = field(default=0, compare=False)

    @property
    def type(self) -> ValueType:
        scalars = self.lhs.type == self.rhs.type == ValueType.SCALAR
        return ValueType.SCALAR if scalars else ValueType.VECTOR


Expr = NumberLiteral | VectorSelector | MatrixSelector | Call | Aggregation | Unary | Binary


def walk(node: Expr) -> Iterator[Expr]:
    """``node`` and every node under it, depth first (a range's selector included)."""
    yield node
    children: tuple[Expr, ...] = ()
    if isinstance(node, Binary):
        children = (node.lhs, node.rhs)
    elif isinstance(node, Aggregation):
        children = (node.expr,) if node.param is None else (node.param, node.expr)
    elif isinstance(node, Unary):
        children = (node.expr,)
    elif isinstance(node, Call):
        children = node.args
    elif isinstance(node, MatrixSelector):
        children = (node.selector,)
    for child in children:
        yield from walk(child)
