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
from lossguard.monitor.alert_recorder import AlertRecorder
from lossguard.monitor.alert_store import AlertStore
from lossguard.monitor.config import MonitorConfig, owner_ids, webhook_token
from lossguard.monitor.http.read_api import api_routes
from lossguard.monitor.http.server import MonitorServer
from lossguard.monitor.metrics import MonitorMetrics
from lossguard.monitor.notify.config import read_secrets
from lossguard.monitor.notify.delivery import Backoff, Deliverer
from lossguard.monitor.notify.dispatcher import Dispatcher
from lossguard.monitor.notify.facts import RunFacts
from lossguard.monitor.notify.integrations import build_integrations
from lossguard.monitor.promql import Value
from lossguard.monitor.rules.alerting import AlertState, Transition
from lossguard.monitor.rules.rulefile import AlertingRule, RuleError, RuleGroup, load_rule_files
from lossguard.monitor.rules.ruleset import Schedule
from lossguard.monitor.runs import RunsView
from lossguard.monitor.source_setup import (
    dead_runs,
    file_sd_writer,
    follow_rules,
    make_source,
    view_update_s,
)
from lossguard.monitor.sources.announced import AnnouncedRuns
from lossguard.monitor.sources.discovery import trust_owners

log = logging.getLogger("lossguard.monitor")


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
        self.recorder = AlertRecorder(self.store, self.metrics)
        self.ruleset = self.recorder.restore(groups, time.time(), config.rules)
        self.source = make_source(config, groups)
        self.file_sd = file_sd_writer(config)
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
                confirm_within_s=confirm_window_s(view_update_s(config)),
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
                wake_at = min(self.schedule.wake_time(now), self._next_flush() or now + 60)
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
        self.recorder.record(self.ruleset, transitions, {e.key for e in evaluated}, t)
        self.schedule.done(self.ruleset.groups, groups or {g.key for g in self.ruleset.groups}, t)
        self.metrics.update_alerts(self.ruleset.rules)
        self.metrics.update_targets(self.source.targets())
        self.announced.update(self.source.query, t)
        self.metrics.update_run_exits(dead_runs(self.config, self.source, t))
        self._last_cycle = t
        return transitions

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
        self.recorder.record(self.ruleset, ended, previous | {e.key for e in self.ruleset.rules})
        follow_rules(self.source, groups)
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
