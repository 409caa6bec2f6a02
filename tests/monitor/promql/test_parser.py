"""Parsing the PromQL subset: precedence, literals, selectors, and the one-line refusals of
everything outside the subset."""

from __future__ import annotations

import math

import pytest

from lossguard.monitor.promql import (
    Matcher,
    ParseError,
    PromQLError,
    UnsupportedError,
    check,
    parse,
)
from lossguard.monitor.promql.nodes import (
    Aggregation,
    Binary,
    Call,
    MatrixSelector,
    NumberLiteral,
    Unary,
    VectorMatching,
    VectorSelector,
)


@pytest.mark.parametrize(
    ("expr", "explicit"),
    [
        ("a + b * c", "a + (b * c)"),
        ("a * b + c", "(a * b) + c"),
        ("a - b - c", "(a - b) - c"),
        ("a / b % c * d", "((a / b) % c) * d"),
        ("2 ^ 3 ^ 2", "2 ^ (3 ^ 2)"),
        ("-a ^ 2", "-(a ^ 2)"),
        ("-a * b", "(-a) * b"),
        ("a ^ -b * c", "(a ^ (-b)) * c"),
        ("a or b and c", "a or (b and c)"),
        ("a and b unless c", "(a and b) unless c"),
        ("a > b + 1 and c", "(a > (b + 1)) and c"),
        ("a == bool b or c < 1", "(a == bool b) or (c < 1)"),
        ("a + b offset 5m", "a + (b offset 5m)"),
        ("SUM(a) BY (x) + b", "(sum by (x) (a)) + b"),
        ("sum without (x) (a)", "sum(a) without (x)"),
        ("a AND ON (x) b", "a and on(x) b"),
        ("rate((a[5m]))", "rate(a[5m])"),
        ("- - 1", "1"),
        ("+a", "a"),
    ],
)
def test_precedence_and_equivalent_forms(expr: str, explicit: str) -> None:
    assert parse(expr) == parse(explicit)


def test_tree_shape() -> None:
    tree = parse('sum by (job) (rate(http_total{code=~"5.."}[5m] offset 1m)) > bool 0.5')
    selector = VectorSelector(
        "http_total",
        (Matcher("code", "=~", "5.."), Matcher("__name__", "=", "http_total")),
        offset_ms=60_000,
    )
    call = Call("rate", (MatrixSelector(selector, 300_000),), Aggregation.type)
    expected = Binary(">", Aggregation("sum", call, ("job",)), NumberLiteral(0.5), True)
    assert tree == expected
    assert parse("a / ignoring(x) b") == Binary(
        "/", parse("a"), parse("b"), matching=VectorMatching(False, ("x",))
    )
    assert parse("-a") == Unary(parse("a"))


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("12.34e6", 12.34e6),
        (".2", 0.2),
        ("2.", 2.0),
        ("0x1F", 31.0),
        ("010", 8.0),  # Go reads a leading 0 as octal
        ("-0.2e-6", -0.2e-6),
        ("inF", math.inf),
        ("-Inf", -math.inf),
    ],
)
def test_number_literals(expr: str, value: float) -> None:
    node = parse(expr)
    assert isinstance(node, NumberLiteral) and node.value == value


def test_nan_and_durations() -> None:
    nan = parse("NaN")
    assert isinstance(nan, NumberLiteral) and math.isnan(nan.value)
    call = parse("rate(a[1h30m] offset -1d)")
    assert isinstance(call, Call)
    matrix = call.args[0]
    assert isinstance(matrix, MatrixSelector)
    assert (matrix.range_ms, matrix.selector.offset_ms) == (5_400_000, -86_400_000)


def test_selectors_and_strings() -> None:
    node = parse('{__name__=~"a|b", job!=\'x\\\'y\', path=`C:\\dir`, env!~"dev.*",}')
    assert isinstance(node, VectorSelector) and node.name is None
    assert [(m.name, m.op, m.value) for m in node.matchers] == [
        ("__name__", "=~", "a|b"),
        ("job", "!=", "x'y"),
        ("path", "=", "C:\\dir"),
        ("env", "!~", "dev.*"),
    ]
    assert parse('job:rate5m{on="x"}') == VectorSelector(
        "job:rate5m", (Matcher("on", "=", "x"), Matcher("__name__", "=", "job:rate5m"))
    )
    assert parse("# a comment\nup # another\n") == parse("up")


@pytest.mark.parametrize(
    ("expr", "what", "supported"),
    [
        ("histogram_quantile(0.9, rate(a[5m]))", "function histogram_quantile", "rate, increase"),
        ("label_replace(a, 'dst', '$1', 'src', '(.*)')", "function label_replace", "scalar"),
        ("quantile(0.9, a)", "aggregation quantile", "sum, min, max, avg, count, topk, bottomk"),
        ("a * on(x) group_left(y) b", "group_left", "one-to-one vector matching"),
        ("a / ignoring(x) group_right b", "group_right", "one-to-one"),
        ("max_over_time(rate(a[5m])[1h:])", "subqueries", "range selectors"),
        ("a @ 100", "the @ modifier", "offset"),
        ("a atan2 b", "operator atan2", "the operators"),
        ('"text"', "string literals", "label matchers"),
        ("a[5m]", "a range vector result", "scalar or an instant vector"),
    ],
)
def test_refusals_name_the_unsupported_part(expr: str, what: str, supported: str) -> None:
    with pytest.raises(UnsupportedError) as caught:
        check(expr)
    message = str(caught.value)
    assert "\n" not in message
    assert f": unsupported PromQL: {what} (" in message
    assert supported in message and "source: prometheus" in message


def test_refusal_message_in_full() -> None:
    with pytest.raises(UnsupportedError) as caught:
        check("sum(rate(a[5m]))\n  / histogram_quantile(0.9, b)")
    assert str(caught.value) == (
        "2:5: unsupported PromQL: function histogram_quantile (the embedded evaluator supports "
        "the functions rate, increase, delta, changes, resets, max_over_time, min_over_time, "
        "avg_over_time, absent_over_time, absent, time, vector, scalar; use source: prometheus "
        "to evaluate it)"
    )
    assert caught.value.pos == 21 and caught.value.location == "2:5"


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("rate(a[5m]", 'unexpected end of input (expected "," or ")")'),
        ('a{job="x"', 'unexpected end of input (expected "}" or a label matcher)'),
        ("a +", "unexpected end of input"),
        ("a b", 'unexpected identifier "b"'),
        ("no_such_fn(a)", 'unknown function with name "no_such_fn"'),
        ("RATE(a[5m])", 'unknown function with name "RATE"'),
        ("1 > 2", "comparisons between scalars must use BOOL modifier"),
        ("a + bool b", "bool modifier can only be used on comparison operators"),
        ("rate(a)", 'expected type range vector in call to function "rate", got instant vector'),
        ("absent(a[5m])", 'expected type instant vector in call to function "absent", got range'),
        ("time(a)", 'expected 0 argument(s) in call to "time", got 1'),
        ("rate(a[5m],)", "trailing commas not allowed in function call args"),
        ("sum(1)", "expected type instant vector in aggregation expression, got scalar"),
        ("sum(a, b)", "expected 1, got 2"),
        (
            "topk(a)",
            "wrong number of arguments for aggregate expression provided, expected 2, got 1",
        ),
        ("bottomk(a, b)", "expected type scalar in aggregation parameter, got instant vector"),
        ("topk(1, 2)", "expected type instant vector in aggregation expression, got scalar"),
        ("a[5m] + 1", "binary expression must contain only scalar and instant vector types"),
        ("-a[5m]", "unary expression only allowed on expressions of type scalar or instant"),
        ("1 and a", 'set operator "and" not allowed in binary scalar expression'),
        ("a + on(x) 1", "vector matching only allowed between instant vectors"),
        ("a offset 5m offset 1m", "offset may not be set multiple times"),
        ("a offset 5m [5m]", "no offset modifiers allowed before range"),
        ("(a)[5m]", "ranges only allowed for vector selectors"),
        ("sum(a) offset 5m", "offset modifier must be preceded on an instant vector selector"),
        ("a[0s]", "duration must be greater than 0"),
        ("a[5]", 'unexpected number "5" (expected a duration)'),
        ("a[5x]", "bad number or duration syntax"),
        ("a[1m30h]", "not a valid duration string"),
        ("{}", "vector selector must contain at least one non-empty matcher"),
        ('{a=""}', "vector selector must contain at least one non-empty matcher"),
        ('a{__name__="b"}', 'metric name must not be set twice: "a" or "b"'),
        ('a{b=~"("}', "invalid regular expression"),
        ('a{b=~"(?=x)"}', "invalid regular expression"),
        ('a{b:c="x"}', 'invalid label name "b:c"'),
        ('a{b="x\\q"}', "unknown escape sequence \\q"),
        ('a{b="x}', "unterminated quoted string"),
        ("a ! b", 'unexpected character "!"'),
        ("by", 'unexpected identifier "by"'),
    ],
)
def test_parse_errors(expr: str, message: str) -> None:
    with pytest.raises(ParseError) as caught:
        parse(expr)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_errors_are_value_errors_with_a_position() -> None:
    with pytest.raises(ValueError) as caught:
        check("sum(a)\n  by (x) +")
    error = caught.value
    assert isinstance(error, PromQLError) and not isinstance(error, UnsupportedError)
    assert str(error) == "2:11: unexpected end of input"
