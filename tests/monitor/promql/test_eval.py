"""The evaluator's building blocks: the in-memory storage, staleness and lookback, the series
notation, RE2 regexes, Go float semantics and evaluation errors."""

from __future__ import annotations

import math

import pytest

from lossguard.monitor.promql import (
    STALE_NAN,
    EvaluationError,
    Matcher,
    MemoryStorage,
    Sample,
    evaluate,
    expand_values,
    format_labels,
    is_stale,
    make_labels,
    parse,
    parse_series,
)
from lossguard.monitor.promql.re2 import compile_re2


def _values(storage: MemoryStorage, expr: str, t: float) -> list[float]:
    result = evaluate(expr, storage, t)
    assert isinstance(result, list)
    return [sample.value for sample in result]


def test_memory_storage_orders_replaces_and_truncates() -> None:
    storage = MemoryStorage()
    for t, value in [(20, 2.0), (0, 0.0), (10, 1.0), (10, 1.5), (30, 3.0)]:
        storage.add({"__name__": "x", "job": "a", "empty": ""}, t, value)
    storage.add((("__name__", "x"), ("job", "b")), 5, 9.0)
    ((labels, samples),) = storage.select([Matcher("job", "=", "a")], 10_000, 30_000)
    assert labels == make_labels({"__name__": "x", "job": "a"})
    assert samples == [(10_000, 1.5), (20_000, 2.0), (30_000, 3.0)]
    assert [key for key, _ in storage.select([Matcher("empty", "=", "")], 0, 100_000)] == [
        labels,
        make_labels({"__name__": "x", "job": "b"}),
    ]
    storage.truncate(before=15)
    assert [(key, s) for key, s in storage.select([Matcher("__name__", "=", "x")], 0, 100_000)] == [
        (labels, [(20_000, 2.0), (30_000, 3.0)])
    ]


def test_staleness_ends_a_series_and_lookback_is_five_minutes() -> None:
    storage = MemoryStorage()
    storage.add({"__name__": "up"}, 0, 1.0)
    storage.mark_stale({"__name__": "up"}, 10)
    storage.add({"__name__": "up"}, 20, 2.0)
    assert _values(storage, "up", 5) == [1.0]
    assert _values(storage, "up", 10) == []
    assert _values(storage, "up", 20) == [2.0]
    assert _values(storage, "up", 320) == [2.0]  # exactly 5 minutes old: still there
    assert _values(storage, "up", 320.001) == []
    assert _values(storage, "max_over_time(up[15s])", 20) == [2.0]  # stale marker skipped
    assert _values(storage, "changes(up[1m])", 30) == [1.0]


def test_stale_marker_is_not_any_nan() -> None:
    assert is_stale(STALE_NAN) and math.isnan(STALE_NAN)
    assert not is_stale(math.nan) and not is_stale(0.0)


@pytest.mark.parametrize(
    ("text", "values"),
    [
        ("0+10x3", [0.0, 10.0, 20.0, 30.0]),
        ("1x2 _ 4", [1.0, 1.0, 1.0, None, 4.0]),
        ("_x3 1-0.5x2", [None, None, None, 1.0, 0.5, 0.0]),
        ("-Inf +Inf 1e3 .5", [-math.inf, math.inf, 1000.0, 0.5]),
    ],
)
def test_expand_values(text: str, values: list[float | None]) -> None:
    assert expand_values(text) == values


def test_expand_values_stale_nan_and_errors() -> None:
    stale, nan = expand_values("stale NaN")
    assert stale is not None and is_stale(stale)
    assert nan is not None and math.isnan(nan) and not is_stale(nan)
    with pytest.raises(ValueError, match="invalid series value"):
        expand_values("1 two")


def test_parse_series() -> None:
    assert parse_series('a{b="c", d="e\\"f"} 1 2') == (
        make_labels({"__name__": "a", "b": "c", "d": 'e"f'}),
        " 1 2",
    )
    assert parse_series("ns:metric:rate5m 0+1x3") == ((("__name__", "ns:metric:rate5m"),), " 0+1x3")
    assert parse_series('{job="x"}') == ((("job", "x"),), "")


def test_format_labels() -> None:
    assert format_labels(make_labels({"__name__": "up", "job": 'a"b'})) == 'up{job="a\\"b"}'
    assert format_labels((("__name__", "up"),)) == "up"
    assert format_labels(()) == "{}"


@pytest.mark.parametrize(
    ("pattern", "matches", "rejects"),
    [
        ("((?i)PRO).*", ["production", "PROD"], ["xproduction"]),
        ("a(?i)b|c", ["aB", "C"], ["AB", "ac"]),
        ("[[:alpha:]]+[[:digit:]]", ["abc1"], ["abc", "1"]),
        ("\\d+", ["123"], ["١٢٣"]),  # RE2 classes are ASCII
        ("a.c", ["abc"], ["a\nc"]),
        ("x\\z", ["x"], ["x\n"]),
    ],
)
def test_re2_regexes(pattern: str, matches: list[str], rejects: list[str]) -> None:
    regex = compile_re2(pattern)
    assert all(regex.fullmatch(text) for text in matches)
    assert not any(regex.fullmatch(text) for text in rejects)


@pytest.mark.parametrize("pattern", ["(?=a)", "(?<!a)b", "(a)\\1", "\\pL", "[[:nope:]]", "(?U)a"])
def test_re2_refuses_what_re2_refuses(pattern: str) -> None:
    with pytest.raises(ValueError):
        compile_re2(pattern)


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("1 % 0", math.nan),
        ("-7 % 3", -1.0),
        ("1 / 0", math.inf),
        ("-1 / 0", -math.inf),
        ("0 ^ -1", math.inf),
        ("(-0) ^ -1", -math.inf),
        ("(-8) ^ 0.5", math.nan),
        ("2 ^ 1024", math.inf),
        ("(-2) ^ 1025", -math.inf),
        ("NaN ^ 0", 1.0),
        ("time()", 1.5),
        ("scalar(vector(2))", 2.0),
    ],
)
def test_scalar_arithmetic_follows_go(expr: str, value: float) -> None:
    result = evaluate(expr, MemoryStorage(), 1.5)
    assert isinstance(result, float)
    assert (math.isnan(result) and math.isnan(value)) or result == value


def test_absent_reports_the_fixed_labels() -> None:
    storage = MemoryStorage()
    result = evaluate('absent(x{job="a", env="prod", env="dev", zone=~"z1"})', storage, 0)
    assert result == [Sample((("job", "a"),), 1.0)]
    assert evaluate(parse("absent_over_time(x[5m])"), storage, 0) == [Sample((), 1.0)]


def test_evaluation_errors() -> None:
    storage = MemoryStorage()
    for name in ("a", "b"):
        storage.add({"__name__": name, "job": "x"}, 0, 1.0)
    storage.add({"__name__": "c", "job": "x", "i": "1"}, 0, 1.0)
    storage.add({"__name__": "c", "job": "x", "i": "2"}, 0, 1.0)
    with pytest.raises(EvaluationError, match="vector cannot contain metrics with the same"):
        evaluate('-{__name__=~"a|b"}', storage, 0)
    with pytest.raises(EvaluationError, match="found duplicate series for the match group"):
        evaluate("a + on(job) c", storage, 0)
    with pytest.raises(EvaluationError, match="many-to-one matching must be explicit"):
        evaluate("c + on(job) a", storage, 0)
    assert evaluate("c > on(job) (a * 2)", storage, 0) == []  # filtered before the check


def test_topk_and_bottomk_keep_whole_samples_in_prometheus_order() -> None:
    """Each group's k samples with their metric name, highest (lowest) first, groups in order
    of first appearance; NaN is the first dropped; k is truncated toward zero, below 1 empty."""
    storage = MemoryStorage()
    values = {"0": 3.0, "1": 1.0, "2": 4.0, "3": 1.5, "4": math.nan, "5": 9.0, "6": 2.0}
    for rank, value in values.items():
        storage.add({"__name__": "mfu", "rank": rank, "node": "n" + str(int(rank) % 2)}, 0, value)

    def ranks(expr: str) -> list[tuple[str, float]]:
        result = evaluate(expr, storage, 0)
        assert isinstance(result, list)
        assert all(dict(s.labels)["__name__"] == "mfu" for s in result)
        return [(dict(s.labels)["rank"], s.value) for s in result]

    assert ranks("topk(3, mfu)") == [("5", 9.0), ("2", 4.0), ("0", 3.0)]
    assert ranks("bottomk(3, mfu)") == [("1", 1.0), ("3", 1.5), ("6", 2.0)]
    assert ranks("topk by (node) (1, mfu)") == [("2", 4.0), ("5", 9.0)]
    assert ranks("bottomk(2.9, mfu) by (node)") == [("6", 2.0), ("0", 3.0), ("1", 1.0), ("3", 1.5)]
    assert ranks("topk(8, mfu)")[-1][0] == "4" and math.isnan(ranks("topk(8, mfu)")[-1][1])
    assert ranks("bottomk(8, mfu)")[-1][0] == "4"
    assert ranks("topk(0.9, mfu)") == ranks("topk(-1, mfu)") == []
    assert ranks('topk(scalar(mfu{rank="1"}), mfu)') == [("5", 9.0)]
    with pytest.raises(EvaluationError, match="Scalar value NaN overflows int64"):
        evaluate('topk(scalar(mfu{rank="4"}), mfu)', storage, 0)
    with pytest.raises(EvaluationError, match=r"Scalar value 1e\+19 overflows int64"):
        evaluate("bottomk(1e19, mfu)", storage, 0)
