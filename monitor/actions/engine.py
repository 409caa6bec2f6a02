"""The actions pipeline as the daemon uses it: firing alerts from the rules and from
Alertmanager's webhook go through one planner (one decision per alert instance) to one runner
(sends, with retries, recording every answer)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from lossguard.common.printable import escaped
from lossguard.common.rundir.paths import RunPaths
from lossguard.monitor.actions.corroborate import AwaitingConfirmation, Corroborator
from lossguard.monitor.actions.describe import describe, diagnosis_text
from lossguard.monitor.actions.diagnosis import latest_diagnosis
from lossguard.monitor.actions.endpoints import Endpoints
from lossguard.monitor.actions.intake import IncomingAlert
from lossguard.monitor.actions.model import ActionAlert, ActionRecord
from lossguard.monitor.actions.next_steps import next_steps
from lossguard.monitor.actions.outcomes import Outcomes
from lossguard.monitor.actions.planner import ActionPlanner, StepOf
from lossguard.monitor.actions.policy import ACTION_LABEL, ACTIONS, ActionsConfig
from lossguard.monitor.actions.raised import RaisedAlerts
from lossguard.monitor.actions.refusals import MAX_HELD, RefusalBudget
from lossguard.monitor.actions.runner import ActionRunner, Done, Observe
from lossguard.monitor.actions.store import ActionStore
from lossguard.monitor.alert_store import AlertStore
from lossguard.monitor.notify.model import RUN_LABEL, AlertInfo
from lossguard.monitor.notify.silences import SilenceStore
from lossguard.monitor.rules.alerting import Alert, AlertState, fingerprint
from lossguard.monitor.sources.announced import AnnouncedRuns

log = logging.getLogger("lossguard.monitor.actions")
EXTERNAL_TTL_S = 24 * 3600  # an Alertmanager alert never heard of again is forgotten


@dataclass(frozen=True)
class Refusal:
    """An alert from Alertmanager that was not acted on, and why."""

    alertname: str
    run_id: str
    reason: str


class Actions:
    """Plans and runs the actions the firing alerts ask for."""

    def __init__(
        self,
        config: ActionsConfig,
        state: AlertStore,
        silences: SilenceStore,
        *,
        runs_root: Path | None,
        announced: AnnouncedRuns | None = None,
        config_path: str | None = None,
        observe: Observe,
        on_done: Done,
        corroborator: Corroborator,
        step_of: StepOf,
        announce_for_s: float,
    ) -> None:
        """``corroborator``: judges the alerts from Alertmanager; ``step_of``: a run's step
        now; ``announce_for_s``: how long an announcement fires (longer than any group_wait)."""
        self.config = config
        self.observe = observe
        self.corroborator = corroborator
        self.store = ActionStore(state)
        self.raised = RaisedAlerts(state)
        self.outcomes = Outcomes(self.raised, announce_for_s)
        self.planner = ActionPlanner(config, self.store, silences, self.outcomes, observe, step_of)
        self.endpoints = Endpoints(config, runs_root, config.timeout.seconds, announced)
        self.config_path = config_path
        self.runner = ActionRunner(
            self.store,
            self.endpoints,
            retry_for_s=config.retry_for.seconds,
            observe=observe,
            on_done=on_done,
        )
        self._external: dict[str, tuple[ActionAlert, float]] = {}  # request id -> (alert, until)
        self._awaiting = AwaitingConfirmation(corroborator)  # under the lock
        self._lock = threading.Lock()
        self._refusals = RefusalBudget()

    def start(self) -> None:
        self.runner.start()

    def stop(self) -> None:
        self.runner.stop()

    def step(self, rule_alerts: Iterable[Alert], now: float) -> int:
        """Decide about every firing action alert; wake the runner. How many were recorded."""
        firing = [
            ActionAlert(
                fingerprint=a.fingerprint,
                labels=a.labels,
                annotations=a.annotations,
                starts_at=a.active_at,
                value=a.value,
            )
            for a in rule_alerts
            if a.state is AlertState.FIRING
            and ACTION_LABEL in a.labels
            and "rules" in self.config.triggers
        ]
        with self._lock:
            confirmed, refused = self._awaiting.review(now)
            for alert in confirmed:
                self._external[alert.request_id] = (alert, now + EXTERNAL_TTL_S)
            self._external = {k: v for k, v in self._external.items() if v[1] > now}
            firing += [alert for alert, _ in self._external.values()]
        for alert, reason in refused:
            self._record_refusal(alert, reason, now)
        self._refusals.flush(now)
        recorded = self.planner.plan(firing, now)
        for record in recorded:
            log.warning(
                "action for run %s (%s): %s", record.run_id, record.alertname, describe(record)
            )
        if recorded:
            self.runner.wake()
        return len(recorded)

    def tell(self, record: ActionRecord, now: float) -> bool:
        """Announce an answered action, or page for one that failed (``Outcomes``)."""
        return self.outcomes.tell(record, now)

    def receive(self, alerts: list[IncomingAlert], now: float) -> list[Refusal]:
        """Take alerts from Alertmanager's webhook: the firing ones with an action label that
        the monitor corroborates (:class:`Corroborator`) join the next decision; those its
        own view does not show yet wait for it (``AwaitingConfirmation``: refused later if it
        never does); the others are recorded as refused, with why, and returned; resolved
        ones leave (all are ignored unless ``alertmanager`` is one of the configured
        triggers)."""
        if "alertmanager" not in self.config.triggers:
            return []
        refused: list[Refusal] = []
        for incoming in alerts:
            if ACTION_LABEL not in incoming.labels:
                continue
            alert = ActionAlert(
                fingerprint=fingerprint(incoming.labels),
                labels=dict(incoming.labels),
                annotations=dict(incoming.annotations),
                starts_at=incoming.starts_at,
                value=float("nan"),
                origin="alertmanager",
            )
            if incoming.status == "resolved":
                with self._lock:
                    self._external.pop(alert.request_id, None)
                    self._awaiting.drop(alert.request_id)
                continue
            reason = self.corroborator.rule_refusal(alert)
            if reason is None:
                shown = self.corroborator.unconfirmed(alert, now) is None
                with self._lock:
                    if shown:
                        self._external[alert.request_id] = (alert, now + EXTERNAL_TTL_S)
                        continue
                    # the monitor's own scrape may be behind Prometheus's
                    if self._awaiting.hold(alert, now, limit=MAX_HELD):
                        continue
                reason = f"{MAX_HELD} alerts are awaiting the monitor's own view already"
            refused.append(Refusal(alert.name, alert.run_id, reason))
            self._record_refusal(alert, reason, now)
        return refused

    def _record_refusal(self, alert: ActionAlert, reason: str, now: float) -> None:
        """One record per refused alert instance (a repeat or replay adds none), under an id
        of its own: a later notification of the instance that the monitor confirms still acts.
        Past the window's budget (``RefusalBudget``) a refusal is only counted."""
        kind = alert.labels[ACTION_LABEL]
        metric_kind = kind if kind in ACTIONS else "unknown"  # the metric's label stays bounded
        if self.store.get(f"{alert.request_id}-refused") is not None:
            return  # a repeat of a refused instance: recorded and counted already
        if not self._refusals.allow(now, alert.run_id):
            self.observe(metric_kind, "refused")
            return
        record = ActionRecord(
            id=f"{alert.request_id}-refused",
            run_id=alert.run_id,
            kind=kind,
            alertname=alert.name,
            fingerprint=alert.fingerprint,
            labels=alert.labels,
            origin="alertmanager",
            args={},
            state="refused",
            created_at=now,
            updated_at=now,
            reason=reason,
        )
        if self.store.add(record):
            self.observe(metric_kind, "refused")
            log.warning(
                "refused %s for run %s from Alertmanager (%s): %s",
                escaped(record.kind),
                escaped(record.run_id),
                escaped(record.alertname),
                escaped(reason),
            )

    def annotate(self, alert: AlertInfo) -> AlertInfo:
        """The alert as on-call reads it: the agent's diagnosis where it is about a detector
        signal, what the monitor did about it (in words, oldest first), and the commands for
        what to do next."""
        run_id = alert.labels.get(RUN_LABEL)
        if not run_id:
            return alert
        # this alert instance's actions (its labels may have fired before)
        done = [
            r for r in self.store.of_alert(alert.fingerprint) if r.created_at >= alert.starts_at
        ]
        recent = self.store.of_run(run_id, 0.0)  # all of the run's: a pause may be old
        return dataclasses.replace(
            alert,
            annotations=self._with_diagnosis(alert, run_id),
            actions=tuple(describe(r) for r in done) or alert.actions,
            next_steps=next_steps(
                run_id,
                recent,
                ctl_target=self.endpoints.ctl_target(run_id),
                config_path=self.config_path,
            ),
        )

    def _with_diagnosis(self, alert: AlertInfo, run_id: str) -> dict[str, str]:
        """The annotations, with a ``diagnosis`` of the latest detection of the alert's
        ``signal`` in the run's current timeline (runs under the runs root only)."""
        signal = alert.labels.get("signal")
        run_dir = self.endpoints.run_dir(run_id) if signal and alert.status == "firing" else None
        found = (
            latest_diagnosis(RunPaths.of(run_dir).events, signal) if run_dir and signal else None
        )
        if found is None:
            return alert.annotations
        return {**alert.annotations, "diagnosis": diagnosis_text(found)}
