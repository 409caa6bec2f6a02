"""Inhibition: unit tests of the rule semantics and a differential test against a running
Alertmanager 0.25, which reports the inhibition of every alert in ``GET /api/v2/alerts``."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lossguard.common.config import ConfigError
from lossguard.monitor.notify.config import InhibitRuleConfig
from lossguard.monitor.notify.inhibit import Inhibitor
from tests.support.amserver import alertmanager
from tests.support.processes import wait_for

pytestmark = pytest.mark.live


def inhibitor(*rules: dict[str, Any]) -> Inhibitor:
    return Inhibitor([InhibitRuleConfig.model_validate(rule) for rule in rules])


CRITICAL_MUTES_WARNING = {
    "source_matchers": ['severity="critical"'],
    "target_matchers": ['severity="warning"'],
    "equal": ["run_id", "rank"],
}


def test_equal_labels() -> None:
    rules = inhibitor(CRITICAL_MUTES_WARNING)
    warning = {"alertname": "Slow", "severity": "warning", "run_id": "r1"}
    critical = {"alertname": "NaN", "severity": "critical", "run_id": "r1"}
    assert rules.inhibited(warning, [critical, warning])
    assert not rules.inhibited(warning, [{**critical, "run_id": "r2"}])
    assert not rules.inhibited(warning, [{**critical, "rank": "0"}])  # absent vs "0"
    assert rules.inhibited({**warning, "rank": "0"}, [{**critical, "rank": "0"}])
    assert rules.inhibited({**warning, "rank": ""}, [critical])  # "" is absent
    assert not rules.inhibited(critical, [critical, warning])  # not a target
    assert not rules.inhibited(warning, [{**critical, "severity": "page"}])  # not a source
    assert not rules.inhibited(warning, [])


def test_no_equal_labels_and_several_rules() -> None:
    rules = inhibitor(
        {"source_matchers": ["alertname=NodeDown"], "target_matchers": ['alertname!="NodeDown"']},
        CRITICAL_MUTES_WARNING,
    )
    down = {"alertname": "NodeDown", "node": "n1"}
    assert rules.inhibited({"alertname": "GPUHot", "node": "n9"}, [down])
    assert not rules.inhibited(down, [down, {"alertname": "NodeDown", "node": "n2"}])
    warning = {"severity": "warning", "run_id": "r"}
    critical = {"severity": "critical", "run_id": "r"}
    assert rules.inhibited(warning, iter([critical]))  # an iterator is read once for all rules


def test_an_alert_does_not_inhibit_its_own_kind() -> None:
    """Two-sided rule: when the target matches the source matchers too, only sources that do
    not match the target matchers count; an alert never inhibits itself."""
    rules = inhibitor(
        {
            "source_matchers": ['severity=~"critical|warning"'],
            "target_matchers": ['severity=~"warning|info"'],
            "equal": ["run_id"],
        }
    )
    warning = {"severity": "warning", "run_id": "r"}
    other_warning = {"severity": "warning", "run_id": "r", "rank": "1"}
    critical = {"severity": "critical", "run_id": "r"}
    info = {"severity": "info", "run_id": "r"}
    assert not rules.inhibited(warning, [warning, other_warning])
    assert rules.inhibited(warning, [warning, critical])
    assert rules.inhibited(info, [warning])  # info is no source, so any source counts


def test_bad_equal_label() -> None:
    with pytest.raises(ConfigError, match=r"^inhibit_rules\.1\.equal: invalid label name 'a-b'$"):
        inhibitor(CRITICAL_MUTES_WARNING, {**CRITICAL_MUTES_WARNING, "equal": ["a-b"]})


# ---------------------------------------------------------------- against Alertmanager

RULES: list[dict[str, Any]] = [
    {
        "source_matchers": ['severity="critical"'],
        "target_matchers": ['severity=~"warning|info"'],
        "equal": ["run_id"],
    },
    {
        "source_matchers": ['alertname="NodeDown"'],
        "target_matchers": ['alertname!="NodeDown"'],
        "equal": ["node", "zone"],
    },
    {
        "source_matchers": ['{severity=~"critical|warning", team="ml"}'],
        "target_matchers": ['severity=~"warning|info"'],
        "equal": ["team"],
    },
    # The probe: once the target is inhibited, Alertmanager has seen every alert before it.
    {"source_matchers": ['probe="source"'], "target_matchers": ['probe="target"']},
]
PROBE = [{"alertname": "Probe", "probe": "source"}, {"alertname": "Probe", "probe": "target"}]
LABEL_SETS = st.fixed_dictionaries(
    {"alertname": st.sampled_from(["NodeDown", "LossSpike", "GPUHot"])},
    optional={
        "severity": st.sampled_from(["critical", "warning", "info"]),
        "run_id": st.sampled_from(["r1", "r2"]),
        "node": st.sampled_from(["n1", "n2"]),
        "zone": st.just("eu"),
        "team": st.sampled_from(["ml", "web"]),
    },
)
HAND_PICKED: list[dict[str, str]] = [
    {"alertname": "LossSpike", "severity": "critical", "run_id": "r1"},
    {"alertname": "LossSpike", "severity": "warning", "run_id": "r1"},  # by the first
    {"alertname": "GPUHot", "severity": "info", "run_id": "r2"},
    {"alertname": "NodeDown", "node": "n1"},
    {"alertname": "GPUHot", "node": "n1"},  # by NodeDown
    {"alertname": "GPUHot", "node": "n1", "zone": "eu"},
    {"alertname": "GPUHot", "severity": "warning", "team": "ml", "run_id": "r3"},  # two-sided
    {"alertname": "LossSpike", "severity": "info", "team": "ml"},  # by the one above
]


def test_hand_picked_alerts() -> None:
    """The hand-picked alerts alone (the first case of the test against Alertmanager)."""
    ours = Inhibitor([InhibitRuleConfig.model_validate(rule) for rule in RULES])
    assert [ours.inhibited(labels, HAND_PICKED) for labels in HAND_PICKED] == [
        False, True, False, False, True, False, False, True
    ]  # fmt: skip


@example(drawn=[])
@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(LABEL_SETS, max_size=25))
def test_inhibition_as_alertmanager(tmp_path: Path, drawn: list[dict[str, str]]) -> None:
    alerts = HAND_PICKED + drawn + PROBE
    config = {
        "route": {"receiver": "blackhole"},
        "receivers": [{"name": "blackhole"}],
        "inhibit_rules": RULES,
    }
    with alertmanager(Path(tempfile.mkdtemp(dir=tmp_path)), config) as am:
        am.post_firing(alerts)

        def probe_inhibited() -> bool:
            return any(a["labels"] == PROBE[1] and a["status"]["inhibitedBy"] for a in am.alerts())

        wait_for(probe_inhibited, 10, "Alertmanager to inhibit the probe")
        theirs = {_key(a["labels"]): bool(a["status"]["inhibitedBy"]) for a in am.alerts()}
    ours = Inhibitor([InhibitRuleConfig.model_validate(rule) for rule in RULES])
    assert theirs == {_key(labels): ours.inhibited(labels, alerts) for labels in alerts}


def _key(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))
