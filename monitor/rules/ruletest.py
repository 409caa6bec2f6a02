"""Rule unit tests in promtool's format, run on the embedded evaluator.

The same files pass under ``promtool test rules`` and ``lossguard-monitor rules test``: input
series in expanding notation from time 0 every ``interval``; rules evaluated every
``evaluation_interval`` from 0 to the last ``eval_time``; an ``alert_rule_test`` compares the
firing alerts of that name (labels and annotations, exactly) at the evaluation at or just before
its ``eval_time``; a ``promql_expr_test`` compares an instant query's samples exactly. The output
and exit codes follow promtool's.
"""

from __future__ import annotations

import glob
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from lossguard.common.config import parse_duration
from lossguard.monitor.promql import (
    Labels,
    MemoryStorage,
    PromQLError,
    evaluate,
    expand_values,
    format_labels,
    make_labels,
    parse_series,
)
from lossguard.monitor.rules.rulefile import AlertingRule, RuleError, load_rule_files
from lossguard.monitor.rules.ruleset import RuleSet

_FILE_KEYS = {"rule_files", "evaluation_interval", "group_eval_order", "tests"}
_GROUP_KEYS = {
    "interval",
    "input_series",
    "alert_rule_test",
    "promql_expr_test",
    "external_labels",
    "external_url",
    "name",
}


_MODEL_UNITS = (
    ("y", 31_536_000_000),
    ("w", 604_800_000),
    ("d", 86_400_000),
    ("h", 3_600_000),
    ("m", 60_000),
    ("s", 1000),
    ("ms", 1),
)


class TestFileError(ValueError):
    """A test file that cannot be run (one line)."""


@dataclass(frozen=True)
class _Expected:
    labels: dict[str, str]
    annotations: dict[str, str]


@dataclass
class _TestGroup:
    name: str
    interval_ms: int
    series: list[tuple[Labels, list[float | None]]]
    alert_tests: list[tuple[int, str, list[_Expected]]] = field(default_factory=list)
    expr_tests: list[tuple[str, int, list[tuple[Labels, float]]]] = field(default_factory=list)
    external_labels: dict[str, str] = field(default_factory=dict)
    external_url: str = ""


def run_test_files(paths: list[str], out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Run each file as promtool does; 0 when all pass, 1 otherwise."""
    failed = False
    for path in paths:
        print("Unit Testing: ", path, file=out)
        errors = test_file(Path(path))
        if errors:
            print("  FAILED:", file=err)
            for error in errors:
                print(error, file=err)
                print(file=out)
            failed = True
        else:
            print("  SUCCESS", file=out)
        print(file=out)
    return 1 if failed else 0


def test_file(path: Path) -> list[str]:
    """The failures of one test file (empty when it passes)."""
    try:
        spec = _mapping(yaml.safe_load(path.read_text()), _FILE_KEYS, "test file")
        eval_ms = _duration(spec.get("evaluation_interval"), "evaluation_interval", 60_000)
        rule_files = _rule_files(path.parent, spec.get("rule_files") or [])
        groups = load_rule_files(rule_files)
        tests = [_test_group(g, eval_ms) for g in spec.get("tests") or []]
    except (OSError, yaml.YAMLError, TestFileError, RuleError) as exc:
        return [_one_line(exc)]
    errors: list[str] = []
    for test in tests:
        errors.extend(_run(test, groups, eval_ms))
    return errors


def _run(test: _TestGroup, groups: list[Any], eval_ms: int) -> list[str]:
    storage = MemoryStorage()
    for labels, values in test.series:
        for i, value in enumerate(values):
            if value is not None:
                storage.add(labels, i * test.interval_ms / 1000, value)
    ruleset = RuleSet(groups, external_labels=test.external_labels, external_url=test.external_url)

    def query(rule: AlertingRule, t: float) -> Any:
        return evaluate(rule.query or rule.expr, storage, t)

    def expr_query(expr: str, t: float) -> Any:
        return evaluate(expr, storage, t)

    errors: list[str] = []
    prefix = f"    name: {test.name},\n" if test.name else ""
    checks = sorted(test.alert_tests, key=lambda case: case[0])
    last_ms = max([t for t, _, _ in checks] + [t for _, t, _ in test.expr_tests] + [0])
    ts = 0
    while ts <= last_ms:
        ruleset.evaluate(query, ts / 1000, expr_query=expr_query)
        failures = [e for e in ruleset.rules if e.last_error is not None]
        if failures:
            return errors + [
                f"    rule: {e.rule.name}, time: {_go_duration(ts)}, err: {e.last_error}"
                for e in failures
            ]
        while checks and ts <= checks[0][0] < ts + eval_ms:
            at, name, expected = checks.pop(0)
            got = sorted(
                (
                    (_sorted(alert.labels), _sorted(alert.annotations))
                    for entry in ruleset.rules
                    if entry.rule.name == name
                    for alert in entry.firing()
                ),
            )
            want = sorted(
                (_sorted({**e.labels, "alertname": name}), _sorted(e.annotations)) for e in expected
            )
            if got != want:
                errors.append(
                    f"{prefix}    alertname: {name}, time: {_model_duration(at)}, \n"
                    f"        exp:{_alerts_text(want)}, \n        got:{_alerts_text(got)}"
                )
        ts += eval_ms
    for expr, at, expected_samples in test.expr_tests:
        try:
            result = evaluate(expr, storage, at / 1000)
        except PromQLError as exc:
            errors.append(f"    expr: {expr!r}, time: {_model_duration(at)}, err: {exc}")
            continue
        pairs = (
            [((), result)] if isinstance(result, float) else [(s.labels, s.value) for s in result]
        )
        got_samples, want_samples = sorted(pairs), sorted(expected_samples)
        if got_samples != want_samples:
            errors.append(
                f"    expr: {expr!r}, time: {_model_duration(at)},\n"
                f"        exp: {_samples_text(want_samples)}\n"
                f"        got: {_samples_text(got_samples)}"
            )
    return errors


def _test_group(raw: Any, eval_ms: int) -> _TestGroup:
    spec = _mapping(raw, _GROUP_KEYS, "test group")
    group = _TestGroup(
        name=str(spec.get("name") or ""),
        interval_ms=_duration(spec.get("interval"), "interval", eval_ms),
        series=[_input_series(s) for s in spec.get("input_series") or []],
        external_labels={str(k): str(v) for k, v in (spec.get("external_labels") or {}).items()},
        external_url=str(spec.get("external_url") or ""),
    )
    for case in spec.get("alert_rule_test") or []:
        case = _mapping(case, {"eval_time", "alertname", "exp_alerts"}, "alert_rule_test")
        if not case.get("alertname"):
            raise TestFileError("an item under alert_rule_test misses required attribute alertname")
        expected = [
            _Expected(
                labels={str(k): str(v) for k, v in (a.get("exp_labels") or {}).items()},
                annotations={str(k): str(v) for k, v in (a.get("exp_annotations") or {}).items()},
            )
            for a in (
                _mapping(a, {"exp_labels", "exp_annotations"}, "exp_alerts")
                for a in case.get("exp_alerts") or []
            )
        ]
        at = _duration(case.get("eval_time"), "eval_time", 0)
        group.alert_tests.append((at, str(case["alertname"]), expected))
    for case in spec.get("promql_expr_test") or []:
        case = _mapping(case, {"expr", "eval_time", "exp_samples"}, "promql_expr_test")
        samples = [
            _expected_sample(_mapping(s, {"labels", "value"}, "exp_samples"))
            for s in case.get("exp_samples") or []
        ]
        at = _duration(case.get("eval_time"), "eval_time", 0)
        group.expr_tests.append((str(case.get("expr", "")), at, samples))
    return group


def _input_series(raw: Any) -> tuple[Labels, list[float | None]]:
    spec = _mapping(raw, {"series", "values"}, "input_series")
    text = str(spec.get("series", ""))
    try:
        labels, rest = parse_series(text)
        if rest.strip():
            raise ValueError(f"unexpected {rest.strip()!r}")
        return labels, expand_values(str(spec.get("values", "")))
    except (PromQLError, ValueError) as exc:
        raise TestFileError(f"input_series {text!r}: {exc}") from None


def _expected_sample(spec: dict[str, Any]) -> tuple[Labels, float]:
    text = str(spec.get("labels", ""))
    try:
        labels, rest = parse_series(text) if text.strip() else (make_labels({}), "")
        if rest.strip():
            raise ValueError(f"unexpected {rest.strip()!r}")
        return labels, float(spec.get("value", 0))
    except (PromQLError, ValueError, TypeError) as exc:
        raise TestFileError(f"exp_samples labels {text!r}: {exc}") from None


def _rule_files(base: Path, patterns: list[Any]) -> list[str]:
    found: list[str] = []
    for pattern in patterns:
        full = str(pattern) if Path(str(pattern)).is_absolute() else str(base / str(pattern))
        matches = sorted(glob.glob(full))
        if not matches:
            print("  WARNING: no file match pattern", full, file=sys.stderr)
        found.extend(matches)
    return found


def _mapping(raw: Any, allowed: set[str], where: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise TestFileError(f"{where} must be a mapping")
    unknown = sorted(set(map(str, raw)) - allowed)
    if unknown:
        raise TestFileError(f"{where}: unknown field {unknown[0]!r}")
    return raw


def _duration(raw: Any, name: str, default: int) -> int:
    if raw is None or raw == "":
        return default
    try:
        return parse_duration(str(raw))
    except ValueError:
        raise TestFileError(f"{name}: not a valid duration: {raw!r}") from None


def _sorted(pairs: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(pairs.items()))


def _alerts_text(alerts: list[tuple[Labels, Labels]]) -> str:
    if not alerts:
        return "[]"
    items = [
        f"{i}:\n  Labels:{format_labels(labels)}\n  Annotations:{format_labels(annotations)}"
        for i, (labels, annotations) in enumerate(alerts)
    ]
    text = "[\n" + ",\n".join(items) + "\n]"
    return text.replace("\n", "\n" + " " * 12)  # promtool indents the list under exp:/got:


def _samples_text(samples: list[tuple[Labels, float]]) -> str:
    if not samples:
        return "nil"
    return ", ".join(f"{format_labels(labels)} {value:E}" for labels, value in samples)


def _model_duration(ms: int) -> str:
    """Prometheus's ``model.Duration`` text: ``1h5m``, ``30s``, ``0s``."""
    if ms == 0:
        return "0s"
    parts = []
    for unit, size in _MODEL_UNITS:
        if ms >= size:
            parts.append(f"{ms // size}{unit}")
            ms %= size
    return "".join(parts)


def _go_duration(ms: int) -> str:
    """Go's ``time.Duration`` text: ``1m0s``, ``1h30m0s``, ``0s``."""
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds = f"{rest / 1000:g}s"
    if hours:
        return f"{hours}h{minutes}m{seconds}"
    return f"{minutes}m{seconds}" if minutes else seconds


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
