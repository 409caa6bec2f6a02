"""Prometheus's own PromQL engine tests (v2.42.0 testdata, read in place) against the embedded
evaluator: every case inside the subset must pass; cases outside it are only counted.

The test-file format: ``load <step>`` with series in the expanding notation, ``eval instant at
<time> <expr>`` (``eval_ordered``, ``eval_fail``) with the expected samples, ``clear``.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from lossguard.common.config import parse_duration
from lossguard.monitor.promql import (
    EvaluationError,
    Labels,
    MemoryStorage,
    UnsupportedError,
    check,
    evaluate,
    expand_values,
    format_labels,
    parse_series,
)

TESTDATA = Path(__file__).resolve().parents[4] / "shared" / "conformance" / "promql-v2.42.0"
MIN_IN_SUBSET = 250  # what the subset covers today; fewer means the subset shrank

_EVAL = re.compile(r"^eval(?:_(fail|ordered))?\s+instant\s+(?:at\s+(.+?))?\s+(.+)$")
_EPSILON = 0.000001  # relative, as Prometheus's test.go
_MIN_NORMAL = 2.2250738585072014e-308


@dataclass(frozen=True)
class Load:
    step_ms: int
    series: tuple[tuple[Labels, tuple[float | None, ...]], ...]


@dataclass(frozen=True)
class Case:
    file: str
    line: int
    expr: str
    at_ms: int
    fail: bool
    ordered: bool
    expected: tuple[tuple[Labels | None, float], ...]  # labels None: a scalar
    history: tuple[Load, ...]  # every load since the last clear

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def in_subset(self) -> bool:
        try:
            check(self.expr)
        except UnsupportedError:
            return False
        return True


def _number(text: str) -> float | None:
    """Go's ParseInt(s, 0, 64) then ParseFloat, as test.go reads an expected scalar."""
    try:
        return float(int(text, 0))
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return None


def read_cases(path: Path) -> list[Case]:
    lines = [line.strip() for line in path.read_text().splitlines()]
    lines = ["" if line.startswith("#") else line for line in lines]
    cases: list[Case] = []
    history: tuple[Load, ...] = ()
    i = 0
    while i < len(lines):
        line, i = lines[i], i + 1
        if not line:
            continue
        command = line.split()[0].lower()
        if command == "clear":
            history = ()
        elif command == "load":
            series: dict[Labels, tuple[float | None, ...]] = {}
            while i < len(lines) and lines[i]:
                labels, values = parse_series(lines[i])
                series[labels] = tuple(expand_values(values))
                i += 1
            history = (*history, Load(parse_duration(line.split()[1]), tuple(series.items())))
        elif match := _EVAL.match(line):
            start = i
            expected: list[tuple[Labels | None, float]] = []
            while i < len(lines) and lines[i]:
                entry, i = lines[i], i + 1
                if (scalar := _number(entry)) is not None:
                    expected.append((None, scalar))
                    break
                labels, values = parse_series(entry)
                (value,) = expand_values(values)
                assert value is not None
                expected.append((labels, value))
            cases.append(
                Case(
                    file=path.name,
                    line=start,
                    expr=match[3],
                    at_ms=parse_duration(match[2] or "0"),
                    fail=match[1] == "fail",
                    ordered=match[1] == "ordered",
                    expected=tuple(expected),
                    history=history,
                )
            )
        else:
            raise ValueError(f"{path.name}:{i}: invalid command {line!r}")
    return cases


@functools.lru_cache(maxsize=4)
def storage_for(history: tuple[Load, ...]) -> MemoryStorage:
    storage = MemoryStorage()
    for load in history:
        for labels, values in load.series:
            for step, value in enumerate(values):
                if value is not None:
                    storage.add(labels, step * load.step_ms / 1000, value)
    return storage


def almost_equal(a: float, b: float) -> bool:
    """test.go's comparison: both NaN, or within a relative epsilon."""
    if math.isnan(a) and math.isnan(b):
        return True
    if a == b:
        return True
    diff = abs(a - b)
    if a == 0 or b == 0 or diff < _MIN_NORMAL:
        return diff < _EPSILON * _MIN_NORMAL
    return diff / (abs(a) + abs(b)) < _EPSILON


def failure(case: Case) -> str | None:
    """Why ``case`` fails, or None when it passes."""
    try:
        result = evaluate(case.expr, storage_for(case.history), case.at_ms / 1000)
    except EvaluationError as exc:
        return None if case.fail else f"evaluation failed: {exc}"
    if case.fail:
        return f"expected an evaluation error, got {result!r}"
    if isinstance(result, float):
        if len(case.expected) != 1 or case.expected[0][0] is not None:
            return f"got scalar {result}, expected {case.expected}"
        expected_value = case.expected[0][1]
        return None if almost_equal(expected_value, result) else f"got {result}"
    expected = {labels or (): (pos, value) for pos, (labels, value) in enumerate(case.expected)}
    for pos, sample in enumerate(result):
        if sample.labels not in expected:
            return f"unexpected {format_labels(sample.labels)} {sample.value}"
        want_pos, want = expected[sample.labels]
        if case.ordered and want_pos != pos:
            return f"{format_labels(sample.labels)} at position {pos}, expected {want_pos}"
        if not almost_equal(want, sample.value):
            return f"{format_labels(sample.labels)}: expected {want}, got {sample.value}"
    missing = set(expected) - {sample.labels for sample in result}
    return f"missing {sorted(map(format_labels, missing))}" if missing else None


ALL_CASES = [case for path in sorted(TESTDATA.glob("*.test")) for case in read_cases(path)]
IN_SUBSET = [case for case in ALL_CASES if case.in_subset]


@pytest.mark.parametrize("case", IN_SUBSET, ids=lambda case: case.id)
def test_case(case: Case) -> None:
    problem = failure(case)
    assert problem is None, f"{case.id}: eval at {case.at_ms} ms: {case.expr}\n{problem}"


def test_totals(capsys: pytest.CaptureFixture[str]) -> None:
    if not TESTDATA.is_dir():
        pytest.skip(f"no conformance data at {TESTDATA}")
    passed = sum(failure(case) is None for case in IN_SUBSET)
    summary = f"in subset: {len(IN_SUBSET)} of {len(ALL_CASES)}, passed: {passed}"
    with capsys.disabled():
        print(f"\nPromQL conformance (Prometheus v2.42.0 testdata): {summary}")
    assert len(IN_SUBSET) >= MIN_IN_SUBSET, summary
    assert passed == len(IN_SUBSET), summary
