"""Alert templates: the monitor's expansion matches promtool's byte for byte, bad ones fail early.

The differential test writes one rules file whose alerts carry the templates under test, takes
the expected annotations from :func:`expand`, and lets ``promtool test rules`` (which expands
them with Prometheus's own code and compares exactly) decide.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lossguard.monitor.promql import MemoryStorage, evaluate, expand_values, parse_series
from lossguard.monitor.rules.ruleset import template_query
from lossguard.monitor.rules.ruletest import run_test_files
from lossguard.monitor.rules.templating import (
    QueryText,
    TemplateError,
    check_template,
    expand,
    template_queries,
)
from tests.support.promserver import promtool_test_rules

pytestmark = pytest.mark.live

EXTERNAL_LABELS = {"cluster": "lab", "zone": "eu-1"}
EXTERNAL_URL = "http://monitor.example:9090/prefix"
SERIES = {"run_id": "r1", "instance": "host:9410"}

VALUES = [0, 1, -5, 0.5, -0.001, 1234.5678, 1e6, 1e21, 1.5e-5, 0.000123, 1e-30, 123456789,
          3 * 86400 + 3700.25, 1.6e9, -math.inf, math.nan, math.inf]  # fmt: skip

VALUE_TEMPLATES = {
    "value": "{{ $value }}",
    "dot_value": "{{ .Value }}",
    "humanize": "{{ humanize $value }}",
    "humanize1024": "{{ humanize1024 $value }}",
    "duration": "{{ humanizeDuration $value }}",
    "percentage": "{{ $value | humanizePercentage }}",
    "timestamp": "{{ humanizeTimestamp $value }}",
    "printf": '{{ printf "%.2f|%g|%e|%v|%8.3f|%-9.1f|%+.1e|%d|%s" $value $value $value $value'
    " $value $value $value $value $value }}",
    "compare": "{{ if gt $value 100.0 }}big{{ else if lt $value 0.0 }}negative{{ else }}small"
    "{{ end }}",
}

CONSTRUCT_TEMPLATES = {
    "labels": "{{ $labels.run_id }}/{{ $labels.missing }}/{{ .Labels.instance }}",
    "range_kv": "{{ range $k, $v := $labels }}{{ $k }}={{ $v }};{{ end }}",
    "range_dot": "{{ range .Labels }}[{{ . }}]{{ else }}none{{ end }}",
    "external": "{{ $externalURL }} {{ .ExternalURL }} {{ $externalLabels.cluster }}"
    " {{ range $k, $v := .ExternalLabels }}{{ $k }}:{{ $v }},{{ end }}",
    "trim": 'a  {{- "b" -}}  c {{- /* a comment */ -}}\n d {{/* kept */}} e',
    "with": "{{ with $labels.run_id }}run={{ . }}{{ else }}none{{ end }}"
    "{{ with $labels.missing }}x{{ else }}empty{{ end }}",
    "variables": "{{ $x := 1 }}{{ if true }}{{ $x = 2 }}{{ $y := 3 }}{{ $y }}{{ end }}{{ $x }}",
    "strings": '{{ toUpper "abc" }} {{ toLower `XY\\n` }} {{ title "hello wide_world-x ok" }}'
    ' {{ "tab\\there \\u00e9 \\x41" }}',
    "regex": '{{ reReplaceAll "(\\\\w+):(\\\\d+)" "${2}_$1 $$ $9" $labels.instance }}'
    ' {{ match "^host" $labels.instance }} {{ match "^x" "y" }}'
    ' {{ reReplaceAll "x*" "-" "abxd" }}',
    "strip_port": '{{ stripPort $labels.instance }} {{ stripPort "[::1]:80" }}'
    ' {{ stripPort "nohost" }}',
    "index_len": '{{ index $labels "run_id" }}|{{ index $labels "nope" }}|{{ len $labels }}'
    '|{{ len "h\u00e9llo" }}',
    "logic": '{{ and 1 0 }} {{ or 0 "" "x" }} {{ not true }} {{ and true "y" }}'
    ' {{ eq "a" "b" "a" }} {{ ne 1 2 }} {{ le 2 2 }} {{ ge 1.5 2.5 }} {{ lt "a" "b" }}',
    "printf": '{{ printf "%s=%q %x %X %05d %+d %5s|%-5s| %% %t" "k" "v\\n" 255 "hi" 42 7'
    ' "ab" "cd" true }} {{ printf "%d %s" 1 }} {{ printf "%d" 1 2 }}'
    ' {{ printf "%v %v %s" true 3 $labels }} {{ printf "%s" 5 }} {{ printf "%6.2f|" 3 }}',
    "literals": "{{ 1.5 }} {{ 1e3 }} {{ 0x1F }} {{ -7 }} {{ 'a' }} {{ true }} {{ `raw\\n` }}",
    "parens": '{{ (index $labels "run_id") | toUpper }}'
    ' {{ printf "%s-%s" (toUpper "a") $labels.run_id }} {{ (.Labels).run_id }}',
    "humanize_args": '{{ humanize "2048" }} {{ humanize1024 2048 }} {{ humanizeDuration 0.25 }}'
    " {{ humanizePercentage 0.123456 }}",
}
SEVERITY = "{{ if gt $value 1.0 }}page{{ else }}ticket{{ end }}"
CONSTRUCT_VALUE = 42.5


def _series_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _render(text: str, idx: int, value: float) -> str:
    labels = {"__name__": "m", **SERIES, "idx": str(idx)}
    return expand(
        text,
        labels=labels,
        value=value,
        external_labels=EXTERNAL_LABELS,
        external_url=EXTERNAL_URL,
    )


def _cases() -> list[tuple[float, dict[str, str]]]:
    """(series value, annotations) per alert."""
    return [(value, VALUE_TEMPLATES) for value in VALUES] + [(CONSTRUCT_VALUE, CONSTRUCT_TEMPLATES)]


def _write_promtool_files(tmp_path: Path) -> Path:
    rules: list[dict[str, object]] = []
    tests: list[dict[str, object]] = []
    series: list[dict[str, str]] = []
    for idx, (value, templates) in enumerate(_cases()):
        expected = {name: _render(text, idx, value) for name, text in templates.items()}
        # Error texts name the alert in Prometheus: those are compared in other tests.
        kept = {name: text for name, text in templates.items() if "<error" not in expected[name]}
        assert templates is VALUE_TEMPLATES or kept == templates, expected
        name = f"Case{idx}"
        rules.append(
            {
                "alert": name,
                "expr": f'm{{idx="{idx}"}}',
                "labels": {"severity": SEVERITY},
                "annotations": kept,
            }
        )
        labels = {**SERIES, "idx": str(idx), "severity": _render(SEVERITY, idx, value)}
        series.append(
            {"series": f'm{{run_id="r1", instance="host:9410", idx="{idx}"}}',
             "values": _series_value(value)}
        )  # fmt: skip
        annotations = {key: expected[key] for key in kept}
        tests.append(
            {
                "alertname": name,
                "eval_time": "0m",
                "exp_alerts": [{"exp_labels": labels, "exp_annotations": annotations}],
            }
        )
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(json.dumps({"groups": [{"name": "templates", "rules": rules}]}))
    test_file = tmp_path / "tests.yml"
    unit = {
        "input_series": series,
        "external_labels": EXTERNAL_LABELS,
        "external_url": EXTERNAL_URL,
        "alert_rule_test": tests,
    }
    test_file.write_text(json.dumps({"rule_files": [str(rules_file)], "tests": [unit]}))
    return test_file


def test_expansion_matches_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not on PATH (Debian: apt-get install prometheus)"
    test_file = _write_promtool_files(tmp_path)
    result = subprocess.run(
        [promtool, "test", "rules", str(test_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("text", "value", "expected"),
    [
        ("{{ $value }}", 1e6, "1e+06"),
        ("{{ $value }}", 0.000123, "0.000123"),
        ("{{ $value }}", 1.5e-5, "1.5e-05"),
        ("{{ $value }}", math.nan, "NaN"),
        ("{{ humanize $value }}", 1234.5678, "1.235k"),
        ("{{ $labels.nope }}|{{ $labels.run_id }}", 0, "|r1"),
        ("{{ range $externalLabels }}x{{ else }}none{{ end }}", 0, "none"),
        ("{{ $externalLabels.cluster }}|{{ $externalURL }}", 0, "|"),
    ],
)
def test_known_expansions(text: str, value: float, expected: str) -> None:
    assert expand(text, labels={"run_id": "r1"}, value=value) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{{ eq $value 1 }}", "incompatible types for comparison"),
        ("{{ humanizeTimestamp 1e21 }}", "overflows int64"),
        ("{{ toUpper 5 }}", "expected string; got int"),
        ('{{ match "(" "x" }}', "error parsing regexp"),
        ("{{ humanize }}", "wrong number of args for humanize: want 1 got 0"),
        ("{{ $labels.run_id.deeper }}", "can't evaluate field deeper in type string"),
    ],
)
def test_expansion_errors_are_rendered_not_raised(text: str, expected: str) -> None:
    result = expand(text, labels={"run_id": "r1"}, value=1.0)
    assert result.startswith("<error expanding template: ") and expected in result, result


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{{ $value ", "1:1: unclosed action"),
        ('{{ graphLink "up" }}', '1:4: function "graphLink" is not supported by the monitor'),
        ("x\n {{ template `t` }}", '2:5: function "template" is not supported by the monitor'),
        ("{{ tableLink `up` }}", '1:4: function "tableLink" is not supported by the monitor'),
        ("{{ frobnicate 1 }}", '1:4: function "frobnicate" not defined'),
        ("{{ $nope }}", '1:4: undefined variable "$nope"'),
        ("{{ $x = 1 }}", '1:4: undefined variable "$x"'),
        ("{{ $value | 2 }}", "1:13: non executable command in pipeline stage 2"),
        ("{{ $value 2 }}", "1:4: can't give argument to non-function $value"),
        ("{{ | toUpper }}", "1:1: missing command in pipeline"),
        ('{{ "abc }}', "1:4: unterminated quoted string"),
        ("{{ `abc }}", "1:4: unterminated quoted string"),
        ("{{ if $value }}x", "1:1: unexpected EOF in {{if}}"),
        ("{{ end }}", "1:1: unexpected {{end}}"),
        ("{{/* open", "1:1: unclosed comment"),
        ("{{ (toUpper `a` }}", "1:17: unclosed left paren"),
        ("{{ toUpper `a`) }}", "1:15: unexpected right paren"),
        ("{{}}", "1:1: missing value for command"),
    ],
)
def test_check_template_errors(text: str, expected: str) -> None:
    with pytest.raises(TemplateError) as caught:
        check_template(text)
    message = str(caught.value)
    assert message == expected
    assert "\n" not in message


def test_unsupported_function_fails_expansion_too() -> None:
    result = expand('{{ tableLink "up" }}', labels={}, value=0.0)
    assert (
        result
        == '<error expanding template: 1:4: function "tableLink" is not supported by the monitor>'
    )


@given(st.text().filter(lambda text: "{{" not in text))
def test_text_without_actions_expands_to_itself(text: str) -> None:
    check_template(text)
    assert expand(text, labels={}, value=0.0) == text


def test_printf_of_the_whole_data_prints_it_as_the_dot_does() -> None:
    """``printf "%v" .`` once recursed without end; it prints the struct as ``{{ . }}``."""
    labels = {"run_id": "r1"}
    printed = expand('{{ printf "%v" . }}', labels=labels, value=2.0)
    assert printed == expand("{{ . }}", labels=labels, value=2.0) == "{map[run_id:r1] map[]  2}"
    assert expand('{{ printf "%d" . }}', labels=labels, value=2.0).startswith("%!d(")


# query and the functions that read its samples ------------------------------------------------

QUERY_SERIES = {
    'mfu{run_id="r1", rank="0", node="n0"}': "0.41 0.4",
    'mfu{run_id="r1", rank="1", node="n0"}': "0.05 0.03",
    'mfu{run_id="r1", rank="2", node="n1"}': "0.5 0.38",
    'mfu{run_id="r1", rank="3", node="n1"}': "0.07 0.08",
    'mfu{run_id="r2", rank="0", node="n2"}': "0.45 0.5",
}
QUERY_TEMPLATES = {
    "range_topk": '{{ range query "topk(3, mfu)" }}{{ .Labels.rank }}={{ .Value }} {{ end }}',
    "first_value": '{{ with query "bottomk(1, mfu)" }}{{ (first .).Labels.rank }} '
    "{{ . | first | value | humanizePercentage }}{{ end }}",
    "sorted": '{{ range $i, $s := sortByLabel "rank" (query "mfu{run_id=\\"r1\\"} < 0.1") }}'
    '{{ if $i }}, {{ end }}{{ label "rank" $s }}@{{ $s.Labels.node }}/{{ $s.Labels.__name__ }}'
    "{{ end }}",
    "len_index": '{{ len (query "mfu") }} {{ (index (query "topk(1, mfu)") 0).Value }}',
    "empty": '{{ with query "mfu > 1" }}some{{ else }}none{{ end }}'
    '{{ range query "mfu > 1" }}x{{ else }} empty{{ end }}',
    "scalar": '{{ query "scalar(mfu{run_id=\\"r2\\"})" | first | value }}'
    '|{{ len (query "scalar(mfu{run_id=\\"r2\\"})" | first).Labels }}',
    "printf": '{{ range query (printf "bottomk(2, mfu{run_id=%q})" $labels.run_id) }}'
    "{{ .Labels.rank }} {{ end }}"
    '{{ query (printf "count(mfu{run_id=%q} < %g)" $labels.run_id 0.1) | first | value }}',
    "strvalue": '[{{ strvalue (query "topk(1, mfu)" | first) }}]',
}
QUERY_AT = {"0m": 0.0, "1m": 60.0}  # eval_time -> seconds


def _query_storage() -> MemoryStorage:
    storage = MemoryStorage()
    for series, values in QUERY_SERIES.items():
        labels, _ = parse_series("mfu" + series[3:])
        for step, value in enumerate(expand_values(values)):
            assert value is not None
            storage.add(labels, step * 60, value)
    return storage


def test_query_functions_match_promtool(tmp_path: Path) -> None:
    """``query``, ``first``, ``label``, ``value``, ``strvalue``, ``sortByLabel`` and ranges over
    samples: the monitor's expansion is the expected annotation of promtool's own test, and
    the monitor's rule-test runner agrees. (Only ordered results are ranged over: promtool
    loads series in random order.)"""
    storage = _query_storage()
    rules = [
        {
            "alert": f"Query{when}",
            "expr": 'mfu{run_id="r1", rank="0"}',
            "annotations": QUERY_TEMPLATES,
        }
        for when in QUERY_AT
    ]
    tests: list[dict[str, Any]] = []
    for when, t in QUERY_AT.items():
        run = template_query(lambda expr, at: evaluate(expr, storage, at), t)
        value = evaluate('mfu{run_id="r1", rank="0"}', storage, t)
        assert isinstance(value, list)
        labels = {"run_id": "r1", "rank": "0", "node": "n0"}
        expected = {
            name: expand(text, labels=labels, value=value[0].value, query=run)
            for name, text in QUERY_TEMPLATES.items()
        }
        assert not [text for text in expected.values() if "<error" in text], expected
        tests.append(
            {
                "alertname": f"Query{when}",
                "eval_time": when,
                "exp_alerts": [{"exp_labels": labels, "exp_annotations": expected}],
            }
        )
    assert tests[0]["exp_alerts"][0]["exp_annotations"]["sorted"] == "1@n0/mfu, 3@n1/mfu"
    (tmp_path / "rules.yml").write_text(json.dumps({"groups": [{"name": "q", "rules": rules}]}))
    unit = {
        "interval": "1m",
        "input_series": [{"series": k, "values": v} for k, v in QUERY_SERIES.items()],
        "alert_rule_test": tests,
    }
    test_file = tmp_path / "tests.yml"
    test_file.write_text(json.dumps({"rule_files": ["rules.yml"], "tests": [unit]}))
    result = promtool_test_rules(test_file)
    assert result.returncode == 0, result.stdout + result.stderr
    assert run_test_files([str(test_file)]) == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{{ query 5 }}", "wrong type for value; expected string; got int"),
        ('{{ first "x" }}', "expected template.queryResult; got string"),
        ('{{ first (query "mfu > 1") }}', "first() called on vector with no elements"),
        ('{{ label "rank" "x" }}', "expected *template.sample; got string"),
        ("{{ value nil }}", "nil pointer dereference"),
        ('{{ (query "mfu").Labels }}', "can't evaluate field Labels in type template.queryResult"),
        ('{{ index (query "mfu") 9 }}', "index out of range: 9"),
        ('{{ query "rate(mfu)" }}', "error calling query: 1:6: expected type range vector"),
        ('{{ (first (query "mfu")).Nope }}', "can't evaluate field Nope in type *template.sample"),
    ],
)
def test_query_errors_are_rendered(text: str, expected: str) -> None:
    run = template_query(lambda expr, at: evaluate(expr, _query_storage(), at), 0.0)
    result = expand(text, labels={}, value=0.0, query=run)
    assert result.startswith("<error expanding template: ") and expected in result, result
    without = expand('{{ query "mfu" }}', labels={}, value=0.0)
    assert "no query engine" in without


def test_a_sample_prints_as_go_prints_a_pointer_to_it() -> None:
    run = template_query(lambda expr, at: evaluate(expr, _query_storage(), at), 0.0)
    printed = expand('{{ query "topk(1, mfu)" | first }}', labels={}, value=0.0, query=run)
    assert printed == "&{map[__name__:mfu node:n1 rank:2 run_id:r1] 0.5}"


@pytest.mark.parametrize(
    ("text", "queries"),
    [
        ('{{ query "up" }}', [QueryText("up", True)]),
        (
            '{{ range query (printf "topk(3, x{run_id=%q} < %g)" $labels.run_id 0.1) }}{{ end }}',
            [QueryText('topk(3, x{run_id="_"} < 0)', False)],
        ),
        ('{{ printf "count(y{a=%q})" "b" | query | len }}', [QueryText('count(y{a="_"})', False)]),
        (
            '{{ if true }}{{ with query "a" }}{{ query "b" }}{{ end }}{{ end }}',
            [QueryText("a", True), QueryText("b", True)],
        ),
        ('{{ query (printf "%s_total" "x") }}', [QueryText("x_total", False)]),
        ('{{ query (printf "%s_total" $labels.job) }}', [None]),  # %s: can be part of a name
        ('{{ query (printf "gpu%d" 1) }}', [None]),
        (
            '{{ $q := printf "up{a=%q}" "b" }}{{ query $q }}'
            '{{ query (printf "count(%s > %d)" $q 1) }}',
            [QueryText('up{a="_"}', False), QueryText('count(up{a="_"} > 0)', False)],
        ),
        ('{{ $q := "up" }}{{ query $q }}', [QueryText("up", True)]),
        ("{{ $q := $labels.expr }}{{ query $q }}", [None]),
        ("{{ humanize 1 }}", []),
    ],
)
def test_template_queries_known_before_they_run(text: str, queries: list[QueryText | None]) -> None:
    found = template_queries(text)
    assert [(q.text, q.exact) if q else None for q in found] == [
        (q.text, q.exact) if q else None for q in queries
    ]
