"""Differential test against promtool 2.42: the embedded evaluator computes every expression
below at several times on the same input series, those results become the expected samples of
one promtool rule unit test, and ``promtool test rules`` must agree with every one of them
(promtool compares values exactly, so each float must be bit-identical).

NaN never equals itself in promtool's comparison, so a result holding NaN is checked through
``(e) != bool (e)`` (which samples are NaN) and ``(e) == (e)`` (the others, exactly). Where the
evaluator raises, promtool must report an error for that expression and time, and nothing else.
Aggregations only ever add up to two non-integer values: promtool loads series in random order
and float addition is not associative.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from lossguard.monitor.promql import (
    EvaluationError,
    Labels,
    MemoryStorage,
    evaluate,
    expand_values,
    parse,
    parse_series,
)
from lossguard.monitor.promql.aggregation import group_labels
from lossguard.monitor.promql.nodes import Aggregation, Binary, Call, walk
from lossguard.monitor.promql.parser import PRECEDENCE
from lossguard.monitor.promql.signatures import AGGREGATIONS, FUNCTIONS

pytestmark = pytest.mark.live

INTERVAL_S = 60
SERIES = {
    # counters: resets, gaps, staleness markers, a late start, a series that ends (lookback)
    'requests_total{job="api", instance="a"}': "0+10x5 3+7x6 _x3 40+5x10",
    'requests_total{job="api", instance="b"}': "100+1x30",
    'requests_total{job="web", instance="a"}': "1 2 3 stale 4+1x5 _ _ 20 0 0 1 stale _x3 7+3x8",
    'requests_total{job="web", instance="c"}': "_x12 5+2.5x18",
    'big_total{instance="a"}': "1000+10x30",
    'small_total{instance="a"}': "1+100x30",
    # gauges: negatives, fractions, NaN, a gap
    'temperature{job="api", instance="a"}': "20.5 21.25 -3.5 19 NaN 18 17.75 0 0 2.5x5 -1-0.5x10",
    'temperature{job="api", instance="b"}': "10 10 10 _x5 12 11.5 11.5 13 -2 0.1+0.2x12",
    'up{job="api", instance="a"}': "1x10 0x5 1x10",
    'up{job="api", instance="b"}': "1x5",  # last sample at 5m: gone after 10m
    'up{job="web", instance="a"}': "1x30",
    'limit{job="api"}': "50x30",
    'limit{job="web"}': "5x12 0x10",
    'ratio{instance="a"}': "1 0 -2 0.5 0 3x20",
    # label values for regex matchers and quoting
    'http_requests_total{path="/api/v1", code="200"}': "0+5x30",
    'http_requests_total{path="/API/V2", code="500"}': "0+1x30",
    r'http_requests_total{path="/say \"hi\"", code="404"}': "3x30",
}
EVAL_TIMES_S = (0, 60, 150, 300, 360, 420, 600, 690, 900, 1200, 1260, 1500, 1800, 2100)

EXPRESSIONS = [
    # selectors, matchers, offset, lookback, staleness
    "requests_total",
    'requests_total{job="api"}',
    'requests_total{instance!="a"}',
    'requests_total{job=~"a.*"}',
    'requests_total{job!~"a.*", instance="a"}',
    '{__name__=~"requests_total|up", job="web"}',
    '{__name__=~".+_total", instance=~"a|c"}',
    "requests_total offset 2m",
    "up offset -3m",
    "temperature",
    'http_requests_total{path=~"/api/.*"}',
    'http_requests_total{path=~"(?i)/api/.*"}',
    'http_requests_total{path=~"/A(?i)pi/v[[:digit:]]|/say.*"}',
    r'http_requests_total{code=~"[45]..|2\\d\\d", code!~"4.*"}',
    r'http_requests_total{path="/say \"hi\""}',
    # range functions, range boundaries, offsets
    "rate(requests_total[1m])",
    "rate(requests_total[90s])",
    "rate(requests_total[5m])",
    "rate(requests_total[10m] offset 5m)",
    "increase(requests_total[2m])",
    "increase(requests_total[5m])",
    "increase(requests_total[15m])",
    "rate(big_total[5m])",
    "increase(big_total[3m])",
    "increase(small_total[5m])",
    "rate(small_total[20m])",
    "delta(temperature[5m])",
    "delta(temperature[2m] offset 1m)",
    "delta(requests_total[10m])",
    "changes(requests_total[10m])",
    "changes(temperature[5m])",
    "resets(requests_total[10m])",
    "resets(temperature[15m])",
    "max_over_time(temperature[5m])",
    "min_over_time(temperature[5m])",
    "avg_over_time(temperature[5m])",
    "avg_over_time(requests_total[3m])",
    "max_over_time(requests_total[1m] offset 1m)",
    'absent_over_time(requests_total{job="nope"}[5m])',
    'absent_over_time(requests_total{job="web", instance="a"}[2m])',
    'absent_over_time(up{job="api", instance="b"}[5m])',
    # absent, time, vector, scalar
    'absent(nonexistent{job="x", instance=~"a", env="prod", env="dev"})',
    'absent(up{job="api", instance="b"})',
    "absent(sum(nonexistent))",
    "absent(rate(requests_total[1m]))",
    "time()",
    "vector(time())",
    'scalar(up{job="web"})',
    "scalar(up)",
    "vector(scalar(limit) * 2)",
    # arithmetic
    "requests_total + 1",
    "2 * requests_total",
    "requests_total / 3",
    "requests_total % 7",
    "-requests_total % 7",
    "2 ^ up",
    "temperature ^ 2",
    "temperature - temperature offset 1m",
    "requests_total / on(job, instance) up",
    'requests_total{instance="b"} - ignoring(job) requests_total{instance="b"} offset 1m',
    "ratio / 0",
    "-ratio / 0",
    "0 / ratio",
    "ratio % 0",
    "1 + 2 * 3 - 4 / 2 % 3",
    "2 ^ 3 ^ 2",
    "-2 ^ 2",
    "(1 + 2) * -3",
    "7 % -3",
    "-7 % 3",
    "1 / 0",
    "-1 / 0",
    "0 / 0",
    "(-8) ^ 0.5",
    "0 ^ -1",
    "time() % 120",
    "-temperature",
    "- - temperature",
    # comparisons
    "requests_total > 50",
    "requests_total > bool 50",
    "50 < requests_total",
    "50 < bool requests_total",
    "temperature == 10",
    "temperature != bool 10",
    "temperature <= 0",
    "temperature >= bool 0",
    "requests_total >= on(job, instance) requests_total offset 1m",
    "up == bool on(job, instance) up offset 5m",
    'requests_total{instance="b"} < ignoring(instance) limit * 3',
    "1 > bool 0",
    "1 == bool 1",
    "time() >= bool 600",
    # set operators
    "requests_total and up == 1",
    "requests_total unless on(job) up == 0",
    "temperature or up",
    "up or on(instance) limit",
    'requests_total{job="api"} and ignoring(instance) limit',
    "limit unless on(job) requests_total",
    "temperature > 5 or temperature < 0 and up",
    # aggregations
    "sum(up)",
    "sum by (job) (requests_total)",
    "sum(requests_total) without (instance)",
    "avg by (job) (requests_total)",
    "max(temperature)",
    "min without (job) (temperature)",
    "count(up == 1)",
    "count by (job) (up)",
    'sum by (__name__) ({__name__=~"up|limit"})',
    "max by (job) (rate(requests_total[5m]))",
    "avg without (instance) (requests_total)",
    "sum by (code) (rate(http_requests_total[5m]))",
    # topk and bottomk (evaluated where no two values of a group tie: promtool loads the series
    # in random order, which decides between equal values)
    "topk(2, requests_total)",
    "bottomk(2, requests_total)",
    "topk by (job) (1, requests_total)",
    "bottomk without (instance) (1, temperature)",
    "topk(3, temperature)",
    "topk(1, rate(requests_total[5m]))",
    "bottomk(2.9, -temperature) > -15",
    'topk(scalar(limit{job="web"}), http_requests_total)',
    "topk(-1, requests_total)",
    "count(topk by (job) (2, requests_total))",
    # combinations
    "sum by (job) (rate(requests_total[5m])) / on(job) limit",
    "max_over_time(temperature[10m]) - min_over_time(temperature[10m])",
    "-rate(requests_total[2m])",
    "increase(requests_total[10m] offset 5m) > bool 20",
    "sum by (job) (increase(requests_total[5m])) > 10 and on(job) limit",
    # evaluation errors
    "requests_total - ignoring(job) requests_total offset 1m",
    "requests_total < ignoring(job) limit * 3",
    '-{__name__=~"big_total|small_total"}',
    'rate({__name__=~"big_total|small_total"}[5m])',
    "limit + on() up",
]
_FAILURE = re.compile(r'expr: "((?:[^"\\]|\\.)*)", time: ([0-9a-z]+),( err:)?')


def _labels_text(labels: Labels) -> str:
    """promtool's exp_samples notation, the metric name as a plain label."""
    return "{" + ", ".join(f"{name}={json.dumps(value)}" for name, value in labels) + "}"


def _exp_samples(result: float | list[Any]) -> list[dict[str, Any]]:
    if isinstance(result, float):
        return [{"labels": "{}", "value": result}]
    return [{"labels": _labels_text(s.labels), "value": s.value} for s in result]


def _has_nan(result: float | list[Any]) -> bool:
    values = [result] if isinstance(result, float) else [s.value for s in result]
    return any(math.isnan(v) for v in values)


def _storage() -> MemoryStorage:
    storage = MemoryStorage()
    for series, values in SERIES.items():
        labels, rest = parse_series(series)
        assert not rest.strip()
        for step, value in enumerate(expand_values(values)):
            if value is not None:
                storage.add(labels, step * INTERVAL_S, value)
    return storage


def _duration(seconds: int) -> str:
    """promtool's rendering of an eval_time (below an hour)."""
    minutes, rest = divmod(seconds, 60)
    return (f"{minutes}m" if minutes else "") + (f"{rest}s" if rest or not minutes else "")


def _expression_tests(storage: MemoryStorage) -> tuple[list[dict[str, Any]], set[tuple[str, str]]]:
    """The promql_expr_test entries, and the (expression, time) pairs that must fail."""
    tests: list[dict[str, Any]] = []
    errors: set[tuple[str, str]] = set()
    for expr in EXPRESSIONS:
        for t in EVAL_TIMES_S:
            if _ties(expr, storage, t):
                continue
            try:
                result = evaluate(expr, storage, t)
            except EvaluationError:
                errors.add((expr, _duration(t)))
                tests.append({"expr": expr, "eval_time": _duration(t), "exp_samples": []})
                continue
            queries = [expr]
            if _has_nan(result):
                queries = [f"({expr}) != bool ({expr})"]
                if not isinstance(result, float):
                    queries.append(f"({expr}) == ({expr})")
            for query in queries:
                result = evaluate(query, storage, t)
                assert not _has_nan(result), query
                tests.append(
                    {"expr": query, "eval_time": _duration(t), "exp_samples": _exp_samples(result)}
                )
    return tests, errors


def _ties(expr: str, storage: MemoryStorage, t: int) -> bool:
    """Whether a topk or bottomk in ``expr`` chooses between equal values (NaN included) of a
    group at ``t``: their order in storage decides, which promtool draws at random."""
    for node in walk(parse(expr)):
        if not isinstance(node, Aggregation) or node.op not in ("topk", "bottomk"):
            continue
        try:
            vector = evaluate(node.expr, storage, t)
        except EvaluationError:
            continue
        assert isinstance(vector, list)
        seen = set()
        for sample in vector:
            key = (group_labels(sample.labels, node.grouping, node.without), repr(sample.value))
            if key in seen:
                return True
            seen.add(key)
    return False


def test_expressions_cover_the_subset() -> None:
    nodes = [n for expr in EXPRESSIONS for n in walk(parse(expr))]
    functions = {n.name for n in nodes if isinstance(n, Call)}
    operators = {n.op for n in nodes if isinstance(n, Binary)}
    aggregations = {n.op for n in nodes if isinstance(n, Aggregation)}
    assert functions == set(FUNCTIONS)
    assert operators == set(PRECEDENCE) - {"atan2"}
    assert aggregations == set(AGGREGATIONS)


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed")
    version = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    if "version 2.42" not in version.stdout + version.stderr:
        pytest.skip("the differential test targets promtool 2.42")
    return path


def test_promtool_agrees(promtool: str, tmp_path: Path) -> None:
    tests, errors = _expression_tests(_storage())
    assert len(tests) >= len(EXPRESSIONS) * len(EVAL_TIMES_S)
    assert 30 <= len(errors) <= 100
    (tmp_path / "rules.yml").write_text("groups: []\n")
    unit_test = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": f"{INTERVAL_S}s",
                "input_series": [{"series": s, "values": v} for s, v in SERIES.items()],
                "promql_expr_test": tests,
            }
        ],
    }
    path = tmp_path / "promql_test.yml"
    path.write_text(yaml.safe_dump(unit_test, sort_keys=False))
    run = subprocess.run(
        [promtool, "test", "rules", path.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = run.stdout + run.stderr
    failures = {(json.loads(f'"{e}"'), t, bool(err)) for e, t, err in _FAILURE.findall(output)}
    assert failures == {(expr, t, True) for expr, t in errors}, output[-8000:]
    assert run.returncode == 1
