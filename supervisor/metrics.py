"""The supervisor's ``lossguard_supervisor_*`` series, declared once in :data:`CATALOGUE` (the
default rules TrainingCrashed and TrainingCrashLoop read them), served on its own exporter."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from lossguard.common.catalogue import CONTROL_REFUSALS, register_metric
from lossguard.common.rundir.supervisor_file import SupervisorState

PREFIX = "lossguard_supervisor_"
STATES: tuple[SupervisorState, ...] = ("running", "backoff", "crash_loop", "exited")
RESTART_REASONS = ("crash", "requested")

# name (without prefix) -> (type, help, label names)
CATALOGUE: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "state": ("gauge", "1 for the supervisor's current state.", ("run_id", "state")),
    "crashes": ("counter", "Times the training command died (error exit or signal).", ("run_id",)),
    "restarts": ("counter", "Times the training command was started again.", ("run_id", "reason")),
    "restarts_remaining": ("gauge", "Restarts left in the budget's window.", ("run_id",)),
    "last_crash_timestamp_seconds": (
        "gauge",
        "When the training command last died; the labels say how, at which step, on which "
        "node (of a multi-node run: the node whose group crashed first), and the checkpoint "
        "the restart resumes from.",
        ("run_id", "exit", "step", "node", "checkpoint"),
    ),
    "control_refusals": (
        "counter",
        "Connections and requests to the supervisor's TCP control refused before "
        "authentication: no token line in time (timeout), a wrong or missing token "
        "(unauthorized), no free slot (busy).",
        ("run_id", "reason"),
    ),
}


class SupervisorMetrics:
    """The series of one supervised run."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.registry = CollectorRegistry(auto_describe=True)
        self._metrics = {
            name: register_metric(kind, f"{PREFIX}{name}", doc, labels, self.registry)
            for name, (kind, doc, labels) in CATALOGUE.items()
        }
        self.set_state("running")
        for reason in RESTART_REASONS:
            self._counter("restarts").labels(run_id, reason)
        self._counter("crashes").labels(run_id)
        for reason in CONTROL_REFUSALS:
            self._counter("control_refusals").labels(run_id, reason)

    def _gauge(self, name: str) -> Gauge:
        metric = self._metrics[name]
        assert isinstance(metric, Gauge)
        return metric

    def _counter(self, name: str) -> Counter:
        metric = self._metrics[name]
        assert isinstance(metric, Counter)
        return metric

    def serve(self, host: str, port: int) -> int:
        """Start the exporter; the port it listens on."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_address[1])

    def set_state(self, state: SupervisorState) -> None:
        for each in STATES:
            self._gauge("state").labels(self.run_id, each).set(1.0 if each == state else 0.0)

    def crashed(
        self, exit: str, step: int | None, checkpoint: str | None, node: int | None
    ) -> None:
        self._counter("crashes").labels(self.run_id).inc()
        last = self._gauge("last_crash_timestamp_seconds")
        last.clear()  # one series: the last crash
        where = "" if node is None else str(node)
        labels = (self.run_id, exit, "" if step is None else str(step), where, checkpoint or "")
        last.labels(*labels).set(time.time())

    def restarted(self, reason: str) -> None:
        self._counter("restarts").labels(self.run_id, reason).inc()

    def set_remaining(self, remaining: int) -> None:
        self._gauge("restarts_remaining").labels(self.run_id).set(remaining)

    def control_refused(self, reason: str) -> None:
        """A TCP control connection or request refused before authentication (the control
        server's ``on_refused``): counted, never an audit line."""
        self._counter("control_refusals").labels(self.run_id, reason).inc()
