"""The notification pipeline's benchmark: an alert storm through the dispatcher (routing,
grouping, outbox writes), then the outbox delivered to a local webhook, against plain POSTs of
the same bodies in the same run.

``python -m lossguard.monitor.notify.bench --alerts 2000 --runs 200``
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests
from rich.console import Console
from rich.table import Table

from lossguard.common.serving import serve_in_background
from lossguard.monitor.alert_store import AlertStore
from lossguard.monitor.notify.config import NotificationsConfig, read_secrets
from lossguard.monitor.notify.delivery import Backoff, Deliverer
from lossguard.monitor.notify.dispatcher import Dispatcher
from lossguard.monitor.notify.integrations import build_integrations
from lossguard.monitor.notify.integrations.webhook import webhook_payload
from lossguard.monitor.notify.store import PENDING, NotifyStore
from lossguard.monitor.rules.alerting import (
    Alert,
    AlertState,
    Transition,
    TransitionKind,
    fingerprint,
)

URL_ENV = "LOSSGUARD_BENCH_WEBHOOK_URL"


class _Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        """Quiet."""


def transitions(kind: TransitionKind, alerts: int, runs: int, t: float) -> list[Transition]:
    """``alerts`` alerts spread over ``runs`` runs, as one evaluation would record them."""
    found = []
    for i in range(alerts):
        labels = {"alertname": "LossSpike", "run_id": f"run{i % runs}", "rank": str(i // runs)}
        labels["severity"] = "warning"
        alert = Alert("bench", fingerprint(labels), labels, {"summary": "s"}, AlertState.FIRING,
                      1.0, t, t)  # fmt: skip
        found.append(Transition(kind, t, alert))
    return found


def run(alerts: int, runs: int, directory: Path, url: str) -> list[tuple[str, int, float]]:
    """(what, how many, seconds) of each measured step."""
    os.environ[URL_ENV] = url
    config = NotificationsConfig.model_validate(
        {
            "receivers": [{"name": "hook", "webhook_configs": [{"url_env": URL_ENV}]}],
            "route": {"receiver": "hook", "group_by": ["alertname", "run_id"], "group_wait": "0s"},
        }
    )
    integrations = build_integrations(config, read_secrets(config), "")
    state = AlertStore(directory / "state.db")
    dispatcher = Dispatcher(state, config, integrations)
    rows = []
    for kind, t in ((TransitionKind.FIRING, 1000.0), (TransitionKind.RESOLVED, 2000.0)):
        state.record({}, transitions(kind, alerts, runs, t))
        start = time.perf_counter()
        queued = dispatcher.step(t, [])
        what = f"dispatch {kind.value} alerts into {len(queued)} notifications"
        rows.append((what, alerts, _since(start)))
    store = NotifyStore(state)
    bodies = [webhook_payload(e.notification) for e in store.entries(PENDING, 10**6)]
    with requests.Session() as session:
        start = time.perf_counter()
        for body in bodies:
            session.post(url, json=body, timeout=10).raise_for_status()
        rows.append(("POST the same bodies directly", len(bodies), _since(start)))
    deliverer = Deliverer(store, integrations, timeout_s=10, backoff=Backoff(1, 1))
    start = time.perf_counter()
    deliverer.start()
    while store.counts()[PENDING]:
        time.sleep(0.005)
    rows.append(("deliver the outbox (Deliverer)", len(bodies), _since(start)))
    deliverer.stop()
    state.close()
    return rows


def _since(start: float) -> float:
    return time.perf_counter() - start


def table(rows: list[tuple[str, int, float]]) -> Table:
    out = Table(title="notification pipeline")
    for column in ("step", "items", "seconds", "ms / item", "vs direct POSTs"):
        out.add_column(column, justify="left" if column == "step" else "right")
    direct = next(s / n for what, n, s in rows if what.startswith("POST"))
    for what, n, s in rows:
        ratio = f"{s / n / direct:.2f}x" if what.startswith(("POST", "deliver")) else ""
        out.add_row(what, str(n), f"{s:.3f}", f"{1000 * s / max(n, 1):.2f}", ratio)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lossguard.monitor.notify.bench")
    parser.add_argument("--alerts", type=int, default=2000, help="alerts in the storm")
    parser.add_argument("--runs", type=int, default=200, help="runs they belong to (groups)")
    args = parser.parse_args(argv)
    given = list(sys.argv[1:] if argv is None else argv)
    if args.alerts < 1 or not 1 <= args.runs <= args.alerts:
        parser.error("need 1 <= --runs <= --alerts")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    server.daemon_threads = True
    serve_in_background(server, "bench-sink")
    try:
        with tempfile.TemporaryDirectory() as directory:
            url = f"http://127.0.0.1:{server.server_address[1]}/hook"
            rows = run(args.alerts, args.runs, Path(directory), url)
    finally:
        server.shutdown()
    console = Console(width=110)
    console.print(table(rows))
    command = shlex.join(["python", "-m", "lossguard.monitor.notify.bench", *given])
    console.print(f"command: {command}", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
