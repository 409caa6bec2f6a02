"""``AlertRecorder``: the rules' alerts and their transitions, kept in the state database (a failed
write's wait for the next one), logged and counted; at a start, the rules restored from it."""

from __future__ import annotations

import logging
import sqlite3

from lossguard.monitor.alert_store import AlertStore
from lossguard.monitor.config import RulesConfig
from lossguard.monitor.metrics import MonitorMetrics
from lossguard.monitor.rules.alerting import AlertState, Transition, TransitionKind
from lossguard.monitor.rules.rulefile import RuleGroup
from lossguard.monitor.rules.ruleset import RuleSet

log = logging.getLogger("lossguard.monitor")


class AlertRecorder:
    """Writes the alerts of a rule set to ``store``, then logs and counts their transitions."""

    def __init__(self, store: AlertStore, metrics: MonitorMetrics) -> None:
        self.store = store
        self.metrics = metrics
        self._unrecorded: list[Transition] = []
        self._unrecorded_rules: set[str] = set()

    def restore(self, groups: list[RuleGroup], now: float, rules: RulesConfig) -> RuleSet:
        """The rules of ``groups`` with the alerts the database kept; those that ended while the
        monitor was down are recorded."""
        stored = self.store.load_alerts()
        last = self.store.last_evaluation()
        for alert in (a for alerts in stored.values() for a in alerts):
            if alert.state is AlertState.PENDING and last is not None:
                alert.active_at += now - last  # as Prometheus: downtime does not count to `for`
        ruleset, ended = RuleSet.restore(
            groups,
            stored,
            now,
            external_labels=rules.external_labels,
            external_url=rules.external_url,
        )
        self.record(ruleset, ended, set(stored) | set(ruleset.active()))
        return ruleset

    def record(
        self,
        ruleset: RuleSet,
        transitions: list[Transition],
        rule_keys: set[str],
        t: float | None = None,
    ) -> None:
        """Persist the rules' alerts and the transitions (with any a failed write left over),
        then log and count the transitions."""
        self._unrecorded.extend(transitions)
        self._unrecorded_rules.update(rule_keys)
        active = ruleset.active()
        try:
            self.store.record(
                {key: active.get(key, []) for key in self._unrecorded_rules},
                self._unrecorded,
                evaluated_at=t,
            )
        except sqlite3.Error as exc:
            log.error(
                "state database: %s; %d transitions wait for the next evaluation",
                exc,
                len(self._unrecorded),
            )
        else:
            self._unrecorded, self._unrecorded_rules = [], set()
        for transition in transitions:
            alert = transition.alert
            self.metrics.transitions.labels(
                alert.labels.get("alertname", ""), transition.kind.value
            ).inc()
            level = (
                logging.INFO if transition.kind is not TransitionKind.INACTIVE else logging.DEBUG
            )
            log.log(
                level,
                "alert %s %s %s value=%s fingerprint=%s",
                alert.labels.get("alertname", ""),
                transition.kind.value,
                " ".join(f"{k}={v}" for k, v in alert.labels.items() if k != "alertname"),
                alert.value,
                alert.fingerprint,
            )
