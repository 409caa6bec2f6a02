"""Rule files and rule unit tests: loaded and checked as promtool does, refused with one-line
errors, and unit-tested by ``lossguard-monitor rules test`` with promtool's verdicts."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from lossguard.monitor.rules.rulefile import (
    RuleError,
    longest_range_s,
    metric_names,
    parse_rule_file,
)
from tests.support.processes import monitor_cli

pytestmark = pytest.mark.live

PROMTOOL = shutil.which("promtool") or "promtool"


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, cwd=cwd, check=False)


GOOD = """\
groups:
  - name: training
    interval: 10s
    rules:
      - alert: LossHigh
        expr: max by (run_id) (max_over_time(loss[10m] offset 1m)) > 5
        for: 1m
        keep_firing_for: 2m
        labels: {severity: warning}
        annotations: {summary: "{{ $labels.run_id }}: {{ $value | humanize }}"}
      - alert: Down
        expr: up{job="lossguard-agent"} == 0
"""


def test_a_good_file_loads_with_its_durations_and_what_it_reads() -> None:
    (group,) = parse_rule_file(GOOD, "good.yml")
    assert (group.name, group.interval_s) == ("training", 10)
    loss, down = group.rules
    assert (loss.for_s, loss.keep_firing_for_s, down.for_s) == (60, 120, 0)
    assert dict(loss.labels) == {"severity": "warning"}
    assert longest_range_s([group]) == 11 * 60 + 5 * 60  # range + offset + lookback
    assert metric_names([group]) == {"loss", "up"}
    regex = parse_rule_file("groups: [{name: g, rules: [{alert: A, expr: '{__name__=~\"a.*\"}'}]}]")
    assert metric_names(regex) is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("groups: [{name: g, rules: [{alert: A}]}]", r"rule 1 \(\"A\"\): 'expr' must be set"),
        (
            "groups: [{name: g, rules: [{alert: A, expr: 'up =='}]}]",
            r"x\.yml:1: group \"g\": rule 1 \(\"A\"\): expr: 1:6: unexpected end of input",
        ),
        (
            "groups: [{name: g, rules: [{alert: A, expr: 'histogram_quantile(0.9, x)'}]}]",
            r"histogram_quantile",
        ),
        ("groups: [{name: g, rules: [{record: r, expr: up}]}]", "recording rules are not supp"),
        ("groups: [{name: g, rules: [{alert: A, expr: up, for: 5x}]}]", "not a valid duration"),
        ("groups: [{name: g, rules: [{alert: A, expr: up, lables: {}}]}]", "unknown field 'lab"),
        ("groups: [{name: g}, {name: g}]", r'group name "g" is repeated'),
        ("groups: [{name: '', rules: []}]", "group name must not be empty"),
        ("groups: [{name: g, rules: [{alert: '', expr: up}]}]", "alert name must not be empty"),
        (
            "groups: [{name: g, rules: [{alert: A, expr: up, annotations: {s: '{{ $value '}}]}]",
            r"annotations: s:",
        ),
        (
            "groups: [{name: g, rules: [{alert: A, expr: up, labels: {__name__: y}}]}]",
            "invalid name '__name__'",
        ),
        ("groups: [{name: g\n", "invalid YAML"),
        ("groups: {name: g}", "groups must be a list"),
    ],
)
def test_bad_rule_files_are_refused_in_one_line(text: str, message: str) -> None:
    with pytest.raises(RuleError, match=message) as caught:
        parse_rule_file(text, "x.yml")
    assert "\n" not in str(caught.value) and str(caught.value).startswith("x.yml:")


def test_full_promql_is_accepted_for_prometheus_but_syntax_errors_never_are() -> None:
    text = "groups: [{name: g, rules: [{alert: A, expr: 'histogram_quantile(0.9, x) > 1'}]}]"
    with pytest.raises(RuleError, match="unsupported PromQL: function histogram_quantile"):
        parse_rule_file(text, "x.yml")
    ((rule,),) = [g.rules for g in parse_rule_file(text, "x.yml", full_promql=True)]
    assert rule.query is None and rule.expr.startswith("histogram_quantile")
    with pytest.raises(RuleError, match="unexpected end of input"):
        parse_rule_file(
            text.replace("histogram_quantile(0.9, x) > 1", "up =="), "x.yml", full_promql=True
        )
    assert metric_names(parse_rule_file(text, "x.yml", full_promql=True)) == frozenset()


def test_rules_check_matches_promtool_verdicts(tmp_path: Path) -> None:
    good = tmp_path / "good.yml"
    good.write_text(GOOD)
    bad = tmp_path / "bad.yml"
    bad.write_text("groups: [{name: g, rules: [{alert: A, expr: 'up ==', for: 1m}]}]\n")
    ours, theirs = monitor_cli("rules", "check", str(good)), promtool("check", "rules", str(good))
    assert ours.returncode == theirs.returncode == 0, ours.stderr + theirs.stderr
    assert ours.stdout == f"Checking {good}\n  SUCCESS: 2 rules found\n\n"
    ours, theirs = monitor_cli("rules", "check", str(bad)), promtool("check", "rules", str(bad))
    assert ours.returncode == theirs.returncode == 1
    assert "FAILED" in ours.stderr and "expr: 1:6" in ours.stderr


UNIT_RULES = """\
groups:
  - name: g
    rules:
      - alert: LossHigh
        expr: loss > 5
        for: 2m
        keep_firing_for: 1m
        labels: {severity: critical}
        annotations:
          summary: "{{ $labels.run_id }} loss {{ $value }}"
          description: 'loss is {{ printf "%.1f" $value }} ({{ $value | humanize }})'
      - alert: CounterMoved
        expr: increase(nonfinite_total[2m]) > 0
        labels: {severity: warning}
"""

UNIT_TESTS = """\
rule_files: [rules.yml]
evaluation_interval: 1m
tests:
  - name: lifecycle
    interval: 1m
    input_series:
      - series: 'loss{run_id="r1", rank="0"}'
        values: '1 6 7 8 9 2 2 2 2'
      - series: 'nonfinite_total{run_id="r1"}'
        values: '0 0 1 1 1 1 0 0 0'
    alert_rule_test:
      - {eval_time: 1m, alertname: LossHigh, exp_alerts: []}
      - eval_time: 3m
        alertname: LossHigh
        exp_alerts:
          - exp_labels: {severity: critical, run_id: r1, rank: "0"}
            exp_annotations: {summary: "r1 loss 8", description: "loss is 8.0 (8)"}
      - eval_time: 5m30s
        alertname: LossHigh
        exp_alerts:
          - exp_labels: {severity: critical, run_id: r1, rank: "0"}
            exp_annotations: {summary: "r1 loss 9", description: "loss is 9.0 (9)"}
      - {eval_time: 6m, alertname: LossHigh, exp_alerts: []}
      - eval_time: 2m
        alertname: CounterMoved
        exp_alerts:
          - exp_labels: {severity: warning, run_id: r1}
      - {eval_time: 8m, alertname: CounterMoved, exp_alerts: []}
    promql_expr_test:
      - expr: increase(nonfinite_total[2m])
        eval_time: 7m
        exp_samples:
          - {labels: '{run_id="r1"}', value: 0}
      - expr: max_over_time(loss[3m])
        eval_time: 4m
        exp_samples:
          - {labels: '{run_id="r1", rank="0"}', value: 9}
"""


def write_unit_test(tmp_path: Path, tests: str = UNIT_TESTS) -> Path:
    (tmp_path / "rules.yml").write_text(UNIT_RULES)
    path = tmp_path / "rules.test.yml"
    path.write_text(tests)
    return path


def test_rule_unit_tests_pass_in_both_promtool_and_the_monitor(tmp_path: Path) -> None:
    path = write_unit_test(tmp_path)
    theirs = promtool("test", "rules", str(path))
    assert theirs.returncode == 0, theirs.stdout + theirs.stderr
    ours = monitor_cli("rules", "test", str(path))
    assert ours.returncode == 0, ours.stdout + ours.stderr
    assert ours.stdout == theirs.stdout == f"Unit Testing:  {path}\n  SUCCESS\n\n"


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("value: 9}", "value: 10}", "expr: 'max_over_time(loss[3m])', time: 4m,"),
        ('description: "loss is 8.0 (8)"', 'description: "nope"', "alertname: LossHigh"),
        ("{eval_time: 6m, alertname: LossHigh, exp_alerts: []}", "{eval_time: 6m}", "alertname"),
        ("rule_files: [rules.yml]", "rule_files: [rules.yml]\nbogus: 1", "bogus"),
    ],
)
def test_a_failing_unit_test_fails_in_both(
    tmp_path: Path, old: str, new: str, message: str
) -> None:
    assert old in UNIT_TESTS
    path = write_unit_test(tmp_path, UNIT_TESTS.replace(old, new))
    theirs = promtool("test", "rules", str(path))
    ours = monitor_cli("rules", "test", str(path))
    assert theirs.returncode == ours.returncode == 1, ours.stdout + ours.stderr
    assert "FAILED:" in ours.stderr and message in ours.stderr


def test_failure_report_reads_like_promtools(tmp_path: Path) -> None:
    path = write_unit_test(tmp_path, UNIT_TESTS.replace("r1 loss 8", "r1 loss 80"))
    ours = monitor_cli("rules", "test", str(path)).stderr
    theirs = promtool("test", "rules", str(path)).stderr
    assert ours == theirs, textwrap.indent(ours, "ours| ") + textwrap.indent(theirs, "theirs| ")
