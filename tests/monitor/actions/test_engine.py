"""The actions pipeline's decisions on a real state database: one action per alert instance,
attempts counted in steps, cooldown, budget and the RollbacksExhausted page, announcements and
ActionFailed pages, silences, dry runs, and the runner's retries against an agent that cannot be
reached."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from lossguard.monitor.actions.corroborate import Corroborator
from lossguard.monitor.actions.describe import describe, diagnosis_text
from lossguard.monitor.actions.diagnosis import latest_diagnosis
from lossguard.monitor.actions.endpoints import Endpoints
from lossguard.monitor.actions.engine import Actions
from lossguard.monitor.actions.intake import IncomingAlert
from lossguard.monitor.actions.model import ActionAlert, ActionRecord
from lossguard.monitor.actions.next_steps import next_steps
from lossguard.monitor.actions.outcomes import Outcomes
from lossguard.monitor.actions.planner import ActionPlanner
from lossguard.monitor.actions.policy import ActionsConfig
from lossguard.monitor.actions.raised import RaisedAlerts
from lossguard.monitor.actions.runner import ActionRunner
from lossguard.monitor.actions.store import ActionStore
from lossguard.monitor.alert_store import AlertStore
from lossguard.monitor.notify.silences import SilenceStore
from lossguard.monitor.promql import Sample
from lossguard.monitor.rules.alerting import Alert, AlertState, fingerprint
from lossguard.monitor.rules.rulefile import AlertingRule, parse_rule_file
from tests.deploy.test_compose_files import write_agent

T0 = 1_700_000_000.0


def alert(
    run: str = "r1", starts_at: float = T0, action: str = "rollback", **extra: str
) -> ActionAlert:
    labels = {
        "alertname": "LossNonFinite",
        "run_id": run,
        "rank": "0",
        "action": action,
        "severity": "critical",
        **extra,
    }
    return ActionAlert(fingerprint(labels), labels, {"summary": "s"}, starts_at, 812.0)


class Pipeline:
    def __init__(self, tmp_path: Path, **config: object) -> None:
        self.state = AlertStore(tmp_path / "state.db")
        self.config = ActionsConfig.model_validate(config)
        self.store = ActionStore(self.state)
        self.silences = SilenceStore(self.state)
        self.raised = RaisedAlerts(self.state)
        self.outcomes = Outcomes(self.raised, hold_s=3600)
        self.observed: list[tuple[str, str]] = []
        self.steps: dict[str, int] = {}  # the runs' step now, as the monitor's source has it
        self.planner = ActionPlanner(
            self.config,
            self.store,
            self.silences,
            self.outcomes,
            lambda kind, result: self.observed.append((kind, result)),
            lambda run, now: self.steps.get(run),
        )

    def plan(self, *alerts: ActionAlert, at: float) -> list[ActionRecord]:
        return self.planner.plan(alerts, at)

    def apply(self, record: ActionRecord, at: float, **result: object) -> None:
        self.store.update(record.id, "applied", at, result=dict(result), tried=True)

    def events(self) -> list[tuple[str, str]]:
        return [
            (e.transition.kind.value, e.transition.alert.labels["alertname"])
            for e in self.state.events()
        ]


@pytest.fixture
def pipeline(tmp_path: Path) -> Pipeline:
    return Pipeline(tmp_path, rollback={"cooldown": "30s", "max_attempts": 2})


def test_one_action_per_alert_instance_recorded_before_it_is_sent(pipeline: Pipeline) -> None:
    first = alert()
    [record] = pipeline.plan(first, at=T0 + 1)
    assert record.id == first.request_id == pipeline.store.get(first.request_id).id  # type: ignore[union-attr]
    assert record.state == "pending" and (record.attempt, record.of_attempts) == (1, 2)
    assert record.args == {"target": "last_good", "skip_batches": "abandoned", "lr_scale": 1.0}
    assert pipeline.plan(first, at=T0 + 2) == []  # the same instance, every evaluation after
    assert pipeline.plan(first, at=T0 + 100) == []  # also once applied
    assert [r.id for r in pipeline.store.open()] == [first.request_id]


def test_a_recurrence_gets_the_next_attempt_after_the_cooldown_with_a_lower_lr(
    pipeline: Pipeline,
) -> None:
    [first] = pipeline.plan(alert(starts_at=T0), at=T0)
    again = alert(starts_at=T0 + 10)  # the divergence came back: a new alert instance
    assert pipeline.plan(again, at=T0 + 10) == []  # the first is still in flight
    pipeline.apply(first, T0 + 11, from_step=812, to_step=700)
    assert pipeline.plan(again, at=T0 + 12) == []  # cooldown: 30 s from the first
    [second] = pipeline.plan(again, at=T0 + 31)
    assert (second.attempt, second.args["lr_scale"]) == (2, 0.5)
    assert second.id == again.request_id != first.id


def test_spent_budget_pages_once_pauses_and_resolves_when_quiet(pipeline: Pipeline) -> None:
    for i in range(2):
        pipeline.steps["r1"] = 812 + i
        [done] = pipeline.plan(alert(starts_at=T0 + 100 * i), at=T0 + 100 * i)
        pipeline.apply(done, T0 + 100 * i + 1, from_step=812 + i, to_step=700)
    third = alert(starts_at=T0 + 200)
    [pause] = pipeline.plan(third, at=T0 + 200)
    assert (pause.kind, pause.id, pause.args) == ("pause", f"{third.request_id}-pause", {})
    refused = pipeline.store.get(third.request_id)
    assert refused is not None and refused.state == "failed"
    assert "2 rollbacks for bad steps within 2000 steps already" in refused.reason
    assert pipeline.plan(third, at=T0 + 201) == []  # decided once
    assert pipeline.events() == [("firing", "RollbacksExhausted")]
    [page] = pipeline.raised.firing()
    labels, annotations = page.alert.labels, page.alert.annotations
    assert labels["run_id"] == "r1" and labels["severity"] == "critical"
    assert "Training is paused" in annotations["description"]
    pipeline.plan(third, at=T0 + 202)  # still diverging: still firing, not repeated
    assert pipeline.events() == [("firing", "RollbacksExhausted")]
    pipeline.plan(at=T0 + 300)  # no rollback alert fires any more
    assert pipeline.events() == [
        ("firing", "RollbacksExhausted"),
        ("resolved", "RollbacksExhausted"),
    ]
    assert pipeline.raised.firing() == []
    # 2,000 steps on, the budget is back, whatever the time
    pipeline.steps["r1"] = 2900
    [fresh] = pipeline.plan(alert(starts_at=T0 + 400), at=T0 + 400)
    assert fresh.kind == "rollback" and fresh.attempt == 1


@pytest.mark.parametrize("step_s", [0.1, 12.0, 600.0])
def test_attempts_are_counted_in_steps_whatever_the_step_time(
    step_s: float, tmp_path: Path
) -> None:
    """A divergence that comes back at the same steps after each rollback exhausts the
    attempts, however long the 300 steps and the minute to the next alert take; the lr scales of
    the attempts are 1, 0.5, 0.5 (the agent compounds them: 1, 0.5, 0.25)."""
    pipeline = Pipeline(tmp_path)  # the shipped policy: 3 attempts within 2000 steps
    at, scales = T0, []
    for attempt in range(3):
        pipeline.steps["r1"] = 1741 + 11 * attempt
        [record] = pipeline.plan(alert(starts_at=at), at=at)
        assert record.attempt == attempt + 1
        scales.append(record.args["lr_scale"])
        pipeline.apply(record, at + 1, from_step=1741 + 11 * attempt, to_step=250)
        at += 1500 * step_s + 60  # back at the bad steps, then the rule's `for`
    pipeline.steps["r1"] = 1760
    [pause] = pipeline.plan(alert(starts_at=at), at=at)
    assert pause.kind == "pause" and scales == [1.0, 0.5, 0.5]
    assert pipeline.events() == [("firing", "RollbacksExhausted")]


def test_a_divergence_far_from_the_last_ones_is_a_first_attempt(pipeline: Pipeline) -> None:
    pipeline.steps["r1"] = 1000
    [first] = pipeline.plan(alert(starts_at=T0), at=T0)
    pipeline.apply(first, T0 + 1, from_step=1000, to_step=900)
    pipeline.steps["r1"] = 3001  # more than within_steps (2000) past the last bad step
    [later] = pipeline.plan(alert(starts_at=T0 + 100), at=T0 + 100)
    assert (later.attempt, later.args["lr_scale"]) == (1, 1.0)
    pipeline.steps.pop("r1")  # the step is not known: measured from the newest bad step
    pipeline.apply(later, T0 + 101, from_step=3001, to_step=2900)
    [third] = pipeline.plan(alert(starts_at=T0 + 200), at=T0 + 200)
    assert third.attempt == 2  # 3001 is within 2000 steps of itself, 1000 is not


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ({"window": "1h"}, "use within_steps"),
        ({"within_steps": "1h"}, "within_steps"),
        ({"within_steps": 0}, "within_steps"),
        ({"max_attempts": 0}, "max_attempts"),
    ],
)
def test_a_policy_that_could_loop_is_refused(bad: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        ActionsConfig.model_validate({"rollback": bad})


def test_an_applied_action_is_announced_once_and_never_told_resolved(pipeline: Pipeline) -> None:
    [record] = pipeline.plan(alert(), at=T0)
    pipeline.apply(record, T0 + 2, from_step=812, to_step=700, skipped_batches=112, lr_scale=1.0)
    done = pipeline.store.get(record.id)
    assert done is not None
    assert pipeline.outcomes.tell(done, T0 + 2) is True
    assert pipeline.outcomes.tell(done, T0 + 3) is False  # once, even if told again
    [announced] = pipeline.raised.firing()
    labels = announced.alert.labels
    assert labels["alertname"] == "ActionTaken" and labels["announce"] == "once"
    assert (labels["severity"], labels["kind"], labels["trigger"]) == (
        "info",
        "rollback",
        "LossNonFinite",
    )
    assert "action" not in labels  # never an alert that asks for an action itself
    text = announced.alert.annotations["description"]
    assert "rolled back from step 812 to step 700" in text
    assert "112 steps to train again, 112 batches skipped" in text
    pipeline.plan(at=T0 + 3599)  # the trigger ended long ago: the announcement still fires
    assert pipeline.events() == [("firing", "ActionTaken")]
    pipeline.plan(at=T0 + 3603)
    assert pipeline.events() == [("firing", "ActionTaken"), ("resolved", "ActionTaken")]


@pytest.mark.parametrize("state", ["failed", "nothing_to_restore"])
def test_an_action_that_did_not_happen_pages_once_until_its_alert_ends(
    pipeline: Pipeline, state: str
) -> None:
    first = alert()
    [record] = pipeline.plan(first, at=T0)
    pipeline.store.update(record.id, state, T0 + 1, reason="agent: bad target", tried=True)  # type: ignore[arg-type]
    done = pipeline.store.get(record.id)
    assert done is not None and pipeline.outcomes.tell(done, T0 + 1)
    again = alert(starts_at=T0 + 50)  # a new instance of the same problem: no second page
    pipeline.plan(first, again, at=T0 + 60)
    [page] = pipeline.raised.firing()
    assert page.alert.labels["alertname"] == "ActionFailed"
    assert page.alert.labels["severity"] == "critical"
    assert page.alert.labels["trigger"] == "LossNonFinite"
    why = "no good state to roll back to" if state == "nothing_to_restore" else "bad target"
    assert why in page.alert.annotations["summary"]
    pipeline.plan(again, alert(run="r2"), at=T0 + 70)
    assert pipeline.events() == [("firing", "ActionFailed")]
    pipeline.plan(alert(alertname="LossSpikeNotRecovering"), at=T0 + 75)  # another problem
    assert pipeline.events() == [("firing", "ActionFailed"), ("resolved", "ActionFailed")]


def test_an_alert_asking_for_an_action_pages_while_actions_are_off(tmp_path: Path) -> None:
    pipeline = Pipeline(tmp_path, enabled=False)
    assert pipeline.plan(alert(), at=T0) == [] and pipeline.plan(alert(), at=T0 + 1) == []
    [page] = pipeline.raised.firing()
    assert page.alert.labels["alertname"] == "ActionFailed"
    assert "actions.enabled is false" in page.alert.annotations["summary"]
    pipeline.plan(at=T0 + 2)
    assert pipeline.events() == [("firing", "ActionFailed"), ("resolved", "ActionFailed")]


def test_pages_of_a_state_database_from_before_are_kept(tmp_path: Path) -> None:
    state = AlertStore(tmp_path / "state.db")
    labels = {"alertname": "RollbacksExhausted", "run_id": "r1", "severity": "critical"}
    with state.transaction() as db:
        db.execute(
            "CREATE TABLE exhausted_pages (run_id TEXT PRIMARY KEY, labels TEXT NOT NULL,"
            " annotations TEXT NOT NULL, value REAL NOT NULL, fired_at REAL NOT NULL)"
        )
        db.execute(
            "INSERT INTO exhausted_pages VALUES ('r1', ?, '{}', 3, ?)", (json.dumps(labels), T0)
        )
    raised = RaisedAlerts(state)
    [page] = raised.firing()
    assert page.alert.labels == labels and page.until is None
    assert [r.key for r in raised.resolve_quiet([{"run_id": "r1", "action": "rollback"}], T0)] == []
    assert [r.key for r in raised.resolve_quiet([], T0 + 1)] == ["RollbacksExhausted/r1"]


def test_a_silence_holds_the_action_back_until_it_ends(pipeline: Pipeline) -> None:
    silence = pipeline.silences.add(
        ['run_id="r1"'], T0, T0 + 60, created_by="op", comment="looking", now=T0
    )
    held = alert()
    assert pipeline.plan(held, at=T0 + 1) == []
    record = pipeline.store.get(held.request_id)
    assert record is not None and record.state == "held" and silence.id in record.reason
    assert "held by silence" in describe(record)
    assert pipeline.plan(held, at=T0 + 2) == []  # recorded once
    [released] = pipeline.plan(held, at=T0 + 61)  # the silence has ended, it still fires
    assert released.id == held.request_id and released.state == "pending"
    assert pipeline.observed == [("rollback", "held")]


def test_a_held_action_whose_alert_ends_is_dropped_unsent(pipeline: Pipeline) -> None:
    pipeline.silences.add(['run_id="r1"'], T0, T0 + 60, created_by="op", comment="x", now=T0)
    held = alert()
    assert pipeline.plan(held, at=T0 + 1) == []
    assert pipeline.plan(at=T0 + 2) == []  # the alert resolved under the silence
    record = pipeline.store.get(held.request_id)
    assert record is not None and record.state == "dropped" and not record.is_open
    assert describe(record).startswith("not done, held by silence")
    assert "its alert ended first" in describe(record)
    assert pipeline.plan(at=T0 + 61) == []  # nothing left to send once the silence ends
    assert pipeline.observed == [("rollback", "held"), ("rollback", "dropped")]


def test_dry_run_records_and_announces_only(tmp_path: Path) -> None:
    pipeline = Pipeline(tmp_path, dry_run=True)
    first = alert()
    assert pipeline.plan(first, at=T0) == []
    record = pipeline.store.get(first.request_id)
    assert record is not None and record.state == "dry_run"
    assert describe(record).startswith("dry run, not sent: would roll back to last_good")
    assert pipeline.observed == [("rollback", "dry_run")]
    [announced] = pipeline.raised.firing()  # told once, as an action would be
    assert announced.alert.labels["alertname"] == "ActionTaken"
    assert "dry run, not sent: would roll back" in announced.alert.annotations["summary"]
    assert pipeline.plan(first, at=T0 + 1) == [] and len(pipeline.raised.firing()) == 1


@pytest.mark.parametrize(
    ("labels", "why"),
    [({"run_id": ""}, "no run_id label"), ({"action": "reboot"}, "unknown action 'reboot'")],
)
def test_an_alert_that_cannot_be_acted_on_is_recorded_as_failed(
    pipeline: Pipeline, labels: dict[str, str], why: str
) -> None:
    base = alert()
    odd = ActionAlert(
        base.fingerprint, {**base.labels, **labels}, base.annotations, base.starts_at, 1.0
    )
    assert pipeline.plan(odd, at=T0) == []
    record = pipeline.store.get(odd.request_id)
    assert record is not None and record.state == "failed" and why in record.reason


def test_other_actions_are_sent_once_without_a_budget(pipeline: Pipeline) -> None:
    [save] = pipeline.plan(alert(action="checkpoint"), at=T0)
    [save_again] = pipeline.plan(alert(action="checkpoint", starts_at=T0 + 1), at=T0 + 1)
    assert save.kind == save_again.kind == "checkpoint" and save.args == {}


def test_the_runner_retries_an_unreachable_agent_then_gives_up(tmp_path: Path) -> None:
    pipeline = Pipeline(tmp_path)
    runs = tmp_path / "runs"
    runs.mkdir()
    now = time.time()
    [record] = pipeline.plan(alert(starts_at=now), at=now)
    done: list[ActionRecord] = []
    runner = ActionRunner(
        pipeline.store,
        Endpoints(pipeline.config, runs, timeout_s=1.0),
        retry_for_s=3600.0,
        observe=lambda kind, result: pipeline.observed.append((kind, result)),
        on_done=done.append,
    )
    assert runner.send(record) == 0.5  # no agent.json for r1: tried again later
    kept = pipeline.store.get(record.id)
    assert kept is not None and kept.state == "pending" and kept.tries == 1
    assert "no agent.json under" in kept.reason and done == []
    runner.retry_for_s = 0.0
    assert runner.send(kept) is None
    failed = pipeline.store.get(record.id)
    assert (
        failed is not None
        and failed.state == "failed"
        and failed.reason.startswith("gave up after 2 tries")
    )
    assert [d.id for d in done] == [record.id]
    assert pipeline.observed == [("rollback", "retry"), ("rollback", "failed")]


def test_a_restart_of_a_run_without_a_supervisor_fails_at_once_and_pages(
    tmp_path: Path,
) -> None:
    """TrainingStalled's restart for a run that runs without lossguard-supervise: nothing can
    restart it, so the action fails on its first try (not after retry_for) and pages."""
    pipeline = Pipeline(tmp_path)
    runs = tmp_path / "runs"
    write_agent(runs / "r1", os.getpid(), "http://127.0.0.1:1/metrics")
    now = time.time()
    stalled = alert(starts_at=now, action="restart", alertname="TrainingStalled")
    [record] = pipeline.plan(stalled, at=now)

    def tell(done: ActionRecord) -> None:  # as the daemon's on_done does
        pipeline.outcomes.tell(done, time.time())

    runner = ActionRunner(
        pipeline.store,
        Endpoints(pipeline.config, runs, timeout_s=1.0),
        retry_for_s=3600.0,
        observe=lambda kind, result: None,
        on_done=tell,
    )
    assert runner.send(record) is None
    failed = pipeline.store.get(record.id)
    assert failed is not None and failed.state == "failed" and failed.tries == 1
    assert "run r1 has no supervisor" in failed.reason
    [page] = pipeline.raised.firing()
    assert (page.alert.labels["alertname"], page.alert.labels["trigger"]) == (
        "ActionFailed",
        "TrainingStalled",
    )
    assert "has no supervisor" in page.alert.annotations["summary"]


def test_applied_rollback_in_words() -> None:
    record = ActionRecord(
        id="lg-x",
        run_id="r1",
        kind="rollback",
        alertname="LossNonFinite",
        fingerprint="f",
        labels={},
        origin="rules",
        args={"target": "last_good", "skip_batches": "abandoned", "lr_scale": 0.5},
        state="applied",
        created_at=T0,
        updated_at=T0,
        attempt=2,
        of_attempts=3,
        result={
            "from_step": 812,
            "to_step": 700,
            "checkpoint": "step_00000700",
            "skipped_batches": 112,
            "lr_scale": 0.5,
            "abandoned": {
                "signal": "loss",
                "step": 805,
                "nonfinite": True,
                "value": None,
                "causes": ["a bad batch: data position 805"],
            },
        },
    )
    assert describe(record) == (
        "rolled back from step 812 to step 700 (step_00000700), skipped 112 batches, "
        "lr scaled by 0.5 (run's lr scale now 0.5), attempt 2 of 3. "
        "At step 805 the loss was not finite; probable cause: a bad batch: data position 805"
    )
    assert diagnosis_text(
        {
            "signal": "grad_norm",
            "step": 9,
            "value": 40.0,
            "zscore": 8.0,
            "window_mean": 2.0,
            "causes": [],
        }
    ) == ("At step 9 the grad norm spiked to 40 (8.0 std above its window mean 2)")


def test_next_steps_are_the_commands_for_what_was_done() -> None:
    def done(kind: str, **result: object) -> ActionRecord:
        return ActionRecord(
            id=kind,
            run_id="r 1",
            kind=kind,
            alertname="LossNonFinite",
            fingerprint="f",
            labels={},
            origin="rules",
            args={},
            state="applied",
            created_at=T0,
            updated_at=T0,
            result=dict(result),
        )

    steps = next_steps(
        "r 1",
        [done("rollback", lr_scale=0.5), done("pause", paused=True)],
        ctl_target=["--run-dir", "/runs/r 1"],
        config_path="/etc/lossguard/monitor.yml",
    )
    assert steps == (
        "look at the run: lossguard-ctl --run-dir '/runs/r 1' status",
        "resume it once fixed: lossguard-ctl --run-dir '/runs/r 1' resume",
        "restore the scheduled learning rate: lossguard-ctl --run-dir '/runs/r 1' set-lr-scale 1",
        "list the checkpoints: lossguard-ctl --run-dir '/runs/r 1' checkpoints",
        "hold this run's alerts and actions: lossguard-monitor silence add --config "
        "/etc/lossguard/monitor.yml 'run_id=\"r 1\"' --duration 2h --comment investigating",
    )
    assert next_steps("r", [], ctl_target=None, config_path=None) == (
        "hold this run's alerts and actions: lossguard-monitor silence add 'run_id=\"r\"' "
        "--duration 2h --comment investigating",
    )


def test_the_diagnosis_is_the_newest_detection_of_the_signal_in_the_current_timeline(
    tmp_path: Path,
) -> None:
    path = tmp_path / "events.jsonl"

    def detection(step: int, signal: str = "loss") -> dict[str, object]:
        return {"event": "spike", "step": step + 3, "signal": signal, "diagnosis": {"step": step}}

    lines = [
        detection(90),
        detection(120),
        detection(125, "grad_norm"),
        {"event": "rollback", "step": 100, "to_step": 100},  # abandons the detection at 120
        {"event": "command", "step": 100},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"event": "sp')
    assert latest_diagnosis(path, "loss") == {"step": 90}
    assert latest_diagnosis(path, "grad_norm") is None
    with path.open("a") as file:
        file.write("\n" + json.dumps(detection(140)) + "\n")
    assert latest_diagnosis(path, "loss") == {"step": 140}
    assert latest_diagnosis(tmp_path / "missing.jsonl", "loss") is None


def test_actions_are_read_inside_a_transaction_of_the_same_thread(tmp_path: Path) -> None:
    """The dispatcher annotates the alerts it flushes (inside its transaction) with their
    actions: reading the store there must not wait for the transaction to end."""
    state = AlertStore(tmp_path / "state.db")
    store = ActionStore(state)
    with state.transaction():
        assert store.of_alert("f") == []


@pytest.mark.parametrize(
    ("triggers", "acted_on"),
    [
        (["rules", "alertmanager"], ["rules", "alertmanager"]),
        (["alertmanager"], ["alertmanager"]),
        (["rules"], ["rules"]),
    ],
)
def test_triggers_choose_whose_alerts_start_actions(
    tmp_path: Path, triggers: list[str], acted_on: list[str]
) -> None:
    config = ActionsConfig.model_validate({"triggers": triggers, "dry_run": True})
    state = AlertStore(tmp_path / "state.db")
    (group,) = parse_rule_file(
        "groups: [{name: g, rules: [{alert: LossNonFinite, expr: up, labels: {action: rollback}}]}]"
    )
    confirmed = [Sample((("run_id", "by-alertmanager"), ("rank", "0")), 55.0)]

    def rules() -> list[AlertingRule]:
        return list(group.rules)

    actions = Actions(
        config,
        state,
        SilenceStore(state),
        runs_root=None,
        observe=lambda *_: None,
        on_done=lambda _: None,
        corroborator=Corroborator(rules, lambda run: True, lambda expr, t: confirmed),
        step_of=lambda run, now: None,
        announce_for_s=3600,
    )
    from_rules = alert(run="by-rules")
    rule_alert = Alert(
        "LossNonFinite", from_rules.fingerprint, from_rules.labels, {}, AlertState.FIRING, 1.0, T0
    )
    labels = alert(run="by-alertmanager").labels
    actions.receive([IncomingAlert("firing", labels, {}, T0, None, "", "")], T0)
    actions.step([rule_alert], T0 + 1)
    runs = {r.run_id for r in ActionStore(state).recent(10) if r.state == "dry_run"}
    assert runs == {f"by-{source}" for source in acted_on}
