"""The dispatcher on a real state database with an explicit clock: grouping, group_wait,
group_interval, repeat_interval, send_resolved, routing with continue, inhibition, silences,
one PagerDuty event per group notification, and a restart in the middle that neither loses nor
repeats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lossguard.monitor.alert_store import AlertStore
from lossguard.monitor.notify.config import NotificationsConfig, read_secrets
from lossguard.monitor.notify.dispatcher import KEEP_S, PRUNE_EVERY_S, Dispatcher
from lossguard.monitor.notify.integrations import build_integrations
from lossguard.monitor.notify.model import Notification
from lossguard.monitor.notify.silences import SilenceStore
from lossguard.monitor.notify.store import DEAD, DELIVERED, PENDING, NotifyStore
from lossguard.monitor.rules.alerting import (
    Alert,
    AlertState,
    Transition,
    TransitionKind,
    fingerprint,
)

ENV = {"T_SLACK": "http://127.0.0.1:9/services/T/B/secret", "T_PD": "k" * 32}


def notifications(**route: Any) -> dict[str, Any]:
    """Slack gets everything grouped by alertname and run; PagerDuty also gets critical."""
    return {
        "receivers": [
            {"name": "slack", "slack_configs": [{"api_url_env": "T_SLACK"}]},
            {"name": "pager", "pagerduty_configs": [{"routing_key_env": "T_PD"}]},
            {"name": "quiet", "log_configs": [{"send_resolved": False}]},
        ],
        "route": {
            "receiver": "slack",
            "group_by": ["alertname", "run_id"],
            "group_wait": "5s",
            "group_interval": "10s",
            "repeat_interval": "1h",
            **route,
        },
    }


class Harness:
    def __init__(self, path: Path, config: dict[str, Any], monkeypatch: pytest.MonkeyPatch):
        for name, value in ENV.items():
            monkeypatch.setenv(name, value)
        self.path = path
        self.config = NotificationsConfig.model_validate(config)
        self.state = AlertStore(path)
        self.dispatcher = self._dispatcher()
        self.firing: dict[str, dict[str, str]] = {}

    def _dispatcher(self) -> Dispatcher:
        integrations = build_integrations(self.config, read_secrets(self.config), "")
        return Dispatcher(self.state, self.config, integrations)

    def restart(self, config: dict[str, Any] | None = None) -> None:
        if config is not None:
            self.config = NotificationsConfig.model_validate(config)
        self.state.close()
        self.state = AlertStore(self.path)
        self.dispatcher = self._dispatcher()

    def change(self, kind: TransitionKind, t: float, **labels: str) -> None:
        fp = fingerprint(labels)
        alert = Alert("rules.yml:g/x", fp, labels, {"summary": "s"}, AlertState.FIRING, 1.0, t, t)
        self.state.record({}, [Transition(kind, t, alert)])
        if kind is TransitionKind.FIRING:
            self.firing[fp] = labels
        else:
            self.firing.pop(fp, None)

    def fire(self, t: float, **labels: str) -> None:
        self.change(TransitionKind.FIRING, t, **labels)

    def resolve(self, t: float, **labels: str) -> None:
        self.change(TransitionKind.RESOLVED, t, **labels)

    def step(self, now: float) -> list[Notification]:
        ids = self.dispatcher.step(now, list(self.firing.values()))
        entries = {e.id: e for e in NotifyStore(self.state).entries(PENDING, 1000)}
        return [entries[i].notification for i in ids]


def summary(notes: list[Notification]) -> list[tuple[str, list[tuple[str, str]]]]:
    """(receiver, [(alertname/run, status)]) of each notification."""
    return [
        (
            n.receiver,
            [(f"{a.labels['alertname']}/{a.labels.get('run_id', '')}", a.status) for a in n.alerts],
        )
        for n in notes
    ]


@pytest.fixture
def harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Harness:
    return Harness(tmp_path / "state.db", notifications(), monkeypatch)


def test_alerts_are_grouped_and_wait_for_group_wait_then_group_interval(harness: Harness) -> None:
    h = harness
    h.fire(0, alertname="LossSpike", run_id="a", rank="0")
    h.fire(1, alertname="LossSpike", run_id="a", rank="1")
    h.fire(1, alertname="LossSpike", run_id="b", rank="0")
    assert h.step(4.9) == []  # group_wait 5s from the group's first alert
    notes = h.step(5)
    assert summary(notes) == [
        ("slack", [("LossSpike/a", "firing"), ("LossSpike/a", "firing")]),
    ]
    assert notes[0].group_key == '{}:{alertname="LossSpike", run_id="a"}'
    assert notes[0].group_labels == {"alertname": "LossSpike", "run_id": "a"}
    assert summary(h.step(6)) == [("slack", [("LossSpike/b", "firing")])]
    h.fire(7, alertname="LossSpike", run_id="a", rank="2")
    assert h.step(14.9) == []  # the group flushed at 5: next tick at 15
    notes = h.step(15)
    assert [len(n.alerts) for n in notes] == [3]  # the whole group, as Alertmanager sends it
    assert h.step(24) == []  # nothing changed, repeat_interval not reached


def test_resolved_is_sent_once_and_the_group_ends(harness: Harness) -> None:
    h = harness
    h.fire(0, alertname="LossSpike", run_id="a")
    assert len(h.step(5)) == 1
    h.resolve(8, alertname="LossSpike", run_id="a")
    notes = h.step(15)
    assert summary(notes) == [("slack", [("LossSpike/a", "resolved")])]
    assert notes[0].status == "resolved" and notes[0].alerts[0].ends_at == 8
    assert h.step(25) == [] and h.dispatcher.next_flush() is None


def test_an_announcement_is_told_once_when_it_fires_never_as_resolved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped routes (configs/monitor.yml, uncommented): announcements go to the team
    channel one group each, after the root's 30 s group_wait, whatever else fires for the run;
    criticals page; info tells no one."""
    routes = [
        {"receiver": "slack", "matchers": ['announce="once"'], "group_by": ["..."]},
        {"receiver": "pager", "matchers": ['severity="critical"'], "continue": True},
        {"receiver": "slack", "matchers": ['severity=~"critical|warning"']},
    ]
    h = Harness(
        tmp_path / "state.db",
        notifications(receiver="quiet", group_wait="30s", group_interval="5m", routes=routes),
        monkeypatch,
    )
    action = {"alertname": "ActionTaken", "run_id": "a", "severity": "info", "announce": "once"}
    h.fire(0, **action, action_id="lg-1")
    h.fire(1, alertname="LossNonFinite", run_id="a", severity="info", action="rollback")
    h.fire(2, **action, action_id="lg-2")
    assert h.step(29) == []
    assert summary(h.step(30)) == [("slack", [("ActionTaken/a", "firing")])]
    assert summary(h.step(31)) == [("quiet", [("LossNonFinite/a", "firing")])]
    assert summary(h.step(32)) == [("slack", [("ActionTaken/a", "firing")])]  # its own group
    h.resolve(100, alertname="LossNonFinite", run_id="a", severity="info", action="rollback")
    assert h.step(331) == []  # the quiet receiver takes no resolved
    h.resolve(3600, **action, action_id="lg-1")
    h.resolve(3602, **action, action_id="lg-2")
    assert h.step(4000) == [] and h.step(8000) == []  # never told as resolved, nor repeated


def test_an_alert_that_resolves_before_it_was_sent_is_never_sent(harness: Harness) -> None:
    h = harness
    h.fire(0, alertname="Blip", run_id="a")
    h.resolve(2, alertname="Blip", run_id="a")
    assert h.step(5) == [] and h.step(100) == []


def test_repeat_interval_sends_again_while_firing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(tmp_path / "s.db", notifications(repeat_interval="30s"), monkeypatch)
    h.fire(0, alertname="Stalled", run_id="a")
    assert len(h.step(5)) == 1
    assert h.step(15) == [] and h.step(25) == []
    assert summary(h.step(35)) == [("slack", [("Stalled/a", "firing")])]  # 30s after 5
    assert h.step(45) == []


def test_routes_with_continue_and_send_resolved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    routes = [
        {"receiver": "pager", "matchers": ['severity="critical"'], "continue": True},
        {"matchers": ['severity=~"critical|warning"']},  # inherits the root's receiver
        {"receiver": "quiet", "matchers": ["severity=info"]},
    ]
    h = Harness(tmp_path / "s.db", notifications(routes=routes), monkeypatch)
    h.fire(0, alertname="NaN", run_id="a", severity="critical", rank="0")
    h.fire(0, alertname="NaN", run_id="a", severity="critical", rank="1")
    h.fire(0, alertname="Note", run_id="a", severity="info")
    notes = h.step(5)
    # PagerDuty gets one event for the group, as Slack does; continue lets the critical alerts
    # reach Slack too
    assert sorted((n.receiver, len(n.alerts)) for n in notes) == [
        ("pager", 2),
        ("quiet", 1),
        ("slack", 2),
    ]
    h.resolve(6, alertname="NaN", run_id="a", severity="critical", rank="0")
    h.resolve(6, alertname="Note", run_id="a", severity="info")
    notes = h.step(15)
    # quiet has send_resolved false: it is told nothing
    assert sorted(summary(notes)) == [
        ("pager", [("NaN/a", "firing"), ("NaN/a", "resolved")]),  # the whole group again
        ("slack", [("NaN/a", "firing"), ("NaN/a", "resolved")]),
    ]


def test_a_critical_alert_inhibits_the_warnings_of_its_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = notifications()
    config["inhibit_rules"] = [
        {
            "source_matchers": ['severity="critical"'],
            "target_matchers": ['severity="warning"'],
            "equal": ["run_id"],
        }
    ]
    h = Harness(tmp_path / "s.db", config, monkeypatch)
    h.fire(0, alertname="LossNonFinite", run_id="a", severity="critical")
    h.fire(0, alertname="LossSpike", run_id="a", severity="warning")
    h.fire(0, alertname="LossSpike", run_id="b", severity="warning")
    assert sorted(summary(h.step(5))) == [
        ("slack", [("LossNonFinite/a", "firing")]),
        ("slack", [("LossSpike/b", "firing")]),
    ]
    h.resolve(6, alertname="LossNonFinite", run_id="a", severity="critical")
    # the source is gone: the warning it held back is sent at its group's next tick
    assert sorted(summary(h.step(15))) == [
        ("slack", [("LossNonFinite/a", "resolved")]),
        ("slack", [("LossSpike/a", "firing")]),
    ]


def test_silences_hold_alerts_back_until_they_expire(harness: Harness) -> None:
    h = harness
    silences = SilenceStore(h.state)
    silence = silences.add(["alertname=LossSpike", 'run_id="a"'], 0, 3600, "ann", "known", 0)
    h.fire(0, alertname="LossSpike", run_id="a")
    h.fire(0, alertname="LossSpike", run_id="b")
    assert summary(h.step(5)) == [("slack", [("LossSpike/b", "firing")])]
    assert h.step(15) == []
    silences.expire(silence.id, 20)
    assert summary(h.step(25)) == [("slack", [("LossSpike/a", "firing")])]
    # silenced after it was sent: quiet while it fires, but its end is still told
    silences.add(["alertname=LossSpike"], 26, 3600, "ann", "ack'ed", 26)
    h.fire(27, alertname="LossSpike", run_id="a", rank="1")
    assert h.step(35) == []
    h.resolve(36, alertname="LossSpike", run_id="a")
    assert summary(h.step(45)) == [("slack", [("LossSpike/a", "resolved")])]


def test_a_restart_between_steps_neither_loses_nor_repeats(harness: Harness) -> None:
    h = harness
    h.fire(0, alertname="LossSpike", run_id="a")
    h.step(1)  # consumed into its group, not yet due
    h.restart()
    assert len(h.step(5)) == 1  # the group and its timing survived
    h.restart()
    assert h.step(15) == []  # and what it was told
    h.resolve(16, alertname="LossSpike", run_id="a")
    h.restart()
    assert summary(h.step(25)) == [("slack", [("LossSpike/a", "resolved")])]


def test_events_recorded_before_notifications_existed_are_not_replayed(tmp_path: Path) -> None:
    state = AlertStore(tmp_path / "old.db")
    labels = {"alertname": "Old"}
    alert = Alert("r", fingerprint(labels), labels, {}, AlertState.FIRING, 1.0, 0, 0)
    state.record({}, [Transition(TransitionKind.FIRING, 0, alert)])
    store = NotifyStore(state)  # the first start with notifications
    with state.reading() as db:
        assert NotifyStore.cursor(db) == 1
    assert store.counts()[PENDING] == 0


def test_delivered_notifications_and_consumed_events_are_kept_a_week(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(tmp_path / "s.db", notifications(repeat_interval="1y"), monkeypatch)
    h.fire(0, alertname="Old", run_id="a")
    assert len(h.step(5)) == 1
    store = NotifyStore(h.state)
    (entry,) = store.entries(PENDING)
    store.delivered(entry.id, 6)
    h.fire(10, alertname="Dead", run_id="b")
    h.step(15)
    (dead,) = store.entries(PENDING)
    store.failed(dead.id, "HTTP 404 no_service", None, 16)
    assert h.step(KEEP_S) == []  # less than a week since the delivery
    assert store.counts() == {PENDING: 0, DELIVERED: 1, DEAD: 1}
    h.step(KEEP_S + PRUNE_EVERY_S + 10)
    assert store.counts() == {PENDING: 0, DELIVERED: 0, DEAD: 1}  # dead letters stay
    assert h.state.events() == []


def test_alerts_routed_before_a_config_change_still_end_where_they_began(
    harness: Harness,
) -> None:
    h = harness
    h.fire(0, alertname="LossSpike", run_id="a")
    assert summary(h.step(5)) == [("slack", [("LossSpike/a", "firing")])]
    # the receivers and the grouping change while it fires
    h.restart(notifications(receiver="pager", group_by=["alertname"]))
    h.fire(6, alertname="LossSpike", run_id="b")
    assert summary(h.step(11)) == [("pager", [("LossSpike/b", "firing")])]  # new: new routes
    h.resolve(12, alertname="LossSpike", run_id="a")
    # Slack was told it fires, so Slack hears it resolve; PagerDuty never knew of it
    assert summary(h.step(25)) == [("slack", [("LossSpike/a", "resolved")])]
    assert h.step(35) == []
