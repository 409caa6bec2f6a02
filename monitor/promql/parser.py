"""Parse PromQL into :mod:`nodes`; valid PromQL outside the subset is refused by name."""

from __future__ import annotations

import re

from lossguard.common.config import parse_duration
from lossguard.monitor.promql import signatures as sig
from lossguard.monitor.promql.errors import ParseError, UnsupportedError
from lossguard.monitor.promql.lexer import DURATION, EOF, IDENT, NUMBER, STRING, Token, tokens
from lossguard.monitor.promql.literals import parse_number, unquote
from lossguard.monitor.promql.matchers import MATCH_OPS, Matcher
from lossguard.monitor.promql.model import METRIC_NAME
from lossguard.monitor.promql.nodes import (
    Aggregation,
    Binary,
    Call,
    Expr,
    MatrixSelector,
    NumberLiteral,
    Unary,
    ValueType,
    VectorMatching,
    VectorSelector,
)

PRECEDENCE = {"or": 1, "and": 2, "unless": 2, "==": 3, "!=": 3, ">": 3, "<": 3, ">=": 3, "<=": 3}
PRECEDENCE |= {"+": 4, "-": 4, "*": 5, "/": 5, "%": 5, "atan2": 5, "^": 6}
COMPARISONS = frozenset(("==", "!=", ">", "<", ">=", "<="))
SET_OPERATORS = frozenset(("and", "or", "unless"))
_UNARY_OPERAND = PRECEDENCE["^"]  # unary minus binds like *: its operand only holds ^
_KEYWORDS = frozenset(("by", "without", "on", "ignoring", "group_left", "group_right", "bool"))
_KEYWORDS |= {"offset", "and", "or", "unless", "atan2"}
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_VALUES = (ValueType.SCALAR, ValueType.VECTOR)


def parse(expr: str) -> Expr:
    """The syntax tree of ``expr``; raises :class:`ParseError` or :class:`UnsupportedError`."""
    return _Parser(expr).parse()


def check(expr: str) -> None:
    """Raise unless ``expr`` is valid PromQL inside the subset."""
    parse(expr)


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = list(tokens(text))
        self.index = 0

    # -- token helpers -------------------------------------------------------------------------

    @property
    def tok(self) -> Token:
        return self.tokens[self.index]

    def advance(self) -> Token:
        token = self.tok
        self.index = min(self.index + 1, len(self.tokens) - 1)
        return token

    def is_keyword(self, *words: str) -> bool:
        return self.tok.kind == IDENT and self.tok.text.lower() in words

    def expect(self, kind: str, context: str = "") -> Token:
        if self.tok.kind != kind:
            raise self.unexpected(context or f'expected "{kind}"')
        return self.advance()

    def error(self, message: str, pos: int) -> ParseError:
        return ParseError(message, self.text, pos)

    def unexpected(self, context: str = "") -> ParseError:
        suffix = f" ({context})" if context else ""
        return self.error(f"unexpected {self.tok.describe()}{suffix}", self.tok.pos)

    def unsupported(self, what: str, supported: str, pos: int) -> UnsupportedError:
        return UnsupportedError(sig.refusal(what, supported), self.text, pos)

    # -- grammar -------------------------------------------------------------------------------

    def parse(self) -> Expr:
        node = self.expression(0)
        if self.tok.kind != EOF:
            raise self.unexpected()
        if node.type not in _VALUES:
            raise self.unsupported(f"a {node.type.value} result", sig.SUPPORTS_RESULTS, node.pos)
        return node

    def expression(self, min_precedence: int) -> Expr:
        lhs = self.unary()
        while (op := self.binary_operator()) and PRECEDENCE[op] >= min_precedence:
            op_token = self.advance()
            if op == "atan2":
                raise self.unsupported("operator atan2", sig.SUPPORTS_OPERATORS, op_token.pos)
            return_bool = self.is_keyword("bool")
            if return_bool:
                self.advance()
                if op not in COMPARISONS:
                    raise self.error(
                        "bool modifier can only be used on comparison operators", op_token.pos
                    )
            matching = None
            if self.is_keyword("on", "ignoring"):
                on = self.advance().text.lower() == "on"
                matching = VectorMatching(on, self.label_list())
            if self.is_keyword("group_left", "group_right"):
                what = f"{self.tok.text.lower()} (many-to-one matching)"
                raise self.unsupported(what, sig.SUPPORTS_MATCHING, self.tok.pos)
            rhs = self.expression(PRECEDENCE[op] + (op != "^"))
            lhs = self.binary(op, lhs, rhs, return_bool, matching, op_token.pos)
        return lhs

    def binary_operator(self) -> str | None:
        text = self.tok.text.lower() if self.tok.kind == IDENT else self.tok.kind
        return text if text in PRECEDENCE else None

    def binary(
        self,
        op: str,
        lhs: Expr,
        rhs: Expr,
        return_bool: bool,
        matching: VectorMatching | None,
        pos: int,
    ) -> Binary:
        if op in COMPARISONS and not return_bool and lhs.type == rhs.type == ValueType.SCALAR:
            raise self.error("comparisons between scalars must use BOOL modifier", pos)
        for side in (lhs, rhs):
            if side.type not in _VALUES:
                message = "binary expression must contain only scalar and instant vector types"
                raise self.error(message, side.pos)
        if ValueType.SCALAR in (lhs.type, rhs.type):
            if matching and matching.labels:
                raise self.error("vector matching only allowed between instant vectors", pos)
            if op in SET_OPERATORS:
                raise self.error(
                    f'set operator "{op}" not allowed in binary scalar expression', pos
                )
            return Binary(op, lhs, rhs, return_bool, None, pos)
        return Binary(op, lhs, rhs, return_bool, matching or VectorMatching(), pos)

    def unary(self) -> Expr:
        if self.tok.kind not in ("+", "-"):
            return self.postfix()
        op = self.advance()
        operand = self.expression(_UNARY_OPERAND)
        if operand.type not in _VALUES:
            message = (
                "unary expression only allowed on expressions of type scalar or instant vector"
            )
            raise self.error(message, op.pos)
        if op.kind == "+":
            return operand
        if isinstance(operand, NumberLiteral):
            return NumberLiteral(-operand.value, op.pos)
        return Unary(operand, op.pos)

    def postfix(self) -> Expr:
        node, parenthesized = self.primary()
        while True:
            if self.tok.kind == "[":
                node = self.range_selector(node, parenthesized)
            elif self.is_keyword("offset"):
                node = self.offset(node, parenthesized)
            elif self.tok.kind == "@":
                raise self.unsupported("the @ modifier", sig.SUPPORTS_OFFSET, self.tok.pos)
            else:
                return node
            parenthesized = False

    def range_selector(self, node: Expr, parenthesized: bool) -> MatrixSelector:
        bracket = self.advance()
        range_ms = self.duration()
        if self.tok.kind == ":":
            raise self.unsupported("subqueries", sig.SUPPORTS_RANGES, bracket.pos)
        self.expect("]")
        if parenthesized or not isinstance(node, VectorSelector):
            raise self.error("ranges only allowed for vector selectors", bracket.pos)
        if node.offset_ms:
            raise self.error("no offset modifiers allowed before range", bracket.pos)
        return MatrixSelector(node, range_ms, node.pos)

    def offset(self, node: Expr, parenthesized: bool) -> Expr:
        keyword = self.advance()
        negative = self.tok.kind == "-"
        if negative:
            self.advance()
        offset_ms = -self.duration() if negative else self.duration()
        selector = node.selector if isinstance(node, MatrixSelector) else node
        if parenthesized or not isinstance(selector, VectorSelector):
            message = (
                "offset modifier must be preceded on an instant vector selector or range vector "
                "selector or a subquery"
            )
            raise self.error(message, keyword.pos)
        if selector.offset_ms:
            raise self.error("offset may not be set multiple times", keyword.pos)
        shifted = VectorSelector(selector.name, selector.matchers, offset_ms, selector.pos)
        if isinstance(node, MatrixSelector):
            return MatrixSelector(shifted, node.range_ms, node.pos)
        return shifted

    def duration(self) -> int:
        token = self.expect(DURATION, "expected a duration")
        try:
            milliseconds = parse_duration(token.text)
        except ValueError as exc:
            raise self.error(str(exc), token.pos) from None
        if milliseconds <= 0:
            raise self.error("duration must be greater than 0", token.pos)
        return milliseconds

    def primary(self) -> tuple[Expr, bool]:
        """The next operand and whether it was parenthesised."""
        token = self.tok
        if token.kind == NUMBER:
            self.advance()
            try:
                return NumberLiteral(parse_number(token.text), token.pos), False
            except ValueError as exc:
                raise self.error(str(exc), token.pos) from None
        if token.kind == STRING:
            raise self.unsupported("string literals", "strings only in label matchers", token.pos)
        if token.kind == "(":
            self.advance()
            node = self.expression(0)
            self.expect(")")
            return node, True
        if token.kind == "{":
            return self.selector(None, token.pos), False
        if token.kind != IDENT or token.text.lower() in _KEYWORDS:
            raise self.unexpected()
        word = token.text.lower()
        if word in sig.AGGREGATIONS or word in sig.UNSUPPORTED_AGGREGATIONS:
            return self.aggregation(), False
        if self.tokens[self.index + 1].kind == "(":
            return self.call(), False
        self.advance()
        return self.selector(token.text, token.pos), False

    def selector(self, name: str | None, pos: int) -> VectorSelector:
        matchers: list[Matcher] = []
        if self.tok.kind == "{":
            self.advance()
            while self.tok.kind != "}":
                matchers.append(self.matcher(name))
                if self.tok.kind != ",":
                    break
                self.advance()
            self.expect("}", 'expected "}" or a label matcher')
        if name is not None:
            matchers.append(Matcher(METRIC_NAME, "=", name))
        if all(m.matches("") for m in matchers):
            raise self.error("vector selector must contain at least one non-empty matcher", pos)
        return VectorSelector(name, tuple(matchers), pos=pos)

    def matcher(self, metric: str | None) -> Matcher:
        label = self.expect(IDENT, "expected a label name")
        if not _LABEL_NAME.fullmatch(label.text):
            raise self.error(f'invalid label name "{label.text}"', label.pos)
        if self.tok.kind not in MATCH_OPS:
            raise self.unexpected("expected one of =, !=, =~, !~")
        op = self.advance().kind
        value = self.string(self.expect(STRING, "expected a quoted label value"))
        if metric is not None and label.text == METRIC_NAME:
            raise self.error(
                f'metric name must not be set twice: "{metric}" or "{value}"', label.pos
            )
        try:
            return Matcher(label.text, op, value)
        except ValueError as exc:
            raise self.error(f"invalid regular expression {value!r}: {exc}", label.pos) from None

    def string(self, token: Token) -> str:
        try:
            return unquote(token.text)
        except ValueError as exc:
            raise self.error(str(exc), token.pos) from None

    def label_list(self) -> tuple[str, ...]:
        self.expect("(", "expected a label list")
        labels: list[str] = []
        while self.tok.kind != ")":
            label = self.expect(IDENT, "expected a label name")
            if not _LABEL_NAME.fullmatch(label.text):
                raise self.error(f'invalid label name "{label.text}"', label.pos)
            labels.append(label.text)
            if self.tok.kind != ",":
                break
            self.advance()
        self.expect(")")
        return tuple(labels)

    def grouping(self) -> tuple[tuple[str, ...], bool] | None:
        if not self.is_keyword("by", "without"):
            return None
        without = self.advance().text.lower() == "without"
        return self.label_list(), without

    def arguments(self) -> list[Expr]:
        self.expect("(")
        args: list[Expr] = []
        while self.tok.kind != ")":
            args.append(self.expression(0))
            if self.tok.kind != ",":
                break
            comma = self.advance()
            if self.tok.kind == ")":
                raise self.error("trailing commas not allowed in function call args", comma.pos)
        self.expect(")", 'expected "," or ")"')
        return args

    def aggregation(self) -> Aggregation:
        token = self.advance()
        op = token.text.lower()
        if op in sig.UNSUPPORTED_AGGREGATIONS:
            raise self.unsupported(f"aggregation {op}", sig.SUPPORTS_AGGREGATIONS, token.pos)
        grouping = self.grouping()
        args = self.arguments()
        grouping = grouping or self.grouping()
        wanted = 2 if op in sig.PARAMETER_AGGREGATIONS else 1
        if len(args) != wanted:
            message = "wrong number of arguments for aggregate expression provided"
            raise self.error(f"{message}, expected {wanted}, got {len(args)}", token.pos)
        expr, param = args[-1], (args[0] if wanted == 2 else None)
        if expr.type != ValueType.VECTOR:
            message = "expected type instant vector in aggregation expression"
            raise self.error(f"{message}, got {expr.type.value}", expr.pos)
        if param is not None and param.type != ValueType.SCALAR:
            message = "expected type scalar in aggregation parameter"
            raise self.error(f"{message}, got {param.type.value}", param.pos)
        labels, without = grouping or ((), False)
        return Aggregation(op, expr, labels, without, param, token.pos)

    def call(self) -> Call:
        token = self.advance()
        name = token.text
        if name in sig.UNSUPPORTED_FUNCTIONS:
            raise self.unsupported(f"function {name}", sig.SUPPORTS_FUNCTIONS, token.pos)
        if name not in sig.FUNCTIONS:
            raise self.error(f'unknown function with name "{name}"', token.pos)
        params, result = sig.FUNCTIONS[name]
        args = self.arguments()
        if len(args) != len(params):
            message = f'expected {len(params)} argument(s) in call to "{name}", got {len(args)}'
            raise self.error(message, token.pos)
        for param, arg in zip(params, args, strict=True):
            if arg.type != param:
                message = f'expected type {param.value} in call to function "{name}"'
                raise self.error(f"{message}, got {arg.type.value}", arg.pos)
        return Call(name, tuple(args), result, token.pos)
