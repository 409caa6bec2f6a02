"""The alert lifecycle (pending, for, firing, keep_firing_for, resolved), fingerprints, rule
reloads, and the state database that carries alerts over a restart."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lossguard.monitor.alert_store import AlertStore, AlertStoreError
from lossguard.monitor.promql import Sample, make_labels
from lossguard.monitor.rules.alerting import (
    AlertState,
    EvaluationFailed,
    RuleAlerts,
    TransitionKind,
    fingerprint,
)
from lossguard.monitor.rules.rulefile import RuleGroup, parse_rule_file
from lossguard.monitor.rules.ruleset import RuleSet

RULES = """
groups:
  - name: training
    rules:
      - alert: LossHigh
        expr: loss > 5
        for: 30s
        labels: {severity: critical, action: rollback}
        annotations:
          summary: "loss {{ $value }} on {{ $labels.run_id }}"
      - alert: Flappy
        expr: flappy > 0
        keep_firing_for: 20s
"""


def groups(text: str = RULES) -> list[RuleGroup]:
    return parse_rule_file(text, "rules.yml")


def sample(value: float, **labels: str) -> Sample:
    return Sample(make_labels({"__name__": "loss", **labels}), value)


def rule_alerts(name: str = "LossHigh") -> RuleAlerts:
    ruleset = RuleSet(groups())
    return next(e for e in ruleset.rules if e.rule.name == name)


def kinds(transitions: list) -> list[str]:
    return [t.kind.value for t in transitions]


def test_pending_then_firing_after_for_then_resolved() -> None:
    entry = rule_alerts()
    result = [sample(7.5, run_id="r1", rank="0")]
    assert kinds(entry.evaluate(result, 100)) == ["pending"]
    assert kinds(entry.evaluate(result, 120)) == []  # 20 s < for: 30s
    fired = entry.evaluate(result, 130)
    assert kinds(fired) == ["firing"]
    alert = fired[0].alert
    assert alert.labels == {
        "action": "rollback",
        "alertname": "LossHigh",
        "rank": "0",
        "run_id": "r1",
        "severity": "critical",
    }
    assert alert.annotations == {"summary": "loss 7.5 on r1"}
    assert (alert.active_at, alert.fired_at) == (100, 130)
    assert alert.fingerprint == fingerprint(alert.labels)
    resolved = entry.evaluate([], 140)
    assert kinds(resolved) == ["resolved"] and resolved[0].alert.fired_at == 130
    assert entry.alerts == {}


def test_pending_alert_that_goes_away_becomes_inactive_and_starts_over() -> None:
    entry = rule_alerts()
    assert kinds(entry.evaluate([sample(9)], 0)) == ["pending"]
    assert kinds(entry.evaluate([], 10)) == ["inactive"]
    assert kinds(entry.evaluate([sample(9)], 20)) == ["pending"]
    assert kinds(entry.evaluate([sample(9)], 45)) == []  # the for clock restarted at 20
    assert kinds(entry.evaluate([sample(9)], 50)) == ["firing"]


def test_value_and_annotations_follow_the_latest_evaluation() -> None:
    entry = rule_alerts()
    entry.evaluate([sample(6, run_id="r")], 0)
    entry.evaluate([sample(8, run_id="r")], 10)
    (alert,) = entry.alerts.values()
    assert alert.value == 8 and alert.annotations["summary"] == "loss 8 on r"


def test_keep_firing_for_holds_a_firing_alert_and_resets_when_it_returns() -> None:
    entry = rule_alerts("Flappy")
    on = [Sample(make_labels({"__name__": "flappy"}), 1)]
    assert kinds(entry.evaluate(on, 0)) == ["pending", "firing"]  # no for: fires at once
    assert kinds(entry.evaluate([], 10)) == []  # kept firing
    assert kinds(entry.evaluate(on, 15)) == []  # back: the keep clock resets
    assert kinds(entry.evaluate([], 20)) == []
    assert kinds(entry.evaluate([], 39)) == []  # 19 s < 20 s
    assert kinds(entry.evaluate([], 40)) == ["resolved"]


def test_scalar_result_is_one_alert_without_series_labels() -> None:
    (entry,) = RuleSet(groups("groups: [{name: g, rules: [{alert: A, expr: '1 < bool 2'}]}]")).rules
    fired = entry.evaluate(1.0, 0)
    assert kinds(fired) == ["pending", "firing"] and fired[0].alert.labels == {"alertname": "A"}


def test_duplicate_labelsets_and_group_limit_fail_without_changing_alerts() -> None:
    entry = rule_alerts()
    entry.evaluate([sample(6, run_id="a")], 0)
    twins = [sample(6, run_id="a"), Sample(make_labels({"__name__": "x", "run_id": "a"}), 7)]
    with pytest.raises(EvaluationFailed, match="same labelset"):
        entry.evaluate(twins, 10)
    assert next(iter(entry.alerts.values())).value == 6
    (limited,) = RuleSet(
        groups("groups: [{name: g, limit: 1, rules: [{alert: A, expr: up == 0}]}]")
    ).rules
    down = [Sample(make_labels({"__name__": "up", "i": str(i)}), 0) for i in range(2)]
    with pytest.raises(EvaluationFailed, match="exceeded limit of 1 with 2 alerts"):
        limited.evaluate(down, 0)


def test_failed_query_keeps_alerts_and_records_the_error() -> None:
    ruleset = RuleSet(groups())
    ruleset.evaluate(lambda rule, t: [sample(9)] if rule.name == "LossHigh" else [], 0)

    def broken(rule: object, t: float) -> list[Sample]:
        from lossguard.monitor.sources import SourceError

        raise SourceError("prometheus unreachable")

    assert ruleset.evaluate(broken, 10) == []
    entry = ruleset.rules[0]
    assert entry.last_error == "prometheus unreachable" and len(entry.alerts) == 1


@given(st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), st.text(max_size=8)))
def test_fingerprint_depends_only_on_the_label_set(labels: dict[str, str]) -> None:
    shuffled = dict(reversed(list(labels.items())))
    assert fingerprint(labels) == fingerprint(shuffled)
    assert len(fingerprint(labels)) == 16
    assert fingerprint({**labels, "zz_extra": "1"}) != fingerprint(labels)


def test_reload_keeps_alerts_of_unchanged_rules_and_ends_the_rest() -> None:
    ruleset = RuleSet(groups())
    ruleset.evaluate(lambda rule, t: [sample(9, run_id="r")], 0)
    ruleset.evaluate(lambda rule, t: [sample(9, run_id="r")], 40)
    edited = RULES.replace("flappy > 0", "flappy > 1").replace(
        "keep_firing_for: 20s", "labels: {severity: warning}"
    )
    new, ended = ruleset.replace(groups(edited), 50)
    assert [(t.alert.labels["alertname"], t.kind.value) for t in ended] == [("Flappy", "resolved")]
    loss = next(e for e in new.rules if e.rule.name == "LossHigh")
    assert [a.state for a in loss.alerts.values()] == [AlertState.FIRING]


def test_state_store_round_trip_and_one_transaction_per_evaluation(tmp_path: Path) -> None:
    store = AlertStore(tmp_path / "state" / "state.db")
    ruleset = RuleSet(groups())
    transitions = ruleset.evaluate(lambda rule, t: [sample(math.nan, run_id="r")], 0)
    store.record(ruleset.active(), transitions)
    assert [e.transition.kind.value for e in store.events()] == ["pending", "pending", "firing"]
    store.close()

    reopened = AlertStore(tmp_path / "state" / "state.db")
    restored, ended = RuleSet.restore(groups(), reopened.load_alerts(), 5)
    assert ended == []
    flappy = next(e for e in restored.rules if e.rule.name == "Flappy")
    (alert,) = flappy.alerts.values()
    assert alert.state is AlertState.FIRING and math.isnan(alert.value)
    assert alert.fingerprint == fingerprint(alert.labels)
    # the restored alert carries on: nothing is announced twice
    assert restored.evaluate(lambda rule, t: [sample(math.nan, run_id="r")], 10) == []
    # a rule that is gone after the restart: its alerts end, announced once
    only_loss = RULES.split("      - alert: Flappy")[0]
    _, ended = RuleSet.restore(groups(only_loss), reopened.load_alerts(), 20)
    assert [(t.kind, t.alert.rule) for t in ended] == [
        (TransitionKind.RESOLVED, "rules.yml:training/Flappy")
    ]
    assert sqlite3.connect(tmp_path / "state/state.db").execute(
        "PRAGMA journal_mode"
    ).fetchone() == ("wal",)


def test_unusable_state_database_is_a_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "state.db"
    bad.write_bytes(b"this is not a database" * 100)
    with pytest.raises(
        AlertStoreError, match=r"state database .*state\.db: file is not a database"
    ):
        AlertStore(bad)


def test_alerts_of_rules_that_need_older_history_are_held_not_resolved() -> None:
    text = "groups: [{name: g, rules: [{alert: NaN, expr: 'increase(nan_total[2m]) > 0'}]}]"
    ruleset = RuleSet(groups(text))
    nan = [Sample(make_labels({"run_id": "r"}), 1)]
    assert kinds(ruleset.evaluate(lambda rule, t: nan, 0)) == ["pending", "firing"]
    # restarted at 100 with no history before it: the 2m window cannot say it ended
    assert ruleset.evaluate(lambda rule, t: [], 150, history_start=100) == []
    assert kinds(ruleset.evaluate(lambda rule, t: [], 219, history_start=100)) == []
    assert kinds(ruleset.evaluate(lambda rule, t: [], 220, history_start=100)) == ["resolved"]


def test_limit_counts_only_alerts_that_stay() -> None:
    (entry,) = RuleSet(
        groups("groups: [{name: g, limit: 2, rules: [{alert: A, expr: up == 0}]}]")
    ).rules

    def down(*names: str) -> list[Sample]:
        return [Sample(make_labels({"__name__": "up", "i": n}), 0) for n in names]

    entry.evaluate(down("a", "b"), 0)
    moved = entry.evaluate(down("c", "d"), 10)  # a and b end as c and d start: 2 stay
    assert sorted(kinds(moved)) == [
        "firing",
        "firing",
        "pending",
        "pending",
        "resolved",
        "resolved",
    ]


def test_pending_alerts_are_not_held_while_history_is_short() -> None:
    text = "groups: [{name: g, rules: [{alert: S, expr: 'max_over_time(x[10m]) > 1', for: 5m}]}]"
    ruleset = RuleSet(groups(text))
    assert kinds(ruleset.evaluate(lambda rule, t: [sample(2)], 0)) == ["pending"]
    # after a restart: no history for the 10m window, but a pending alert must be observed
    assert kinds(ruleset.evaluate(lambda rule, t: [], 60, history_start=50)) == ["inactive"]


def test_an_unexpected_error_in_one_rule_leaves_the_others_running() -> None:
    ruleset = RuleSet(groups())

    def flaky(rule: object, t: float) -> list[Sample]:
        if getattr(rule, "name", "") == "LossHigh":
            raise RuntimeError("boom")
        return [Sample(make_labels({"__name__": "flappy"}), 1)]

    assert kinds(ruleset.evaluate(flaky, 0)) == ["pending", "firing"]
    assert ruleset.rules[0].last_error == "internal error: RuntimeError: boom"


def test_restarts_announce_ended_alerts_once_and_downtime_does_not_count_to_for(
    tmp_path: Path,
) -> None:
    from lossguard.monitor.config import MonitorConfig
    from lossguard.monitor.daemon import Monitor

    rules = tmp_path / "rules.yml"
    rules.write_text(RULES)
    config = MonitorConfig.model_validate(
        {
            "rules": {"files": [str(rules)]},
            "scrape": {"targets": ["http://127.0.0.1:9/metrics"]},
            "state": {"path": str(tmp_path / "state.db")},
            "listen": {"port": 0},
        }
    )
    monitor = Monitor(config)
    loss = next(e for e in monitor.ruleset.rules if e.rule.name == "LossHigh")
    flappy = next(e for e in monitor.ruleset.rules if e.rule.name == "Flappy")
    transitions = flappy.evaluate([Sample(make_labels({"__name__": "flappy"}), 1)], 100)
    transitions += loss.evaluate([sample(9)], 100)
    monitor.store.record(monitor.ruleset.active(), transitions, evaluated_at=100)
    monitor.close()

    rules.write_text(RULES.split("      - alert: Flappy")[0])  # Flappy removed
    for _ in range(3):
        restarted = Monitor(config)
        (pending,) = restarted.ruleset.rules[0].alerts.values()
        assert pending.active_at > 1000  # shifted by the downtime: its `for` starts over
        restarted.close()
    store = AlertStore(tmp_path / "state.db")
    assert [e.transition.kind.value for e in store.events()] == [
        "pending",
        "firing",
        "pending",
        "resolved",
    ]
    assert (tmp_path / "state.db").stat().st_mode & 0o777 == 0o600
