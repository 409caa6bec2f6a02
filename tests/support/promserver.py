"""Real servers on 127.0.0.1 for the monitor's tests: a Prometheus binary scraping given
targets, and a ``/metrics`` endpoint that serves whatever the test sets."""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import requests
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from tests.support.processes import free_port, wait_for
from tests.support.webauth import USER, WebAuth

TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


def prometheus_binary() -> str:
    """The Prometheus server binary (scripts/test.sh installs it; a missing one fails)."""
    path = shutil.which("prometheus")
    assert path is not None, "the prometheus binary is not installed: apt-get install prometheus"
    return path


def promtool_test_rules(test_file: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``promtool test rules TEST_FILE`` (its rule files are found relative to it; a missing
    promtool fails)."""
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is not installed: apt-get install prometheus"
    return subprocess.run(
        [promtool, "test", "rules", str(test_file)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@dataclass
class ServerProcess:
    """A server binary running on 127.0.0.1:``port``, logging to ``directory/LOG_FILE``."""

    LOG_FILE: ClassVar[str]
    process: subprocess.Popen[bytes]
    port: int
    directory: Path
    auth: tuple[str, str] | None = None  # basic auth (tests/support/webauth.py), for requests

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return (self.directory / self.LOG_FILE).read_text(errors="replace")


@dataclass
class PromServer(ServerProcess):
    """A running Prometheus: its base URL and a few API helpers."""

    LOG_FILE = "prometheus.log"

    def api(self, path: str, **params: Any) -> Any:
        """``GET /api/v1/<path>``: the reply's ``data`` (fails the test on an API error)."""
        reply = requests.get(
            f"{self.url}/api/v1/{path}", params=params, auth=self.auth, timeout=10
        ).json()
        assert reply["status"] == "success", reply
        return reply["data"]

    def targets_up(self) -> bool:
        """Whether every active target has been scraped successfully."""
        active = self.api("targets", state="active")["activeTargets"]
        return bool(active) and all(target["health"] == "up" for target in active)

    def wait_until_up(self, timeout: float = 30) -> None:
        wait_for(self.targets_up, timeout, "Prometheus to scrape all its targets")


def scrape_config(
    targets: Sequence[str],
    *,
    job: str,
    interval: str,
    timeout: str | None = None,
    target_labels: Mapping[str, Mapping[str, str]] | None = None,
    honor_labels: bool = False,
) -> dict[str, Any]:
    """A scrape config for metrics URLs (each keeps its own scheme and path), with the extra
    ``target_labels`` of some URLs (say the ``run_id`` and ``rank`` the monitor's discovery
    gives)."""
    static = []
    for url in targets:
        parts = urlsplit(url)
        labels = {"__scheme__": parts.scheme, "__metrics_path__": parts.path or "/metrics"}
        labels.update((target_labels or {}).get(url, {}))
        static.append({"targets": [parts.netloc], "labels": labels})
    return {
        "job_name": job,
        "scrape_interval": interval,
        "scrape_timeout": timeout or interval,
        "honor_labels": honor_labels,
        "static_configs": static,
    }


def alerting_config(
    alertmanagers: Sequence[str], password_file: Path | None = None
) -> dict[str, Any]:
    """One ``alerting.alertmanagers`` entry for Alertmanager base URLs (same scheme and path
    prefix, as Prometheus wants them), with basic auth when ``password_file`` is given."""
    parts = [urlsplit(url) for url in alertmanagers]
    schemes = {p.scheme for p in parts}
    prefixes = {p.path.rstrip("/") for p in parts}
    assert len(schemes) == 1 and len(prefixes) == 1, f"one scheme and path: {alertmanagers}"
    entry: dict[str, Any] = {
        "scheme": schemes.pop(),
        "timeout": "5s",
        "api_version": "v2",
        "static_configs": [{"targets": [p.netloc for p in parts]}],
    }
    if password_file is not None:
        entry["basic_auth"] = {"username": USER, "password_file": str(password_file)}
    prefix = prefixes.pop()
    if prefix:
        entry["path_prefix"] = prefix
    return entry


@contextmanager
def prometheus(
    directory: Path,
    targets: Sequence[str] = (),
    *,
    job: str = "lossguard-agent",
    scrape_interval: str = "1s",
    evaluation_interval: str = "1s",
    rule_files: Sequence[Path] = (),
    target_labels: Mapping[str, Mapping[str, str]] | None = None,
    honor_labels: bool = False,
    alertmanagers: Sequence[str] = (),
    ready_timeout: float = 30,
    web_auth: WebAuth | None = None,
    file_sd: Path | None = None,
) -> Iterator[PromServer]:
    """Run Prometheus on a free port of 127.0.0.1, scraping the metrics URLs ``targets`` as
    ``job`` (see :func:`scrape_config`), and with ``file_sd`` the targets of the ``*.json``
    files in that folder too (Prometheus's file_sd, honouring the exposed labels), sending the
    alerts of ``rule_files`` to the Alertmanagers at the base URLs ``alertmanagers``; its
    config, data and log live in ``directory``. With ``web_auth``, as in the compose stack: its
    web endpoints need basic auth, and it sends the same to the Alertmanagers. Stopped on
    exit."""
    binary = prometheus_binary()
    directory.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": evaluation_interval},
        "rule_files": [str(Path(path).resolve()) for path in rule_files],
        "scrape_configs": [
            scrape_config(
                targets,
                job=job,
                interval=scrape_interval,
                target_labels=target_labels,
                honor_labels=honor_labels,
            )
        ],
    }
    if file_sd is not None:
        scrapes = config["scrape_configs"]
        scrapes[0]["file_sd_configs"] = [
            {"files": [str(file_sd / "*.json")], "refresh_interval": "1s"}
        ]
        scrapes[0]["honor_labels"] = True
    password = None if web_auth is None else web_auth.password_file(directory / "web-password")
    if alertmanagers:
        config["alerting"] = {"alertmanagers": [alerting_config(alertmanagers, password)]}
    config_path = directory / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    with open(directory / PromServer.LOG_FILE, "wb") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
                *web_config_flag(directory, web_auth),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = PromServer(process, port, directory, None if web_auth is None else web_auth.pair)
    with running(server, "Prometheus", ready_timeout):
        yield server


def web_config_flag(directory: Path, web_auth: WebAuth | None) -> list[str]:
    """``--web.config.file`` with ``deploy/web.yml`` for ``web_auth`` (none without)."""
    if web_auth is None:
        return []
    return [f"--web.config.file={web_auth.web_config(directory / 'web.yml')}"]


@contextmanager
def running(server: ServerProcess, name: str, ready_timeout: float) -> Iterator[None]:
    """Wait until ``server`` answers ``/-/ready`` (failing with its log if it exits), then
    stop it on exit: SIGTERM, SIGKILL after 20 s."""
    try:
        wait_for(lambda: _ready(server, name), ready_timeout, f"{name} ready at {server.url}")
        yield
    finally:
        server.process.terminate()
        try:
            server.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


def _ready(server: ServerProcess, name: str) -> bool:
    if server.process.poll() is not None:
        raise AssertionError(f"{name} exited with {server.process.returncode}: {server.log}")
    try:
        return requests.get(f"{server.url}/-/ready", auth=server.auth, timeout=1).status_code == 200
    except requests.ConnectionError:
        return False


class ExpositionServer:
    """``/metrics`` on 127.0.0.1: serves ``body`` (text, or a registry rendered per request)
    with ``status``; while ``stalled``, requests hang until the server closes."""

    def __init__(self, body: str | CollectorRegistry = "") -> None:
        self.body = body
        self.status = 200
        self.stalled = False
        self.requests = 0
        self._release = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    @property
    def instance(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()

    def render(self) -> bytes:
        body = self.body
        return generate_latest(body) if isinstance(body, CollectorRegistry) else body.encode()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        exposition = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                exposition.requests += 1
                if exposition.stalled:
                    exposition._release.wait(60)
                    return
                payload = exposition.render()
                self.send_response(exposition.status)
                self.send_header("Content-Type", TEXT_FORMAT)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: the tests assert on what matters."""

        return Handler


@contextmanager
def exposition_server(body: str | CollectorRegistry = "") -> Iterator[ExpositionServer]:
    server = ExpositionServer(body)
    try:
        yield server
    finally:
        server.close()
