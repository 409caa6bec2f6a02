"""The default alert rules: promtool accepts them and passes their unit tests, every alert is
labelled, annotated and tested, its runbook section exists, and its PromQL and templates stay
inside what the monitor supports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from lossguard.monitor.actions.policy import ACTIONS as ACTION_KINDS
from lossguard.monitor.promql import check
from lossguard.monitor.rules.templating import check_template
from tests.support.processes import monitor_cli

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "alerts" / "lossguard.rules.yml"
TEST_FILES = sorted((REPO / "alerts" / "tests").glob("*.test.yml"))
RUNBOOK = REPO / "docs" / "runbook.md"

SEVERITIES = {"critical", "warning", "info"}
ACTIONS = set(ACTION_KINDS)
ANNOTATIONS = {"summary", "description", "runbook_url"}


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


ALERTS: list[dict[str, Any]] = [
    rule for group in load_yaml(RULES)["groups"] for rule in group["rules"] if "alert" in rule
]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def runbook_anchors() -> set[str]:
    text = RUNBOOK.read_text(encoding="utf-8")
    return {github_anchor(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE)}


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not on PATH (CI installs it; Debian: apt-get install prometheus)")
    return path


def run_promtool(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_promtool_accepts_the_rules(promtool: str) -> None:
    result = run_promtool(promtool, "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


@pytest.mark.parametrize("test_file", TEST_FILES, ids=lambda p: p.name)
def test_promtool_and_the_monitor_pass_the_same_rule_tests(promtool: str, test_file: Path) -> None:
    theirs = run_promtool(promtool, "test", "rules", str(test_file))
    assert theirs.returncode == 0, theirs.stdout + theirs.stderr
    ours = monitor_cli("rules", "test", str(test_file))
    assert ours.returncode == 0, ours.stdout + ours.stderr
    assert ours.stdout == theirs.stdout


def test_the_monitor_accepts_the_rules_as_promtool_does(promtool: str) -> None:
    ours, theirs = (
        monitor_cli("rules", "check", str(RULES)),
        run_promtool(promtool, "check", "rules", str(RULES)),
    )
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout == theirs.stdout


def test_there_are_rule_tests() -> None:
    assert TEST_FILES, "no alerts/tests/*.test.yml"


def test_alert_names_are_unique() -> None:
    names = [rule["alert"] for rule in ALERTS]
    assert len(names) == len(set(names)), names


@pytest.mark.parametrize("rule", ALERTS, ids=lambda r: r["alert"])
def test_labels_and_annotations(rule: dict[str, Any]) -> None:
    labels = rule.get("labels", {})
    assert labels.get("severity") in SEVERITIES
    assert "action" not in labels or labels["action"] in ACTIONS
    assert set(rule.get("annotations", {})) == ANNOTATIONS


@pytest.mark.parametrize("rule", ALERTS, ids=lambda r: r["alert"])
def test_runbook_url_is_the_alerts_own_section(rule: dict[str, Any]) -> None:
    anchor = github_anchor(rule["alert"])
    assert rule["annotations"]["runbook_url"] == f"docs/runbook.md#{anchor}"
    assert anchor in runbook_anchors(), f"docs/runbook.md has no heading '## {rule['alert']}'"


@pytest.mark.parametrize("rule", ALERTS, ids=lambda r: r["alert"])
def test_templates_are_valid_for_the_monitor(rule: dict[str, Any]) -> None:
    for text in rule["annotations"].values():
        check_template(text)


@pytest.mark.parametrize("rule", ALERTS, ids=lambda r: r["alert"])
def test_expr_is_inside_the_monitors_promql_subset(rule: dict[str, Any]) -> None:
    check(rule["expr"])


def test_every_alert_has_an_alert_rule_test() -> None:
    tested = {
        case["alertname"]
        for path in TEST_FILES
        for test in load_yaml(path)["tests"]
        for case in test.get("alert_rule_test", [])
    }
    untested = sorted({rule["alert"] for rule in ALERTS} - tested)
    assert not untested, f"alerts without an alert_rule_test: {untested}"


def test_the_checks_catch_what_they_look_for() -> None:
    """The anchor function is strict enough to fail."""
    assert github_anchor("FP8SaturationHigh") == "fp8saturationhigh"
    assert github_anchor("Severities and actions") == "severities-and-actions"
