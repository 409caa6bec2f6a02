"""Deciding what to do about the alerts that ask for an action, once per alert instance.

Called with every firing alert that carries an ``action`` label, on every evaluation, so the
decision follows the alerts as they are (level-triggered): a new instance gets its action
recorded (to be sent); one a silence holds back is recorded as held and goes out once the
silence ends, if it still fires; a rollback waits out the run's cooldown and any rollback still
in flight. A divergence that comes back after a rollback is a new alert instance (the rollback
restored the detectors' state, so the alert ended) and gets the next attempt. Attempts are
counted in steps of training, not in time: the earlier rollbacks of the run whose bad step (the
step rolled back from) lies within ``within_steps`` of the run's step now. Past ``max_attempts``
the monitor pages RollbacksExhausted and pauses the run. With actions off, an alert asking for
one pages (nobody else acts on it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from lossguard.monitor.actions.model import ActionAlert, ActionRecord, ActionState
from lossguard.monitor.actions.outcomes import Outcomes
from lossguard.monitor.actions.policy import ACTION_LABEL, ACTIONS, ActionsConfig
from lossguard.monitor.actions.store import ActionStore
from lossguard.monitor.notify.silences import SilenceStore

Observe = Callable[[str, str], None]  # (action kind, result)
StepOf = Callable[[str, float], "int | None"]  # (run id, now) -> the run's step, if known
log = logging.getLogger("lossguard.monitor.actions")


class ActionPlanner:
    """Turns firing action alerts into recorded actions (see the module docstring)."""

    def __init__(
        self,
        config: ActionsConfig,
        store: ActionStore,
        silences: SilenceStore,
        outcomes: Outcomes,
        observe: Observe,
        step_of: StepOf,
    ) -> None:
        self.config = config
        self.store = store
        self.silences = silences
        self.outcomes = outcomes
        self.observe = observe
        self.step_of = step_of

    def plan(self, firing: Iterable[ActionAlert], now: float) -> list[ActionRecord]:
        """Record what the firing alerts call for; the records to send now."""
        firing = list(firing)
        to_send: list[ActionRecord] = []
        for alert in firing:
            if self.config.enabled:
                to_send += self._plan_one(alert, now)
            elif alert.run_id:
                self.outcomes.actions_off(alert, now)
        self._drop_ended({a.request_id for a in firing}, now)
        self.outcomes.resolve_quiet([a.labels for a in firing], now)
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
            for r in self.store.of_run(alert.run_id, 0.0, "rollback")
            if r.state in ("pending", "applied") and r.id != base.id
        ]
        if any(r.state == "pending" for r in earlier):
            return []  # one rollback of a run at a time
        if earlier and now - earlier[-1].created_at < policy.cooldown.seconds:
            return []  # decided again on a later evaluation, if it still fires
        attempts = self._attempts(alert.run_id, earlier, now)
        attempt = attempts + 1
        if attempt > policy.max_attempts:
            return self._exhausted(alert, base, attempts, now)
        args = {
            "target": policy.target,
            "skip_batches": policy.skip_batches,
            "lr_scale": policy.scale_for(attempt),
        }
        return self._record(
            base.replace(args=args, attempt=attempt, of_attempts=policy.max_attempts)
        )

    def _attempts(self, run_id: str, earlier: list[ActionRecord], now: float) -> int:
        """The applied rollbacks whose bad step lies within ``within_steps`` of the run's step
        now (of the newest bad step when the run's step is not known)."""
        bad_steps = [
            r.result["from_step"]
            for r in earlier
            if r.state == "applied" and isinstance(r.result.get("from_step"), int)
        ]
        if not bad_steps:
            return 0
        step = self.step_of(run_id, now)
        here = max(bad_steps) if step is None else step
        within = self.config.rollback.within_steps
        return sum(1 for bad in bad_steps if abs(here - bad) <= within)

    def _exhausted(
        self, alert: ActionAlert, base: ActionRecord, rollbacks: int, now: float
    ) -> list[ActionRecord]:
        policy = self.config.rollback
        reason = (
            f"not rolled back: {rollbacks} rollbacks for bad steps within "
            f"{policy.within_steps} steps already (max_attempts {policy.max_attempts})"
        )
        self._final(base, "failed", reason)
        self.outcomes.exhausted(
            alert.labels, rollbacks, policy.within_steps, policy.on_exhausted, now
        )
        if policy.on_exhausted == "none":
            return []
        then = base.replace(
            id=f"{base.id}-{policy.on_exhausted}",
            kind=policy.on_exhausted,
            reason=f"rollbacks exhausted ({rollbacks} within {policy.within_steps} steps)",
        )
        return self._record(then)

    def _record(self, record: ActionRecord) -> list[ActionRecord]:
        """Record an action to send, or, in a dry run, to announce only."""
        if self.config.dry_run:
            self._final(record, "dry_run", "dry run: not sent")
            done = self.store.get(record.id)
            if done is not None:
                self.outcomes.tell(done, record.created_at)  # announced, as if applied
            return []
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
