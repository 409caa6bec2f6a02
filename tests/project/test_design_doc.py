"""docs/design.md, the map and the contracts, cannot drift from the code silently: every metric
of the three catalogues, every alert (the rules file's and the monitor's own), every control
command, argument and error code, every audit event, run-directory file, exit code, config
section and action policy key is in it, and its tables agree with the definitions (a metric's
type and labels, an alert's severity, action, announce and for, an exit code's number). Its
links resolve, and no doc links to the design page outside the repository. Fast: reads files
and imports torch-free modules; starts nothing."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import yaml

from lossguard.agent.config import Config
from lossguard.common import catalogue, exitcodes
from lossguard.common.control.protocol import COMMAND_ARGS, SUPERVISOR_COMMAND_ARGS, ErrorCode
from lossguard.common.rundir import events, names
from lossguard.monitor import metrics as monitor_metrics
from lossguard.monitor.actions import outcomes
from lossguard.monitor.actions.policy import ACTIONS, ActionsConfig, RollbackPolicy
from lossguard.monitor.config import MonitorConfig
from lossguard.monitor.sources.announced import REFUSAL_REASONS
from lossguard.supervisor import metrics as supervisor_metrics

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
DESIGN = DOCS / "design.md"
RULES = REPO / "alerts" / "lossguard.rules.yml"
LINK = re.compile(r"\]\(([^)\s]+)\)")


@functools.cache
def design() -> str:
    return DESIGN.read_text(encoding="utf-8")


@functools.cache
def table_rows() -> dict[str, list[list[str]]]:
    """Every table row of design.md by its first cell (backticks kept), as its cells."""
    rows: dict[str, list[list[str]]] = {}
    for line in design().splitlines():
        if not line.startswith("|") or set(line) <= {"|", "-", " "}:
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows.setdefault(cells[0], []).append(cells)
    return rows


def row(key: str) -> list[str]:
    """The one table row whose first cell is ``key``."""
    found = table_rows().get(key, [])
    assert len(found) == 1, f"docs/design.md: expected one table row for {key}, found {len(found)}"
    return found[0]


def named(word: str) -> bool:
    """Whether design.md names ``word`` in code (backticks), alone or in a list of them."""
    pattern = rf"`[^`\n]*(?<!\w){re.escape(word)}(?!\w)[^`\n]*`"
    return re.search(pattern, design()) is not None


def metric_entries() -> list[tuple[str, str, tuple[str, ...]]]:
    """(exposed name, type, labels as documented) of every catalogue's every metric."""
    tables = [
        (catalogue.PREFIX, catalogue.CATALOGUE),
        (monitor_metrics.PREFIX, monitor_metrics.CATALOGUE),
        ("", monitor_metrics.RUN_CATALOGUE),
        (supervisor_metrics.PREFIX, supervisor_metrics.CATALOGUE),
    ]
    return [
        (prefix + name + ("_total" if kind == "counter" else ""), kind, labels)
        for prefix, entries in tables
        for name, (kind, _, labels) in entries.items()
    ]


@pytest.mark.parametrize(("metric", "kind", "labels"), metric_entries())
def test_every_metric_is_in_the_catalogue_tables(
    metric: str, kind: str, labels: tuple[str, ...]
) -> None:
    cells = row(f"`{metric}`")
    assert cells[1] == kind, f"{metric}: documented as a {cells[1]}, declared a {kind}"
    assert cells[2].strip("`") == ",".join(labels), f"{metric}: labels {cells[2]} != {labels}"


def rule_alerts() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


@pytest.mark.parametrize("rule", rule_alerts(), ids=lambda rule: rule["alert"])
def test_every_alert_is_in_the_alert_table(rule: dict) -> None:
    labels = rule["labels"]
    cells = row(f"`{rule['alert']}`")
    documented = cells[1:5]
    declared = [
        labels["severity"],
        labels.get("action", ""),
        labels.get("announce", ""),
        rule.get("for", "0s"),
    ]
    assert documented == declared, f"{rule['alert']}: severity, action, announce, for"


def test_the_monitors_own_alerts_are_documented() -> None:
    for name, severity in (
        (outcomes.TAKEN, "info"),
        (outcomes.FAILED, "critical"),
        (outcomes.EXHAUSTED, "critical"),
    ):
        assert row(f"`{name}`")[1] == severity, name
    assert named('announce="once"') and named("action_id")


def test_every_action_is_named() -> None:
    for action in ACTIONS:
        assert named(action), action


def test_every_control_command_argument_and_error_code_is_documented() -> None:
    for commands in (COMMAND_ARGS, SUPERVISOR_COMMAND_ARGS):
        for command, args in commands.items():
            assert named(command), f"command {command}"
            for arg in args.model_fields:
                assert named(arg), f"{command}: argument {arg}"
    for code in ErrorCode:
        row(f"`{code.value}`")
    for reason in catalogue.CONTROL_REFUSALS:
        assert named(reason), f"control refusal {reason}"


def module_strings(module: object) -> list[str]:
    return [
        value
        for key, value in vars(module).items()
        if key.isupper() and not key.startswith("_") and isinstance(value, str)
    ]


@pytest.mark.parametrize("event", module_strings(events))
def test_every_event_is_documented(event: str) -> None:
    assert named(event), f"events.jsonl event {event}"


@pytest.mark.parametrize("name", module_strings(names))
def test_every_run_directory_file_is_documented(name: str) -> None:
    assert named(name), f"run directory file {name}"


@pytest.mark.parametrize(("outcome", "code"), exitcodes.EXIT_CODES.items())
def test_every_exit_code_is_documented(outcome: str, code: int) -> None:
    assert row(outcome)[1] == str(code), outcome


@pytest.mark.parametrize(
    "section", [*Config.model_fields, *MonitorConfig.model_fields], ids=lambda name: name
)
def test_every_config_section_is_in_a_table(section: str) -> None:
    row(f"`{section}`")


def test_every_action_policy_key_is_in_the_policy_table() -> None:
    for key in ActionsConfig.model_fields:
        if key != "rollback":
            row(f"`{key}`")
    for key in RollbackPolicy.model_fields:
        row(f"`rollback.{key}`")


def test_every_discovery_refusal_reason_is_named() -> None:
    for reason in REFUSAL_REASONS:
        assert named(reason), reason


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE)}


def test_every_link_of_the_design_page_resolves() -> None:
    for target in LINK.findall(design()):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        file = (DESIGN.parent / path).resolve() if path else DESIGN
        assert file.exists(), f"docs/design.md links to {target}: no such file"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file), f"docs/design.md links to {target}: no such heading"


def test_docs_link_to_the_design_page_in_the_repository() -> None:
    for doc in [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = doc.read_text(encoding="utf-8")
        assert "shared/DESIGN.md" not in text, f"{doc.relative_to(REPO)} links outside the repo"
    assert "(docs/design.md)" in (REPO / "README.md").read_text(encoding="utf-8")
