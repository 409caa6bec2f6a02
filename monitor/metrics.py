"""The monitor's own metrics (the ``lossguard_monitor_*`` part of the catalogue) and the HTTP
endpoint that serves them with ``/healthz``."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from lossguard.agent.config import ConfigError
from lossguard.monitor.alerting import RuleAlerts
from lossguard.monitor.notify.model import Notification
from lossguard.monitor.notify.store import DEAD, PENDING, NotifyStore
from lossguard.monitor.sources import TargetStatus

EVAL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
ALERT_STATES = ("pending", "firing")

Health = Callable[[], tuple[bool, dict[str, object]]]
Status = Callable[[], dict[str, object]]


class MonitorMetrics:
    """The monitor's series on a private registry."""

    def __init__(self) -> None:
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.alerts = Gauge(
            "lossguard_monitor_alerts",
            "Active alerts by state.",
            ["alertname", "state"],
            registry=r,
        )
        self.target_up = Gauge(
            "lossguard_monitor_target_up", "1 if the last scrape succeeded.", ["target"], registry=r
        )
        self.evaluation = Histogram(
            "lossguard_monitor_rule_evaluation_duration_seconds",
            "Wall time of one rule's evaluation.",
            buckets=EVAL_BUCKETS,
            registry=r,
        )
        self.evaluation_failures = Counter(
            "lossguard_monitor_rule_evaluation_failures",
            "Rule evaluations that failed.",
            ["alertname"],
            registry=r,
        )
        self.transitions = Counter(
            "lossguard_monitor_alert_transitions",
            "Alert state changes recorded.",
            ["alertname", "kind"],
            registry=r,
        )
        self.rules_loaded = Gauge(
            "lossguard_monitor_rules_loaded", "Alerting rules currently loaded.", registry=r
        )
        self.reload_success = Gauge(
            "lossguard_monitor_config_last_reload_successful",
            "1 if the last rules (re)load succeeded.",
            registry=r,
        )
        self.reload_timestamp = Gauge(
            "lossguard_monitor_config_last_reload_success_timestamp_seconds",
            "Wall time of the last successful rules (re)load.",
            registry=r,
        )
        self.notifications = Counter(
            "lossguard_monitor_notifications",
            "Delivery attempts by result: delivered, retry (failed, will be retried), dead.",
            ["receiver", "integration", "result"],
            registry=r,
        )
        self.outbox_pending = Gauge(
            "lossguard_monitor_outbox_pending", "Notifications waiting for delivery.", registry=r
        )
        self.dead_letters = Gauge(
            "lossguard_monitor_outbox_dead_letters",
            "Notifications that failed for good (lossguard-monitor status lists them).",
            registry=r,
        )
        ProcessCollector(registry=r)
        self._seen_alerts: set[tuple[str, str]] = set()
        self._seen_targets: set[str] = set()

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

    def notified(self, notification: Notification, result: str) -> None:
        self.notifications.labels(notification.receiver, notification.integration, result).inc()

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


class MonitorServer:
    """``/metrics``, ``/healthz`` and ``/api/status`` (what ``lossguard-monitor status`` shows of
    the running daemon) on a daemon thread."""

    def __init__(
        self, registry: CollectorRegistry, health: Health, status: Status, host: str, port: int
    ) -> None:
        handler = _handler(registry, health, status)
        try:
            self._server = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise ConfigError(
                f"listen.port: cannot serve on {host}:{port} ({exc.strerror}); "
                "is another monitor running? set listen.port=0 for any free port"
            ) from None
        self._server.daemon_threads = True
        self.host, self.port = host, int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="monitor-http", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(
    registry: CollectorRegistry, health: Health, status: Status
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, CONTENT_TYPE_LATEST, generate_latest(registry))
            elif path == "/healthz":
                healthy, detail = health()
                body = json.dumps({"healthy": healthy, **detail}).encode() + b"\n"
                self._reply(200 if healthy else 503, "application/json", body)
            elif path == "/api/status":
                body = json.dumps(status()).encode() + b"\n"
                self._reply(200, "application/json", body)
            else:
                self._reply(404, "text/plain", b"not found: try /metrics or /healthz\n")

        def _reply(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            """Quiet: scrapes every second would flood the log."""

    return Handler
