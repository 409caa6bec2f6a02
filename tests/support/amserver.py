"""The real Alertmanager for differential tests (Debian's prometheus-alertmanager 0.25, which CI
installs): ``amtool`` runs, and the server on 127.0.0.1 with a webhook sink that records what it
is sent."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import requests
import yaml

from tests.support.processes import free_port
from tests.support.promserver import ServerProcess, running, web_config_flag
from tests.support.webauth import WebAuth


def binary(name: str) -> str:
    """An Alertmanager binary (``amtool`` or ``prometheus-alertmanager``); missing fails."""
    path = shutil.which(name)
    assert path is not None, f"{name} is not installed: apt-get install prometheus-alertmanager"
    return path


def amtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("amtool"), *args], capture_output=True, text=True, timeout=30, check=False
    )


def write_config(path: Path, config: Mapping[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(dict(config), sort_keys=False, allow_unicode=True))
    return path


@dataclass
class AlertmanagerServer(ServerProcess):
    """A running Alertmanager: its base URL and its alerts API."""

    LOG_FILE = "alertmanager.log"

    def post_alerts(self, alerts: Sequence[Mapping[str, Any]]) -> None:
        """``POST /api/v2/alerts`` with these postable alerts, in this order, in one request."""
        reply = requests.post(
            f"{self.url}/api/v2/alerts", json=list(alerts), auth=self.auth, timeout=10
        )
        assert reply.status_code == 200, reply.text

    def post_firing(self, label_sets: Sequence[Mapping[str, str]]) -> None:
        """Firing alerts with these labels (Alertmanager sets their times)."""
        self.post_alerts([{"labels": dict(labels)} for labels in label_sets])

    def alerts(self) -> list[dict[str, Any]]:
        """``GET /api/v2/alerts`` (Alertmanager works out inhibition anew for each request)."""
        reply = requests.get(f"{self.url}/api/v2/alerts", auth=self.auth, timeout=10)
        assert reply.status_code == 200, reply.text
        alerts: list[dict[str, Any]] = reply.json()
        return alerts


@contextmanager
def alertmanager(
    directory: Path, config: Mapping[str, Any], web_auth: WebAuth | None = None
) -> Iterator[AlertmanagerServer]:
    """Run Alertmanager with ``config`` on a free port of 127.0.0.1 (also its external URL),
    without clustering; its files live in ``directory``. With ``web_auth``, as in the compose
    stack: its web endpoints need basic auth. Stopped on exit."""
    directory.mkdir(parents=True, exist_ok=True)
    config_path = write_config(directory / "alertmanager.yml", config)
    port = free_port()
    with open(directory / AlertmanagerServer.LOG_FILE, "wb") as log:
        process = subprocess.Popen(
            [
                binary("prometheus-alertmanager"),
                f"--config.file={config_path}",
                f"--storage.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                f"--web.external-url=http://127.0.0.1:{port}",
                "--cluster.listen-address=",
                "--log.level=warn",
                *web_config_flag(directory, web_auth),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    auth = None if web_auth is None else web_auth.pair
    server = AlertmanagerServer(process, port, directory, auth)
    with running(server, "Alertmanager", 20):
        yield server


class _Server(ThreadingHTTPServer):
    request_queue_size = 128  # Alertmanager sends many groups at once; 5 would drop connections


class CaptureServer:
    """A webhook receiver on 127.0.0.1 (for Alertmanager, or our webhook integration) that
    records each POST's path, headers and JSON body and answers with ``status``."""

    def __init__(self) -> None:
        self.status = 200
        self.posts: list[tuple[str, dict[str, str], Any]] = []
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        ).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}{path}"

    def bodies(self, path: str) -> list[Any]:
        with self._lock:
            return [body for p, _, body in self.posts if p == path]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        capture = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with capture._lock:
                    capture.posts.append((self.path, dict(self.headers), body))
                self.send_response(capture.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet."""

        return Handler


@contextmanager
def capture_server() -> Iterator[CaptureServer]:
    server = CaptureServer()
    try:
        yield server
    finally:
        server.close()
