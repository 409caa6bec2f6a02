"""The monitor's own metrics, the ``lossguard_monitor_*`` series, declared once in
:data:`CATALOGUE`, and what it knows about runs from their files (:data:`RUN_CATALOGUE`),
registered by :class:`MonitorMetrics`. ``lossguard.monitor.http.server`` serves them on
``/metrics``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.metrics import MetricWrapperBase

from lossguard.common.catalogue import register_metric
from lossguard.monitor.notify.model import Notification
from lossguard.monitor.notify.store import DEAD, PENDING, NotifyStore
from lossguard.monitor.rules.alerting import RuleAlerts
from lossguard.monitor.sources import TargetStatus
from lossguard.monitor.sources.announced import REFUSAL_REASONS
from lossguard.monitor.sources.liveness import (
    RUN_EXITED,
    RUN_EXITED_HELP,
    RUN_EXITED_LABELS,
    DeadRun,
)

PREFIX = "lossguard_monitor_"
EVAL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
ALERT_STATES = ("pending", "firing")

# name (without prefix) -> (type, help, label names); dashboards and tests read these names.
CATALOGUE: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "alerts": ("gauge", "Active alerts by state.", ("alertname", "state")),
    "target_up": ("gauge", "1 if the last scrape succeeded.", ("target",)),
    "rule_evaluation_duration_seconds": ("histogram", "Wall time of one rule's evaluation.", ()),
    "rule_evaluation_failures": ("counter", "Rule evaluations that failed.", ("alertname",)),
    "alert_transitions": ("counter", "Alert state changes recorded.", ("alertname", "kind")),
    "rules_loaded": ("gauge", "Alerting rules currently loaded.", ()),
    "config_last_reload_successful": ("gauge", "1 if the last rules (re)load succeeded.", ()),
    "config_last_reload_success_timestamp_seconds": (
        "gauge",
        "Wall time of the last successful rules (re)load.",
        (),
    ),
    "notifications": (
        "counter",
        "Delivery attempts by result: delivered, retry (failed, will be retried), dead.",
        ("receiver", "integration", "result"),
    ),
    "outbox_pending": ("gauge", "Notifications waiting for delivery.", ()),
    "actions": (
        "counter",
        "Actions by result: applied, failed, retry (not delivered, will be retried), held "
        "(by a silence), dropped (held until its alert ended), dry_run, refused (an "
        "Alertmanager alert not acted on), nothing_to_restore.",
        ("action", "result"),
    ),
    "discovery_refusals": (
        "counter",
        "Run announcements (lossguard_agent_info) not believed, never acted on: an unknown "
        "protocol version, an address that is not HOST:PORT, an address on another host than "
        "the one scraped, two rank 0s of one run.",
        ("reason",),
    ),
    "outbox_dead_letters": (
        "gauge",
        "Notifications that failed for good (lossguard-monitor status lists them).",
        (),
    ),
}
BUCKETS = {"rule_evaluation_duration_seconds": EVAL_BUCKETS}
# Series about runs, not the monitor: full names, the same names and labels as the monitor's own
# scrape path writes (lossguard.monitor.sources.liveness), so a Prometheus that scrapes the
# monitor evaluates the rules on them alike.
RUN_CATALOGUE: dict[str, tuple[str, str, tuple[str, ...]]] = {
    RUN_EXITED: ("gauge", RUN_EXITED_HELP, RUN_EXITED_LABELS),
}

M = TypeVar("M", bound=MetricWrapperBase)


class MonitorMetrics:
    """The catalogue (and the process collector) on a private registry."""

    def __init__(self) -> None:
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self._metrics = {
            name: register_metric(
                kind, PREFIX + name, doc, labels, self.registry, BUCKETS.get(name)
            )
            for name, (kind, doc, labels) in CATALOGUE.items()
        } | {
            name: register_metric(kind, name, doc, labels, self.registry)
            for name, (kind, doc, labels) in RUN_CATALOGUE.items()
        }
        ProcessCollector(registry=self.registry)
        self.alerts = self.metric(Gauge, "alerts")
        self.target_up = self.metric(Gauge, "target_up")
        self.evaluation = self.metric(Histogram, "rule_evaluation_duration_seconds")
        self.evaluation_failures = self.metric(Counter, "rule_evaluation_failures")
        self.transitions = self.metric(Counter, "alert_transitions")
        self.rules_loaded = self.metric(Gauge, "rules_loaded")
        self.reload_success = self.metric(Gauge, "config_last_reload_successful")
        self.reload_timestamp = self.metric(Gauge, "config_last_reload_success_timestamp_seconds")
        self.notifications = self.metric(Counter, "notifications")
        self.outbox_pending = self.metric(Gauge, "outbox_pending")
        self.dead_letters = self.metric(Gauge, "outbox_dead_letters")
        self.actions = self.metric(Counter, "actions")
        self.discovery_refusals = self.metric(Counter, "discovery_refusals")
        for reason in REFUSAL_REASONS:
            self.discovery_refusals.labels(reason)
        self.run_exited = self.metric(Gauge, RUN_EXITED)
        self._seen_alerts: set[tuple[str, str]] = set()
        self._seen_rules: set[str] = set()
        self._seen_targets: set[str] = set()
        self._seen_exits: set[tuple[str, ...]] = set()

    def metric(self, kind: type[M], name: str) -> M:
        """The catalogue metric ``name`` (without prefix; a run series by its full name),
        checked to be a ``kind``."""
        metric = self._metrics[name]
        if not isinstance(metric, kind):
            raise TypeError(f"{PREFIX}{name} is a {type(metric).__name__}, not a {kind.__name__}")
        return metric

    def update_alerts(self, rules: Iterable[RuleAlerts]) -> None:
        """Set ``alerts{alertname,state}`` from the rules' active alerts (0 once they end)."""
        counts: dict[tuple[str, str], int] = {}
        for entry in rules:
            for state in ALERT_STATES:
                counts.setdefault((entry.rule.name, state), 0)
            for alert in entry.alerts.values():
                counts[(entry.rule.name, alert.state.value)] += 1
        for key in self._seen_alerts - set(counts):
            self.alerts.remove(*key)
        for (name, state), count in counts.items():
            self.alerts.labels(name, state).set(count)
        self._seen_alerts = set(counts)
        # every loaded rule's failure counter exists from the start, at 0, so that increase()
        # sees its first failure and a dashboard has a series without one; a rule no longer
        # loaded loses it
        names = {name for name, _ in counts}
        for name in self._seen_rules - names:
            self.evaluation_failures.remove(name)
        for name in names - self._seen_rules:
            self.evaluation_failures.labels(name)
        self._seen_rules = names

    def notified(self, notification: Notification, result: str) -> None:
        self.notifications.labels(notification.receiver, notification.integration, result).inc()

    def acted(self, action: str, result: str) -> None:
        self.actions.labels(action, result).inc()

    def refused_announcement(self, reason: str) -> None:
        self.discovery_refusals.labels(reason).inc()

    def watch_outbox(self, store: NotifyStore) -> None:
        """Read the outbox counts from the state database at each scrape."""
        self.outbox_pending.set_function(lambda: store.counts()[PENDING])
        self.dead_letters.set_function(lambda: store.counts()[DEAD])

    def update_targets(self, targets: Iterable[TargetStatus]) -> None:
        """Set ``target_up{target}``; a target no longer watched loses its series."""
        current = {t.url: t for t in targets if t.up is not None}
        for url in self._seen_targets - set(current):
            self.target_up.remove(url)
        for url, target in current.items():
            self.target_up.labels(url).set(1 if target.up else 0)
        self._seen_targets = set(current)

    def update_run_exits(self, dead: Iterable[DeadRun]) -> None:
        """Set the dead runs' series; a run no longer dead (or forgotten) loses its series."""
        current = {tuple(run.labels()[name] for name in RUN_EXITED_LABELS): run for run in dead}
        for key in self._seen_exits - set(current):
            self.run_exited.remove(*key)
        for key, run in current.items():
            self.run_exited.labels(*key).set(run.last_seen)
        self._seen_exits = set(current)
