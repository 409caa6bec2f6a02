"""The demo's ending in words: what happened at which step, what lossguard did, how the run
recovered (and where the abandoned timeline was heading), what was sent, where to look next.
Everything in it was measured during the run; nothing is claimed that was not."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lossguard.common.rundir.events import DETECTIONS, ROLLBACK
from lossguard.monitor.actions.describe import describe, diagnosis_text
from lossguard.monitor.actions.model import ActionRecord
from lossguard.monitor.actions.outcomes import ANNOUNCED_STATES, TAKEN
from lossguard.monitor.demo.inbox import Message
from lossguard.monitor.demo.recovery import Recovery, injected_fault, measure
from lossguard.monitor.demo.scenario import PAGERDUTY_ENV, SLACK_ENV
from lossguard.monitor.demo.watch import AlertChange, Sent


@dataclass(frozen=True)
class Loss:
    step: int
    value: float


@dataclass(frozen=True)
class Story:
    """The facts the summary tells, taken from a finished demo's records."""

    fault: str  # the scenario in words
    fault_step: int | None
    fault_at: float | None
    trouble: str | None  # the detectors' first diagnosis after the fault
    alerts: tuple[AlertChange, ...]
    actions: tuple[ActionRecord, ...]
    recovery: Recovery | None
    before: Loss | None  # the last evaluation before the fault
    abandoned_train: Loss | None  # the last step logged before the first rollback
    abandoned_val: Loss | None  # the last evaluation after the fault, before the rollback
    final_val: Loss | None  # the last evaluation after the last rollback
    final_step: int | None
    stopped_by_demo: bool
    sent: tuple[Sent, ...]
    logged: tuple[tuple[float, int], ...] = ()  # (time, step) of each step logged

    def step_at(self, at: float) -> int | None:
        """The last step logged at or before ``at``."""
        before = [step for time, step in self.logged if time <= at]
        return before[-1] if before else None

    @property
    def rolled_back(self) -> bool:
        return any(a.kind == "rollback" and a.state == "applied" for a in self.actions)

    @property
    def recovered(self) -> bool:
        """Rolled back, trained again and evaluated after it."""
        return self.recovery is not None and self.final_val is not None


@dataclass(frozen=True)
class Places:
    """Where the demo left its files, and how the notifications went out."""

    work: Path
    run_dir: Path
    monitor_config: Path
    state_db: Path
    report: Path | None
    report_problem: str | None
    inbox: Path | None  # None: every service got the real messages


def build_story(
    fault: str,
    events: Sequence[dict[str, Any]],
    records: Sequence[dict[str, Any]],
    alerts: Sequence[AlertChange],
    actions: Sequence[ActionRecord],
    sent: Sequence[Sent],
    stopped_by_demo: bool,
) -> Story:
    """The story in a demo's records: the agent's audit trail and metrics log, the alert
    transitions, actions and notifications from the monitor's state database."""
    injected = injected_fault(events)
    fault_at = None if injected is None else float(injected["time"])
    rollbacks = [e for e in events if e.get("event") == ROLLBACK]
    evals = [r for r in records if r.get("kind") == "eval"]
    trains = [r for r in records if r.get("kind") == "train"]
    first_back = float(rollbacks[0]["time"]) if rollbacks else None
    last_back = float(rollbacks[-1]["time"]) if rollbacks else None
    troubles = [
        e
        for e in events
        if e.get("event") in DETECTIONS
        and isinstance(e.get("diagnosis"), dict)
        and fault_at is not None
        and e["time"] >= fault_at
    ]
    first = next((e for e in troubles if e.get("signal") == "loss"), None) or next(
        iter(troubles), None
    )
    fired = _first_firing(alerts, actions)
    return Story(
        fault=fault,
        fault_step=None if injected is None else int(injected["step"]),
        fault_at=fault_at,
        trouble=None if first is None else diagnosis_text(first["diagnosis"]),
        alerts=tuple(alerts),
        actions=tuple(actions),
        recovery=None if fired is None else measure(events, records, fired),
        before=_last(evals, until=fault_at),
        abandoned_train=_last(trains, until=first_back, key="train_loss"),
        abandoned_val=_last(evals, since=fault_at, until=first_back),
        final_val=_last(evals, since=last_back) if last_back is not None else None,
        final_step=trains[-1]["step"] if trains else None,
        stopped_by_demo=stopped_by_demo,
        sent=tuple(sent),
        logged=tuple((r["time"], r["step"]) for r in trains),
    )


def _first_firing(alerts: Sequence[AlertChange], actions: Sequence[ActionRecord]) -> float | None:
    """When the alert behind the first rollback fired."""
    rollback = next((a for a in actions if a.kind == "rollback"), None)
    if rollback is None:
        return None
    return next((c.at for c in alerts if c.name == rollback.alertname and c.kind == "firing"), None)


def _last(
    records: Sequence[dict[str, Any]],
    since: float | None = None,
    until: float | None = None,
    key: str = "val_loss",
) -> Loss | None:
    """The last record logged in (since, until), as a Loss of its ``key``."""
    found = [
        r
        for r in records
        if (since is None or r["time"] > since) and (until is None or r["time"] < until)
    ]
    return Loss(found[-1]["step"], float(found[-1][key])) if found else None


def summary_lines(story: Story, places: Places, inbox: Sequence[Message]) -> list[str]:
    """The summary, line by line."""
    lines = ["", "What happened"]
    if story.fault_step is not None:
        lines.append(f"  step {story.fault_step}: {story.fault}")
    if story.trouble:
        lines.append(f"  {story.trouble}")
    fired = {(c.name, c.at) for c in story.alerts if c.kind == "firing"}
    lines += [
        f"  {_since(story, c.at)}{_step(story, c.at)}  alert {c.name} ({c.severity}) {c.kind}"
        for c in story.alerts
        if c.kind != "inactive" and not (c.kind == "pending" and (c.name, c.at) in fired)
    ]
    lines += ["", "What lossguard did"]
    for action in story.actions:
        at = action.updated_at
        lines.append(f"  {_since(story, at)}{_step(story, at)}  {action.kind}: {describe(action)}")
    if not story.actions:
        lines.append("  nothing: no alert asked for an action")
    lines += _told_lines(story)
    lines += ["", "How the run recovered", *_recovery_lines(story)]
    lines += ["", "Where to look next", *_places_lines(places)]
    if places.inbox is not None:
        lines += ["", *_inbox_lines(story, places.inbox, inbox)]
    return lines


def _recovery_lines(story: Story) -> list[str]:
    lines = []
    r = story.recovery
    if r is not None:
        alert = next((a.alertname for a in story.actions if a.kind == "rollback"), "the alert")
        lines.append(
            f"  from the start of the bad step (step {r.bad_step}): {alert} fired after "
            f"{r.detected_s:.1f} s, the rollback was applied after {r.applied_s:.1f} s (at step "
            f"{r.from_step}, back to step {r.to_step}), training again after {r.recovered_s:.1f} s "
            "(the first step logged after the rollback)"
        )
    if story.final_val is not None and story.rolled_back:
        lines.append(
            f"  with lossguard: validation loss {story.final_val.value:.4g} at step "
            f"{story.final_val.step}, after the rollback"
        )
    if story.before is not None:
        lines.append(
            f"  before the fault: validation loss {story.before.value:.4g} at step "
            f"{story.before.step}"
        )
    if story.rolled_back and story.abandoned_train is not None:
        heading = (
            f"  without the rollback, the abandoned timeline: train loss "
            f"{story.abandoned_train.value:.4g} at step {story.abandoned_train.step}"
        )
        if story.abandoned_val is not None:
            heading += (
                f", validation loss {story.abandoned_val.value:.4g} at step "
                f"{story.abandoned_val.step}"
            )
        lines.append(heading + " (where the run was when lossguard rolled it back)")
    if not story.rolled_back:
        lines.append("  it did not: the run was not rolled back")
    if story.stopped_by_demo and story.final_step is not None:
        lines.append(
            f"  the demo stopped the run at step {story.final_step} (the stop command: save, "
            "exit); a real run trains on to its max_steps"
        )
    return lines


def _places_lines(places: Places) -> list[str]:
    lines = [
        f"  run directory  {places.run_dir}  (metrics.jsonl, events.jsonl, checkpoints/)",
        f"  demo files     {places.work}  (agent.yaml, monitor.yml, agent.log, monitor.log)",
    ]
    if places.report is not None:
        lines.append(f"  report         {places.report}  (the run's plots, alerts and rollback)")
    else:
        lines.append(f"  report         not written: {places.report_problem}")
    if places.inbox is not None:
        lines.append(f"  inbox          {places.inbox}  (what Slack and PagerDuty would get)")
    lines += [
        f"  lossguard-monitor status --config {places.monitor_config}",
        f"  lossguard-ctl --run-dir {places.run_dir} checkpoints",
        f"  lossguard-monitor report {places.run_dir} --state {places.state_db}",
    ]
    return lines


def _inbox_lines(story: Story, path: Path, inbox: Sequence[Message]) -> list[str]:
    slack = sum(1 for m in inbox if m.service == "slack")
    lines = [
        f"The inbox ({path}): each request exactly as the monitor sent it, one JSON line each "
        f"(set {SLACK_ENV} and {PAGERDUTY_ENV} to send them to Slack and PagerDuty): "
        f"{_count(slack, 'Slack message')}, {_count(len(inbox) - slack, 'PagerDuty event')}"
    ]
    for message in inbox:
        body = message.body if isinstance(message.body, dict) else {}
        if message.service == "slack":
            what = f"Slack      {body.get('text', '')}"
        else:
            payload = body.get("payload") or {}
            what = f"PagerDuty  {body.get('event_action')} {body.get('dedup_key')}" + (
                f"  {payload.get('summary')}" if payload.get("summary") else ""
            )
        lines.append(f"  {_since(story, message.received_at)}  {what}")
    if not inbox:
        lines.append("  empty: nothing was sent")
    return lines


def _told_lines(story: Story) -> list[str]:
    """What the monitor delivered, by service; whether each applied action was announced and
    anyone paged; what was still open, untold, when the demo stopped the monitor."""
    delivered = [s for s in story.sent if s.delivered]
    failed = len(story.sent) - len(delivered)
    by_service: dict[str, list[Sent]] = {"Slack": [], "PagerDuty": []}
    for sent in delivered:
        by_service.setdefault(sent.service, []).append(sent)
    counts = [
        f"{service} {_count(len(sent), 'event' if service == 'PagerDuty' else 'message')}"
        + (f" ({'; '.join(_what(s) for s in sent)})" if sent else "")
        for service, sent in by_service.items()
    ]
    lines = ["  told: " + ", ".join(counts) + (f"; {failed} not delivered" if failed else "")]
    outcome = [_announced(action, delivered) for action in story.actions if _applied(action)]
    pages = by_service["PagerDuty"]
    if not pages:
        outcome.append("nobody was paged (no PagerDuty event)")
    else:
        triggers = sum(1 for s in pages if s.firing)
        outcome.append(
            f"PagerDuty was sent {_count(triggers, 'trigger')} and "
            f"{_count(len(pages) - triggers, 'resolve')}"
        )
    lines.append("  " + "; ".join(outcome))
    open_ = _untold(story, delivered)
    if open_:
        lines.append("  when the demo stopped the monitor: " + "; ".join(open_))
    return lines


def _applied(action: ActionRecord) -> bool:
    return action.state in ANNOUNCED_STATES


def _announced(action: ActionRecord, delivered: Sequence[Sent]) -> str:
    told = [s for s in delivered if action.id in s.action_ids]
    if not told:
        return f"the {action.kind} was not announced before the demo stopped the monitor"
    where = ", ".join(dict.fromkeys(f"{s.service} ({s.receiver})" for s in told))
    times = "once" if len(told) == 1 else f"{len(told)} times"
    return f"the {action.kind} was announced {times} ({TAKEN} to {where})"


def _untold(story: Story, delivered: Sequence[Sent]) -> list[str]:
    """The alerts told as firing whose resolve was not sent: still firing, or resolved after
    the group's last message (its next one comes group_interval after that)."""
    told: dict[str, str] = {}
    for sent in sorted(delivered, key=lambda s: s.at):
        told.update({name: "firing" for name in sent.firing})
        told.update({name: "resolved" for name in sent.resolved})
    found = []
    for name, state in told.items():
        if state != "firing":
            continue
        last = next((c for c in reversed(story.alerts) if c.name == name), None)
        if last is not None and last.kind == "resolved":
            at = _since(story, last.at).strip()
            found.append(f"{name} resolved at {at}, its resolve not sent")
        else:
            found.append(f"{name} still firing, no resolve sent")
    return found


def _what(sent: Sent) -> str:
    """The alerts a notification told of, by name (its text when it names none)."""
    names = [
        *(f"{n} firing" for n in sent.firing),
        *(f"{n} resolved" for n in sent.resolved),
        *sent.announced,
    ]
    return ", ".join(names) or sent.text


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _step(story: Story, at: float) -> str:
    """`` step 1320``: the last step logged by then, in a column."""
    step = story.step_at(at)
    return " " * 11 if step is None else f"  step {step:<5}"


def _since(story: Story, at: float) -> str:
    """``+91.2 s``: seconds after the fault (or the time itself without one)."""
    if story.fault_at is None:
        return f"{at:.1f}"
    return f"{at - story.fault_at:+7.1f} s"
