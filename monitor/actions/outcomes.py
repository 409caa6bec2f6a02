"""What the monitor tells people about its actions, one rule for each outcome
(docs/runbook.md, "What pages and what does not"):

* fixed by lossguard: an action the agent or the supervisor applied is announced once
  (``ActionTaken``, severity info, ``announce="once"``): what happened, what was done, what it
  cost. It fires for ``hold_s`` (longer than any route's ``group_wait``, so the announcement is
  flushed whatever the route's timers, even when its alert has already resolved) and is never
  told as resolved;
* needs a person: an action that failed (nothing to roll back to, refused by the agent, never
  answered), an alert asking for an action while actions are off, and rollbacks exhausted page
  once per run and problem (``ActionFailed``, ``RollbacksExhausted``, critical), and resolve when
  no alert of that problem fires for the run any more.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from lossguard.monitor.actions.describe import describe
from lossguard.monitor.actions.model import ActionAlert, ActionRecord
from lossguard.monitor.actions.raised import Cause, RaisedAlerts

log = logging.getLogger("lossguard.monitor.actions")
TAKEN = "ActionTaken"
FAILED = "ActionFailed"
EXHAUSTED = "RollbacksExhausted"
KEPT_LABELS = ("run_id", "rank", "job", "instance")
ANNOUNCED_STATES = ("applied", "dry_run")
PAGED_STATES = ("failed", "nothing_to_restore")
MIN_HOLD_S = 3600.0
_AFTER_EXHAUSTED = {
    "pause": "Training is paused, its process and state kept for you.",
    "stop": "Training was stopped after saving a checkpoint.",
    "none": "Training goes on as it is.",
}


class Outcomes:
    """Announces applied actions and pages for the ones that need a person."""

    def __init__(self, raised: RaisedAlerts, hold_s: float) -> None:
        self.raised = raised
        self.hold_s = hold_s

    def tell(self, record: ActionRecord, now: float) -> bool:
        """Announce an answered action, or page for it; False when it was told already (or is
        not an outcome: refused alerts from Alertmanager are counted, not told)."""
        if record.state in ANNOUNCED_STATES:
            return self._announce(record, now)
        if record.state in PAGED_STATES:
            why = (
                "there is no good state to roll back to"
                if record.state == "nothing_to_restore"
                else record.reason or "no reason given"
            )
            return self._page_failed(record.labels, record.kind, describe(record), why, now)
        return False

    def actions_off(self, alert: ActionAlert, now: float) -> bool:
        """Page for an alert that asks for an action the monitor will not take."""
        kind = alert.labels.get("action", "")
        return self._page_failed(
            alert.labels,
            kind,
            f"did not {kind}: actions are disabled",
            "actions.enabled is false",
            now,
        )

    def exhausted(
        self, alert_labels: Mapping[str, str], rollbacks: int, within: int, then: str, now: float
    ) -> bool:
        """Page RollbacksExhausted for the alert's run (False: it pages already)."""
        run = alert_labels.get("run_id", "")
        trigger = alert_labels.get("alertname", "")
        labels = _kept(alert_labels) | {"alertname": EXHAUSTED, "severity": "critical"}
        annotations = {
            "summary": f"Rollbacks exhausted in run {run}: {trigger} fired again after "
            f"{rollbacks} rollbacks within {within} steps",
            "description": f"{trigger} fired for run {run} after the monitor had already "
            f"rolled it back {rollbacks} times for bad steps within {within} steps of each "
            "other (actions.rollback.max_attempts, within_steps), so it did not roll back "
            f"again. {_AFTER_EXHAUSTED[then]} Look at the spike diagnosis of each attempt "
            "(lossguard-monitor status) before resuming: the data, the learning rate or the "
            "precision may need changing.",
            "runbook_url": "docs/runbook.md#rollbacksexhausted",
        }
        cause = Cause(run_id=run, action="rollback")
        fired = self.raised.raise_alert(
            f"{EXHAUSTED}/{run}", labels, annotations, float(rollbacks), now, cause=cause
        )
        if fired:
            log.warning("%s for run %s: %s", EXHAUSTED, run, annotations["summary"])
        return fired

    def resolve_quiet(self, firing: Iterable[Mapping[str, str]], now: float) -> None:
        """End the pages whose problem no firing alert shows any more, and the announcements
        whose time is up."""
        for raised in self.raised.resolve_quiet(firing, now):
            log.info("%s resolved", raised.key)

    def _announce(self, record: ActionRecord, now: float) -> bool:
        labels = _kept(record.labels) | {
            "alertname": TAKEN,
            "severity": "info",
            "announce": "once",
            "kind": record.kind,
            "trigger": record.alertname,
            "action_id": record.id,
        }
        did = describe(record)
        acted = (
            "the monitor is in a dry run (actions.dry_run) and did nothing: the run is as it was"
            if record.state == "dry_run"
            else "the monitor acted on its own and nothing needs doing"
        )
        annotations = {
            "summary": f"Run {record.run_id}: {did.split('. ')[0]} (after {record.alertname})",
            "description": f"{record.alertname} fired for run {record.run_id}; {acted}. "
            f"{did}.{_cost(record)}",
            "runbook_url": "docs/runbook.md#actiontaken",
        }
        return self.raised.raise_alert(
            f"{TAKEN}/{record.id}", labels, annotations, 1.0, now, hold_s=self.hold_s
        )

    def _page_failed(
        self, alert_labels: Mapping[str, str], kind: str, did: str, why: str, now: float
    ) -> bool:
        run = alert_labels.get("run_id", "")
        trigger = alert_labels.get("alertname", "")
        labels = _kept(alert_labels) | {
            "alertname": FAILED,
            "severity": "critical",
            "kind": kind,
            "trigger": trigger,
        }
        annotations = {
            "summary": f"Run {run}: {trigger} needs a person, the monitor's {kind} did not "
            f"happen ({why})",
            "description": f"{trigger} fired for run {run} and asked for {kind}, which did not "
            f"happen: {did}. The problem stays until someone acts; the page resolves when "
            f"{trigger} no longer fires for the run.",
            "runbook_url": "docs/runbook.md#actionfailed",
        }
        fired = self.raised.raise_alert(
            f"{FAILED}/{run}/{trigger}",
            labels,
            annotations,
            1.0,
            now,
            cause=Cause(run_id=run, alertname=trigger),
        )
        if fired:
            log.warning("%s for run %s: %s", FAILED, run, annotations["summary"])
        return fired


def hold_for(group_waits: Iterable[float]) -> float:
    """How long an announcement fires: an hour, or twice the longest ``group_wait`` of the
    routes when that is longer, so that every route flushes it while it fires."""
    return max([MIN_HOLD_S, *(2 * wait for wait in group_waits)])


def _kept(labels: Mapping[str, str]) -> dict[str, str]:
    return {k: labels[k] for k in KEPT_LABELS if k in labels}


def _cost(record: ActionRecord) -> str:
    """What a rollback cost: the steps trained again, the batches skipped, the lr now."""
    result = record.result
    if record.kind != "rollback" or record.state != "applied":
        return ""
    start, end = result.get("from_step"), result.get("to_step")
    lost = (
        f"{start - end} steps to train again"
        if isinstance(start, int) and isinstance(end, int)
        else "steps lost unknown"
    )
    return (
        f" Cost: {lost}, {result.get('skipped_batches', 0)} batches skipped, the run's lr "
        f"now {result.get('lr_scale', 1):g} times its schedule."
    )
