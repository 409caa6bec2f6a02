"""Alerts from Alertmanager's webhook act only when the monitor corroborates them: a loaded
rule of that name asking for that action, a run the monitor knows, and the rule's expression
showing that run on the monitor's own source (an alert that view does not show yet waits for
it, CONFIRM_WITHIN_S or three of its scrape and evaluation intervals where longer). Each
refusal is recorded once, with why, and nothing is sent."""

from __future__ import annotations

from pathlib import Path

import pytest

from lossguard.monitor.actions.corroborate import (
    CONFIRM_WITHIN_S,
    Corroborator,
    confirm_window_s,
)
from lossguard.monitor.actions.engine import Actions
from lossguard.monitor.actions.intake import IncomingAlert
from lossguard.monitor.actions.policy import ActionsConfig
from lossguard.monitor.actions.store import ActionStore
from lossguard.monitor.alert_store import AlertStore
from lossguard.monitor.notify.silences import SilenceStore
from lossguard.monitor.promql import MemoryStorage, Value, evaluate
from lossguard.monitor.rules.rulefile import parse_rule_file
from lossguard.monitor.sources import SourceError

T0 = 1_700_000_000.0
RULES = parse_rule_file(
    """
groups:
  - name: g
    rules:
      - alert: LossNonFinite
        expr: lossguard_nonfinite_step{signal="loss"} >= 0
        labels: {severity: critical, action: rollback}
      - alert: Stalled
        expr: lossguard_step < 0
        labels: {severity: warning}
"""
)
KNOWN_RUNS = {"victim", "healthy"}


def labels(run: str = "victim", name: str = "LossNonFinite", action: str = "rollback"):
    return {"alertname": name, "run_id": run, "rank": "0", "action": action}


def storage() -> MemoryStorage:
    """The monitor's own scrape: the victim saw a NaN at step 55; the healthy run none."""
    store = MemoryStorage()
    for run, step in (("victim", 55.0), ("healthy", -1.0)):
        series = {
            "__name__": "lossguard_nonfinite_step",
            "signal": "loss",
            "run_id": run,
            "rank": "0",
            "job": "lossguard-agent",
            "instance": "127.0.0.1:9410",
        }
        store.add(series, T0 - 1, step)
    return store


class Pipeline:
    def __init__(
        self, tmp_path: Path, query=None, confirm_within_s: float = CONFIRM_WITHIN_S
    ) -> None:
        state = AlertStore(tmp_path / "state.db")
        self.store = ActionStore(state)
        self.observed: list[tuple[str, str]] = []
        data = storage()
        self.actions = Actions(
            ActionsConfig.model_validate({}),
            state,
            SilenceStore(state),
            runs_root=None,
            observe=lambda kind, result: self.observed.append((kind, result)),
            on_done=lambda _: None,
            corroborator=Corroborator(
                lambda: [rule for group in RULES for rule in group.rules],
                KNOWN_RUNS.__contains__,
                query or (lambda expr, t: evaluate(expr, data, t)),
                confirm_within_s=confirm_within_s,
            ),
            step_of=lambda run, now: None,
            announce_for_s=3600,
        )

    def receive(self, alert_labels: dict[str, str], starts_at: float = T0 - 5):
        return self.actions.receive(
            [IncomingAlert("firing", alert_labels, {}, starts_at, None, "", "")], T0
        )


@pytest.mark.parametrize(
    ("alert_labels", "reason"),
    [
        (labels(name="Forged"), "alertname 'Forged' is not a rule the monitor loaded"),
        (labels(action="stop"), "rule LossNonFinite asks for rollback, not action 'stop'"),
        (labels(name="Stalled", action="stop"), "rule Stalled asks for no action, not action"),
        (labels(run="elsewhere"), "run 'elsewhere' is not one the monitor knows"),
        ({**labels(), "run_id": ""}, "the alert has no run_id label"),
    ],
)
def test_an_alert_against_the_rules_is_refused_at_once_and_once_with_why(
    tmp_path: Path, alert_labels: dict[str, str], reason: str
) -> None:
    pipeline = Pipeline(tmp_path)
    (refused,) = pipeline.receive(alert_labels)
    assert reason in refused.reason
    assert pipeline.actions.step([], T0 + 1) == 0, "nothing is decided"
    assert pipeline.receive(alert_labels) == [refused], "a replay is refused again"
    (record,) = pipeline.store.recent(10)
    assert record.state == "refused" and record.origin == "alertmanager"
    assert reason in record.reason and record.id.endswith("-refused")
    assert pipeline.observed == [(alert_labels["action"], "refused")], "recorded once"


@pytest.mark.parametrize(
    ("alert_labels", "reason"),
    [
        (labels(run="healthy"), "not confirmed: the monitor's own view shows no LossNonFinite"),
        ({**labels(), "rank": "1"}, "not confirmed"),
    ],
)
def test_an_alert_the_monitor_never_sees_is_refused_once_after_waiting_for_it(
    tmp_path: Path, alert_labels: dict[str, str], reason: str
) -> None:
    pipeline = Pipeline(tmp_path)
    assert pipeline.receive(alert_labels) == [], "held: the monitor's scrape may be behind"
    assert pipeline.actions.step([], T0 + CONFIRM_WITHIN_S - 1) == 0
    assert pipeline.store.recent(10) == [], "not refused yet"
    for _ in range(2):  # a repeat while held changes nothing; the one after is held again
        assert pipeline.actions.step([], T0 + CONFIRM_WITHIN_S) == 0
        assert pipeline.receive(alert_labels) == []
    (record,) = pipeline.store.recent(10)
    assert record.state == "refused" and record.origin == "alertmanager"
    assert reason in record.reason and record.id.endswith("-refused")
    assert pipeline.actions.step([], T0 + 3 * CONFIRM_WITHIN_S) == 0
    assert len(pipeline.store.recent(10)) == 1
    assert pipeline.observed == [(alert_labels["action"], "refused")], "recorded once"


def test_an_alert_waits_longer_for_a_view_that_updates_slowly(tmp_path: Path) -> None:
    window = confirm_window_s(15 + 15)  # a 15 s scrape, then a 15 s evaluation
    assert window == 90 and confirm_window_s(1 + 1) == CONFIRM_WITHIN_S
    pipeline = Pipeline(tmp_path, confirm_within_s=window)
    assert pipeline.receive(labels(run="healthy")) == []
    assert pipeline.actions.step([], T0 + window - 1) == 0
    assert pipeline.store.recent(10) == [], "still held"
    assert pipeline.actions.step([], T0 + window) == 0
    (record,) = pipeline.store.recent(10)
    assert record.state == "refused" and "not confirmed" in record.reason


SCRAPING = {"scrape": {"interval": "15s", "targets": ["http://127.0.0.1:9/metrics"]}}
QUERYING = {"source": "prometheus", "prometheus": {"url": "http://127.0.0.1:9"}}


@pytest.mark.parametrize(
    ("source", "window"), [(SCRAPING, 90.0), (QUERYING, 45.0)], ids=["scrape", "prometheus"]
)
def test_the_monitor_holds_alerts_for_its_own_view_s_update_time(
    tmp_path: Path, source: dict[str, object], window: float
) -> None:
    """A 15 s evaluation, after a 15 s scrape where the monitor scrapes: 3 x 30 s, or 3 x 15 s
    where its view is the Prometheus that alerted."""
    from lossguard.monitor.config import MonitorConfig
    from lossguard.monitor.daemon import Monitor

    rules = tmp_path / "rules.yml"
    rules.write_text("groups: []\n")
    config = MonitorConfig.model_validate(
        {
            "rules": {"files": [str(rules)], "evaluation_interval": "15s"},
            "state": {"path": str(tmp_path / "state.db")},
            "listen": {"port": 0},
            **source,
        }
    )
    monitor = Monitor(config)
    try:
        assert monitor.actions.corroborator.confirm_within_s == window
    finally:
        monitor.close()


def test_a_confirmed_alert_acts_once_however_often_it_comes(tmp_path: Path) -> None:
    pipeline = Pipeline(tmp_path)
    assert pipeline.receive(labels()) == []
    assert pipeline.actions.step([], T0 + 1) == 1
    for _ in range(3):  # Alertmanager's repeats, or a replay of the same payload
        assert pipeline.receive(labels()) == []
        assert pipeline.actions.step([], T0 + 2) == 0
    (record,) = pipeline.store.recent(10)
    assert record.state == "pending" and record.kind == "rollback"


def test_who_scraped_a_series_does_not_matter(tmp_path: Path) -> None:
    """Prometheus's job and instance labels differ from the monitor's own scrape."""
    pipeline = Pipeline(tmp_path)
    forwarded = {**labels(), "job": "prometheus-job", "instance": "agent:9410"}
    assert pipeline.receive(forwarded) == []


def test_a_source_that_cannot_answer_confirms_nothing(tmp_path: Path) -> None:
    def down(expr: str, t: float) -> Value:
        raise SourceError("Prometheus at http://127.0.0.1:1: connection refused")

    pipeline = Pipeline(tmp_path, down)
    assert pipeline.receive(labels()) == []
    assert pipeline.actions.step([], T0 + CONFIRM_WITHIN_S) == 0
    (refused,) = pipeline.store.recent(10)
    assert "not confirmed" in refused.reason and "connection refused" in refused.reason


def test_an_alert_before_the_monitor_sees_it_acts_once_it_does(tmp_path: Path) -> None:
    """Alertmanager may be quicker than the monitor's own scrape: the alert waits for the
    monitor's view and acts when it shows the run, with no refusal."""
    seen: list[bool] = [False]
    data = storage()

    def query(expr: str, t: float) -> Value:
        return evaluate(expr, data, t) if seen[0] else []

    pipeline = Pipeline(tmp_path, query)
    assert pipeline.receive(labels()) == []
    assert pipeline.actions.step([], T0 + 1) == 0, "not shown yet: nothing decided"
    seen[0] = True
    assert pipeline.actions.step([], T0 + 2) == 1
    assert pipeline.receive(labels()) == [] and pipeline.actions.step([], T0 + 3) == 0
    assert [r.state for r in pipeline.store.recent(10)] == ["pending"]


def test_an_alert_resolved_while_waiting_is_neither_taken_nor_refused(tmp_path: Path) -> None:
    pipeline = Pipeline(tmp_path, lambda expr, t: [])
    assert pipeline.receive(labels()) == []
    resolved = IncomingAlert("resolved", labels(), {}, T0 - 5, None, "", "")
    assert pipeline.actions.receive([resolved], T0 + 1) == []
    assert pipeline.actions.step([], T0 + 2 * CONFIRM_WITHIN_S) == 0
    assert pipeline.store.recent(10) == []


def test_a_made_up_action_label_does_not_grow_the_metric(tmp_path: Path) -> None:
    pipeline = Pipeline(tmp_path)
    for n in range(3):
        pipeline.receive({**labels(), "action": f"made-up-{n}\n"})
    assert pipeline.observed == [("unknown", "refused")] * 3
