"""The monitor daemon: gets the numbers, evaluates the rules on a fixed interval, keeps the
alerts in the state database, serves its own metrics; reloads rules on SIGHUP."""

from __future__ import annotations

import dataclasses
import logging
import signal
import sqlite3
import threading
import time
from types import FrameType
from typing import Any

from lossguard.monitor.actions.corroborate import Corroborator, confirm_window_s
from lossguard.monitor.actions.engine import Actions, Refusal
from lossguard.monitor.actions.intake import IncomingAlert
from lossguard.monitor.actions.model import ActionRecord
from lossguard.monitor.actions.outcomes import hold_for
from lossguard.monitor.alert_store import AlertStore
from lossguard.monitor.config import MonitorConfig, owner_ids, webhook_token
from lossguard.monitor.http.read_api import api_routes
from lossguard.monitor.http.server import MonitorServer
from lossguard.monitor.metrics import MonitorMetrics
from lossguard.monitor.notify.config import read_secrets
from lossguard.monitor.notify.delivery import Backoff, Deliverer
from lossguard.monitor.notify.dispatcher import Dispatcher
from lossguard.monitor.notify.facts import FACT_METRICS, RunFacts
from lossguard.monitor.notify.integrations import build_integrations
from lossguard.monitor.promql import Value
from lossguard.monitor.rules.alerting import AlertState, Transition, TransitionKind
from lossguard.monitor.rules.rulefile import (
    AlertingRule,
    RuleError,
    RuleGroup,
    load_rule_files,
    longest_range_s,
    metric_names,
)
from lossguard.monitor.rules.ruleset import RuleSet, Schedule
from lossguard.monitor.runs import RUN_METRICS, RunsView
from lossguard.monitor.sources import Source
from lossguard.monitor.sources.announced import AGENT_INFO, AnnouncedRuns
from lossguard.monitor.sources.discovery import discover, trust_owners
from lossguard.monitor.sources.file_sd import FileSdWriter
from lossguard.monitor.sources.liveness import DeadRun
from lossguard.monitor.sources.prometheus import PrometheusSource
from lossguard.monitor.sources.scrape import ScrapeSource

log = logging.getLogger("lossguard.monitor")
RETENTION_MARGIN_S = 60.0


class Monitor:
    """One monitor process: built from a config, run until :meth:`stop`."""

    def __init__(self, config: MonitorConfig) -> None:
        self.config = config
        self.interval_s = config.rules.evaluation_interval.seconds
        groups = self._load_rules()  # RuleError: the caller exits 2
        secrets = read_secrets(config.notifications)  # ConfigError: the caller exits 2
        trust_owners(owner_ids(config.scrape))  # ConfigError: the caller exits 2
        self.store = AlertStore(config.state.path)
        self.metrics = MonitorMetrics()
        self._unrecorded: list[Transition] = []
        self._unrecorded_rules: set[str] = set()
        now = time.time()
        stored = self.store.load_alerts()
        last = self.store.last_evaluation()
        for alert in (a for alerts in stored.values() for a in alerts):
            if alert.state is AlertState.PENDING and last is not None:
                alert.active_at += now - last  # as Prometheus: downtime does not count to `for`
        self.ruleset, ended = RuleSet.restore(
            groups,
            stored,
            now,
            external_labels=config.rules.external_labels,
            external_url=config.rules.external_url,
        )
        self._record(ended, set(stored) | set(self.ruleset.active()))
        self.source = self._make_source(groups)
        self.file_sd = _file_sd_writer(config)
        integrations = build_integrations(
            config.notifications, secrets, external_url=config.rules.external_url
        )
        facts = RunFacts(self.source)
        self.announced = AnnouncedRuns(
            config.discovery.forget.seconds, self.metrics.refused_announcement
        )
        self.dispatcher = Dispatcher(
            self.store,
            config.notifications,
            integrations,
            facts=facts,
            annotate=lambda alert: self.actions.annotate(alert),
        )
        self.actions = Actions(
            config.actions,
            self.store,
            self.dispatcher.silences,
            runs_root=config.scrape.runs_root,
            announced=self.announced,
            config_path=None if config.source_file is None else str(config.source_file),
            observe=self.metrics.acted,
            on_done=self._acted,
            corroborator=Corroborator(
                lambda: [entry.rule for entry in self.ruleset.rules],
                self._knows_run,
                self.source.query,
                confirm_within_s=confirm_window_s(self._view_update_s()),
            ),
            step_of=facts.step,
            announce_for_s=hold_for(r.group_wait_s for r in self.dispatcher.routes.values()),
        )
        delivery = config.notifications.delivery
        self.deliverer = Deliverer(
            self.dispatcher.store,
            integrations,
            timeout_s=delivery.timeout.seconds,
            backoff=Backoff(delivery.min_backoff.seconds, delivery.max_backoff.seconds),
            observe=self.metrics.notified,
        )
        self.metrics.watch_outbox(self.dispatcher.store)
        self._loaded(groups)
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._wake = threading.Event()
        self._last_cycle: float | None = None
        self.schedule = Schedule(self.interval_s)
        token = webhook_token(config.listen)
        self.server = MonitorServer(
            self.metrics.registry,
            self._health,
            self._status,
            config.listen.host,
            config.listen.port,
            on_alerts=self.receive_alertmanager,
            token=token,
            token_env=config.listen.token_env,
            extra=api_routes(
                RunsView(config.scrape.runs_root, self.source, self.store, self.announced),
                self.store,
                self.actions.endpoints,
                token=token,
                token_env=config.listen.token_env,
            ),
        )

    def _view_update_s(self) -> float:
        """The longest the monitor's view takes to show a new value: an evaluation, after a
        scrape where the monitor scrapes (its Prometheus has the value it alerted on)."""
        scraping = self.config.source != "prometheus"
        return self.interval_s + (self.config.scrape.interval.seconds if scraping else 0.0)

    def _make_source(self, groups: list[RuleGroup]) -> Source:
        if self.config.source == "prometheus":
            assert self.config.prometheus is not None  # checked by the config
            return PrometheusSource(
                self.config.prometheus.url, timeout_s=self.config.prometheus.timeout.seconds
            )
        scrape = self.config.scrape
        return ScrapeSource(
            static_targets=scrape.targets,
            file_sd_files=scrape.file_sd_files,
            runs_root=scrape.runs_root,
            interval_s=scrape.interval.seconds,
            timeout_s=None if scrape.timeout is None else scrape.timeout.seconds,
            job=scrape.job,
            retention_s=longest_range_s(groups) + RETENTION_MARGIN_S,
            keep_names=_kept_names(groups),
            forget_dead_after_s=scrape.forget_dead_runs_after.seconds,
        )

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        """Evaluate until stopped (SIGTERM/SIGINT, or :meth:`stop`)."""
        self.source.start()
        if self.file_sd is not None:
            self.file_sd.start()
        self.deliverer.start()
        self.actions.start()
        self.store.set_meta("listen_url", self.server.url)
        log.info(
            "monitor serving %s/metrics; %d rules from %s; state %s",
            self.server.url,
            len(self.ruleset.rules),
            ", ".join(str(f) for f in self.config.rules.files),
            self.config.state.path,
        )
        try:
            while not self._stop.is_set():
                if self._reload.is_set():
                    self._reload.clear()
                    self.reload()
                now = time.time()
                due = self.schedule.due(self.ruleset.groups, now)
                if due:
                    try:
                        self.evaluate(now, due)
                    except Exception:  # the daemon outlives any one cycle
                        log.exception("evaluation cycle failed")
                        self.schedule.done(self.ruleset.groups, due, now)
                self.act(time.time())
                self.notify(time.time())
                wake_at = min(
                    self.schedule.wake_time(now), self.dispatcher.next_flush() or now + 60
                )
                self._wake.wait(max(0.0, wake_at - time.time()))
                self._wake.clear()
        finally:
            self.close()

    def evaluate(self, t: float, groups: set[str] | None = None) -> list[Transition]:
        """One evaluation of the (due) groups at ``t``: alerts updated, persisted, logged.
        Nothing is evaluated before the source has its first data."""
        history_start = self.source.history_start()
        if history_start is None:
            return []
        transitions = self.ruleset.evaluate(
            self._query,
            t,
            groups=groups,
            observe=self.metrics.evaluation.observe,
            history_start=history_start,
            expr_query=self.source.query,
        )
        evaluated = [e for e in self.ruleset.rules if groups is None or e.group.key in groups]
        for entry in evaluated:
            if entry.last_error is not None and entry.last_evaluation == t:
                self.metrics.evaluation_failures.labels(entry.rule.name).inc()
                log.warning("rule %s failed: %s", entry.rule.name, entry.last_error)
        self._record(transitions, {e.key for e in evaluated}, t)
        self.schedule.done(self.ruleset.groups, groups or {g.key for g in self.ruleset.groups}, t)
        self.metrics.update_alerts(self.ruleset.rules)
        self.metrics.update_targets(self.source.targets())
        self.announced.update(self.source.query, t)
        self.metrics.update_run_exits(self._dead_runs(t))
        self._last_cycle = t
        return transitions

    def _dead_runs(self, t: float) -> list[DeadRun]:
        """The runs whose process died here: the scraper's, or (with source: prometheus) from a
        look at ``scrape.runs_root``, so that Prometheus scraping ``/metrics`` sees them."""
        if isinstance(self.source, ScrapeSource):
            return self.source.dead_runs()
        scrape = self.config.scrape
        if scrape.runs_root is None:
            return []
        forget_after_s = scrape.forget_dead_runs_after.seconds
        return discover(scrape.runs_root, now=t, forget_after_s=forget_after_s).dead

    def act(self, now: float) -> None:
        """Decide about the firing alerts that ask for an action (recorded, then sent by the
        actions thread): before any notification, so grouping never delays an action."""
        alerts = [a for found in self.ruleset.active().values() for a in found]
        try:
            self.actions.step(alerts, now)
        except sqlite3.Error as exc:
            log.error("state database: %s; actions are decided on the next cycle", exc)
        except Exception:  # the daemon outlives any one cycle
            log.exception("actions cycle failed")

    def _acted(self, record: ActionRecord) -> None:
        """An action was answered: announced, or paged for when it failed (``Outcomes``)."""
        try:
            self.actions.tell(record, time.time())
        except sqlite3.Error as exc:
            log.error("state database: %s; action %s is not told", exc, record.id)
        self._wake.set()

    def receive_alertmanager(self, alerts: list[IncomingAlert]) -> list[Refusal]:
        """Alerts from Alertmanager's webhook: those the monitor corroborates are decided about
        on the next cycle, now; the others are refused (returned, with why)."""
        refused = self.actions.receive(alerts, time.time())
        self._wake.set()
        return refused

    def _knows_run(self, run_id: str) -> bool:
        """Whether ``run_id`` is a run the monitor watches: announced on the source, discovered
        under the runs root, or reached through ``actions.agents``."""
        return self.actions.endpoints.knows(run_id)

    def notify(self, now: float) -> list[int] | None:
        """Queue what the recorded transitions and due alert groups call for; wake delivery.
        None: the step failed, and is tried again with the next evaluation (nothing it
        consumed was committed)."""
        firing = [
            alert.labels
            for alerts in self.ruleset.active().values()
            for alert in alerts
            if alert.state is AlertState.FIRING
        ]
        try:
            queued = self.dispatcher.step(now, firing)
        except sqlite3.Error as exc:
            log.error("state database: %s; notifications wait for the next cycle", exc)
            return None
        except Exception:  # the daemon outlives any one cycle
            log.exception("notification cycle failed")
            return None
        if queued:
            self.deliverer.wake()
        return queued

    def _next_flush(self) -> float | None:
        try:
            return self.dispatcher.next_flush()
        except sqlite3.Error:
            return None  # told by notify() already

    def _query(self, rule: AlertingRule, t: float) -> Value:
        return self.source.query(rule.expr, t)

    def _record(
        self, transitions: list[Transition], rule_keys: set[str], t: float | None = None
    ) -> None:
        """Persist the rules' alerts and the transitions (with any a failed write left over),
        then log and count the transitions."""
        self._unrecorded.extend(transitions)
        self._unrecorded_rules.update(rule_keys)
        active = self.ruleset.active()
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

    # ------------------------------------------------------------------ reload and stop

    def request_reload(self) -> None:
        self._reload.set()
        self._wake.set()

    def reload(self) -> bool:
        """Re-read the rule files; on any problem keep the rules in force and say why."""
        try:
            groups = self._load_rules()
        except RuleError as exc:
            self.metrics.reload_success.set(0)
            log.error(
                "rules reload failed, keeping the %d rules in force: %s",
                len(self.ruleset.rules),
                exc,
            )
            return False
        previous = {e.key for e in self.ruleset.rules}
        self.ruleset, ended = self.ruleset.replace(groups, time.time())
        self._record(ended, previous | {e.key for e in self.ruleset.rules})
        if isinstance(self.source, ScrapeSource):
            self.source.retention_s = longest_range_s(groups) + RETENTION_MARGIN_S
            self.source.keep_names = _kept_names(groups)
        self.schedule.reset()
        self._loaded(groups)
        log.info("rules reloaded: %d rules", len(self.ruleset.rules))
        return True

    def _load_rules(self) -> list[RuleGroup]:
        """The rule files; Prometheus evaluates any PromQL, the embedded evaluator its subset."""
        return load_rule_files(
            self.config.rules.files, full_promql=self.config.source == "prometheus"
        )

    def _loaded(self, groups: list[RuleGroup]) -> None:
        self.metrics.rules_loaded.set(sum(len(g.rules) for g in groups))
        self.metrics.reload_success.set(1)
        self.metrics.reload_timestamp.set(time.time())

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def install_signal_handlers(self) -> None:
        def on_stop(signum: int, frame: FrameType | None) -> None:
            log.info("%s: stopping", signal.Signals(signum).name)
            self.stop()

        def on_hup(signum: int, frame: FrameType | None) -> None:
            self.request_reload()

        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGHUP, on_hup)

    def _health(self) -> tuple[bool, dict[str, Any]]:
        stale_after = 3 * self.interval_s + 5
        fresh = self._last_cycle is not None and time.time() - self._last_cycle < stale_after
        targets = self.source.targets()
        return fresh, {
            "rules": len(self.ruleset.rules),
            "last_evaluation": self._last_cycle,
            "targets": len(targets),
            "targets_up": sum(1 for t in targets if t.up),
        }

    def _status(self) -> dict[str, Any]:
        """What only the running daemon knows: its targets and its last evaluation."""
        return {
            "last_evaluation": self._last_cycle,
            "rules": len(self.ruleset.rules),
            "targets": [dataclasses.asdict(t) for t in self.source.targets()],
        }

    def close(self) -> None:
        self.actions.stop()
        self.deliverer.stop()
        if self.file_sd is not None:
            self.file_sd.close()
        self.source.close()
        self.server.close()
        self.store.close()


def _file_sd_writer(config: MonitorConfig) -> FileSdWriter | None:
    """The ``scrape.file_sd_path`` writer (None: not configured); it looks at the runs as
    often as the scraper does."""
    scrape = config.scrape
    if scrape.file_sd_path is None or scrape.runs_root is None:
        return None
    return FileSdWriter(
        scrape.file_sd_path,
        scrape.runs_root,
        interval_s=scrape.interval.seconds,
        forget_dead_after_s=scrape.forget_dead_runs_after.seconds,
        job=scrape.job,
    )


def _kept_names(groups: list[RuleGroup]) -> frozenset[str] | None:
    """The metric names a scrape keeps: those the rules, the notifications, the HTTP API and
    the runs' announcements read (None: all, when a rule selects names by regex)."""
    names = metric_names(groups)
    if names is None:
        return None
    return names | FACT_METRICS | set(RUN_METRICS.values()) | {AGENT_INFO}
