"""Deciding what to do about the alerts that ask for an action, once per alert instance.

Called with every firing alert that carries an ``action`` label, on every evaluation, so the
decision follows the alerts as they are (level-triggered): a new instance gets its action
recorded (to be sent); one a silence holds back is recorded as held and goes out once the
silence ends, if it still fires; a rollback waits out the run's cooldown and any rollback still
in flight. A divergence that comes back after a rollback is a new alert instance (the rollback
restored the detectors' state, so the alert ended) and gets the next attempt; past
``max_attempts`` in the window the monitor pages RollbacksExhausted and pauses the run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from lossguard.common.config import seconds
from lossguard.monitor.actions.exhausted import ExhaustedPages
from lossguard.monitor.actions.model import ActionAlert, ActionRecord, ActionState
from lossguard.monitor.actions.policy import ACTION_LABEL, ACTIONS, ActionsConfig
from lossguard.monitor.actions.store import ActionStore
from lossguard.monitor.notify.silences import SilenceStore

Observe = Callable[[str, str], None]  # (action kind, result)
log = logging.getLogger("lossguard.monitor.actions")


class ActionPlanner:
    """Turns firing action alerts into recorded actions (see the module docstring)."""

    def __init__(
        self,
        config: ActionsConfig,
        store: ActionStore,
        silences: SilenceStore,
        pages: ExhaustedPages,
        observe: Observe,
    ) -> None:
        self.config = config
        self.store = store
        self.silences = silences
        self.pages = pages
        self.observe = observe

    def plan(self, firing: Iterable[ActionAlert], now: float) -> list[ActionRecord]:
        """Record what the firing alerts call for; the records to send now."""
        firing = list(firing)
        to_send: list[ActionRecord] = []
        if self.config.enabled:
            for alert in firing:
                to_send += self._plan_one(alert, now)
        self._drop_ended({a.request_id for a in firing}, now)
        diverging = {a.run_id for a in firing if a.labels.get(ACTION_LABEL) == "rollback"}
        for run in self.pages.resolve_quiet(diverging, now):
            log.info("RollbacksExhausted resolved for run %s: no rollback alert fires", run)
        return to_send

    def _drop_ended(self, firing: set[str], now: float) -> None:
        """Held actions whose alert instance no longer fires are never sent."""
        for record in self.store.open():
            if record.state == "held" and record.id not in firing:
                self.store.update(
                    record.id, "dropped", now, reason=f"{record.reason}; its alert ended first"
                )
                self.observe(record.kind, "dropped")
                log.info("%s %s dropped: its alert ended while held", record.kind, record.id)

    def _plan_one(self, alert: ActionAlert, now: float) -> list[ActionRecord]:
        existing = self.store.get(alert.request_id)
        if existing is not None and existing.state != "held":
            return []  # decided already: sent, answered, or announced
        kind = alert.labels[ACTION_LABEL]
        base = ActionRecord(
            id=alert.request_id,
            run_id=alert.run_id,
            kind=kind,
            alertname=alert.name,
            fingerprint=alert.fingerprint,
            labels=alert.labels,
            origin=alert.origin,
            args={},
            state="pending",
            created_at=now,
            updated_at=now,
        )
        if kind not in ACTIONS:
            return self._final(base, "failed", f"unknown action {kind!r}; one of {ACTIONS}")
        if not alert.run_id:
            return self._final(base, "failed", "the alert has no run_id label: no run to act on")
        silence = next((s for s in self.silences.active(now) if s.mutes(alert.labels, now)), None)
        if silence is not None:
            if existing is None:
                self.store.add(base.replace(state="held", reason=f"held by silence {silence.id}"))
                self.observe(kind, "held")
                log.info("%s for %s held by silence %s", kind, alert.name, silence.id)
            return []
        if kind == "rollback":
            return self._rollback(alert, base, now)
        if kind == "restart":
            return self._record(base.replace(args={"reason": f"alert {alert.name}"[:200]}))
        return self._record(base)

    def _rollback(self, alert: ActionAlert, base: ActionRecord, now: float) -> list[ActionRecord]:
        policy = self.config.rollback
        earlier = [
            r
            for r in self.store.of_run(alert.run_id, now - seconds(policy.window), "rollback")
            if r.state in ("pending", "applied") and r.id != base.id
        ]
        if any(r.state == "pending" for r in earlier):
            return []  # one rollback of a run at a time
        if earlier and now - earlier[-1].created_at < seconds(policy.cooldown):
            return []  # decided again on a later evaluation, if it still fires
        attempt = len(earlier) + 1
        if attempt > policy.max_attempts:
            return self._exhausted(alert, base, len(earlier), now)
        args = {
            "target": policy.target,
            "skip_batches": policy.skip_batches,
            "lr_scale": policy.scale_for(attempt),
        }
        return self._record(
            base.replace(args=args, attempt=attempt, of_attempts=policy.max_attempts)
        )

    def _exhausted(
        self, alert: ActionAlert, base: ActionRecord, rollbacks: int, now: float
    ) -> list[ActionRecord]:
        policy = self.config.rollback
        reason = (
            f"not rolled back: {rollbacks} rollbacks in the last {policy.window} already "
            f"(max_attempts {policy.max_attempts})"
        )
        self._final(base, "failed", reason)
        if self.pages.raise_page(alert.labels, rollbacks, policy.window, policy.on_exhausted, now):
            log.warning("RollbacksExhausted for run %s: %s", alert.run_id, reason)
        if policy.on_exhausted == "none":
            return []
        then = base.replace(
            id=f"{base.id}-{policy.on_exhausted}",
            kind=policy.on_exhausted,
            reason=f"rollbacks exhausted ({rollbacks} in {policy.window})",
        )
        return self._record(then)

    def _record(self, record: ActionRecord) -> list[ActionRecord]:
        """Record an action to send, or, in a dry run, to announce only."""
        if self.config.dry_run:
            return self._final(record, "dry_run", "dry run: not sent")
        if not self.store.add(record):
            return []
        log.info(
            "%s for run %s recorded as %s (%s)",
            record.kind,
            record.run_id,
            record.id,
            record.alertname,
        )
        return [record]

    def _final(self, record: ActionRecord, state: ActionState, reason: str) -> list[ActionRecord]:
        """Record an action decided not to be sent."""
        if self.store.add(record.replace(state=state, reason=reason)):
            self.observe(record.kind, state)
            log.warning(
                "%s for run %s (%s): %s", record.kind, record.run_id, record.alertname, reason
            )
        return []
