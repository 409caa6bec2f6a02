"""The monitor's HTTP server (standard library ``http.server``, one daemon thread): ``/metrics``,
``/healthz``, ``/api/status`` and Alertmanager's webhook ``POST /api/v1/alertmanager``. Each
endpoint is one entry of the route table that :func:`monitor_routes` builds: ``(method, path)``
-> a function from :class:`Request` to :class:`Response`."""

from __future__ import annotations

import hmac
import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from lossguard.common.config import ConfigError
from lossguard.monitor.actions.intake import IncomingAlert, IntakeError, parse_webhook
from lossguard.monitor.actions.policy import ACTION_LABEL

log = logging.getLogger("lossguard.monitor.api")

Health = Callable[[], tuple[bool, dict[str, object]]]
Status = Callable[[], dict[str, object]]
OnAlerts = Callable[[list[IncomingAlert]], None]

ALERTMANAGER_PATH = "/api/v1/alertmanager"
MAX_BODY_BYTES = 1 << 20  # a webhook of a few hundred alerts; Alertmanager's max_alerts caps it
_DRAIN_LIMIT = 16 << 20  # read (and drop) a too large body up to this, so the client hears 413
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # without the query string
    headers: Mapping[str, str] = field(default_factory=dict)  # names in lower case
    body: bytes = b""


@dataclass(frozen=True)
class Response:
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def json(
        cls, payload: object, status: int = 200, headers: tuple[tuple[str, str], ...] = ()
    ) -> Response:
        return cls(status, "application/json", json.dumps(payload).encode() + b"\n", headers)

    @classmethod
    def text(cls, message: str, status: int, headers: tuple[tuple[str, str], ...] = ()) -> Response:
        return cls(status, "text/plain", f"{message}\n".encode(), headers)


Route = Callable[[Request], Response]
Routes = Mapping[tuple[str, str], Route]
NOT_FOUND = Response.text("not found: try /metrics or /healthz", 404)


def monitor_routes(
    registry: CollectorRegistry,
    health: Health,
    status: Status,
    *,
    on_alerts: OnAlerts | None = None,
    token: str | None = None,
) -> Routes:
    """The monitor's endpoints; ``status`` is what ``lossguard-monitor status`` shows of the
    running daemon. With ``on_alerts``, ``POST /api/v1/alertmanager`` takes Alertmanager's
    webhook (payload v4) and hands its alerts to it; with ``token``, only with
    ``Authorization: Bearer <token>``."""

    def metrics(request: Request) -> Response:
        return Response(200, CONTENT_TYPE_LATEST, generate_latest(registry))

    def healthz(request: Request) -> Response:
        healthy, detail = health()
        return Response.json({"healthy": healthy, **detail}, 200 if healthy else 503)

    def api_status(request: Request) -> Response:
        return Response.json(status())

    routes: dict[tuple[str, str], Route] = {
        ("GET", "/metrics"): metrics,
        ("GET", "/healthz"): healthz,
        ("GET", "/api/status"): api_status,
    }
    if on_alerts is not None:
        routes[("POST", ALERTMANAGER_PATH)] = alertmanager_route(on_alerts, token)
    return routes


def alertmanager_route(on_alerts: OnAlerts, token: str | None) -> Route:
    """``POST /api/v1/alertmanager``: 401/403 without the right bearer token (when one is
    set), 415 unless JSON, 400 naming what is wrong with the payload, else 200 with
    ``{"received": alerts, "actionable": firing alerts with an action label}``."""
    expected = None if token is None else token.encode()

    def alertmanager(request: Request) -> Response:
        if expected is not None:
            scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer" or not given.strip():
                return Response.text(
                    "unauthorized: send Authorization: Bearer <token>",
                    401,
                    (("WWW-Authenticate", 'Bearer realm="lossguard-monitor"'),),
                )
            if not hmac.compare_digest(given.strip().encode(), expected):
                log.warning("alertmanager webhook: a request with a wrong token was refused")
                return Response.text("forbidden: wrong token", 403)
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            return Response.text(
                f"unsupported media type {media_type or 'none'!r}: send application/json", 415
            )
        try:
            alerts = parse_webhook(request.body)
        except IntakeError as exc:
            log.warning("alertmanager webhook: refused a payload: %s", exc)
            return Response.text(f"bad payload: {exc}", 400)
        actionable = sum(1 for a in alerts if a.status == "firing" and ACTION_LABEL in a.labels)
        log.info(
            "alertmanager webhook: %d alerts (%d firing with an action label): %s",
            len(alerts),
            actionable,
            ", ".join(f"{a.labels.get('alertname', '?')} {a.status}" for a in alerts[:5])
            + (", ..." if len(alerts) > 5 else ""),
        )
        try:
            on_alerts(alerts)
        except Exception:  # Alertmanager retries a 5xx
            log.exception("alertmanager webhook: taking the alerts failed")
            return Response.text("internal error: the alerts were not taken", 500)
        return Response.json({"received": len(alerts), "actionable": actionable})

    return alertmanager


class MonitorServer:
    """The monitor's routes served on ``host:port`` (0: any free port) by a daemon thread."""

    def __init__(
        self,
        registry: CollectorRegistry,
        health: Health,
        status: Status,
        host: str,
        port: int,
        *,
        on_alerts: OnAlerts | None = None,
        token: str | None = None,
    ) -> None:
        handler = _handler(
            monitor_routes(registry, health, status, on_alerts=on_alerts, token=token)
        )
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


class _RouteHandler(BaseHTTPRequestHandler):
    routes: ClassVar[Routes] = {}
    timeout = 30  # seconds a client may take to send its request
    _unread = 0  # bytes of a refused body still to drain

    def dispatch(self) -> None:
        path = self.path.partition("?")[0]
        route = self.routes.get((self.command, path))
        if route is None:
            allowed = sorted(method for method, known in self.routes if known == path)
            if not allowed:
                self._reply(NOT_FOUND)
            else:
                self._reply(
                    Response.text(
                        f"method {self.command} not allowed on {path}: use {', '.join(allowed)}",
                        405,
                        (("Allow", ", ".join(allowed)),),
                    )
                )
            return
        body = b""
        if self.command in _BODY_METHODS:
            read = self._read_body()
            if isinstance(read, Response):
                self._reply(read)
                self._drain()
                return
            body = read
        headers = {name.lower(): value for name, value in self.headers.items()}
        self._reply(route(Request(self.command, path, headers, body)))

    def _read_body(self) -> bytes | Response:
        """The request body, or why not: 411 without a length, 413 beyond MAX_BODY_BYTES."""
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            self.close_connection = True
            return Response.text("length required: send Content-Length", 411)
        try:
            length = int(length_header)
            if length < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            return Response.text(f"bad Content-Length {length_header!r}", 400)
        if length > MAX_BODY_BYTES:
            self._unread = length
            return Response.text(
                f"payload too large: {length} bytes, at most {MAX_BODY_BYTES}", 413
            )
        body = self.rfile.read(length)
        if len(body) < length:
            self.close_connection = True
            return Response.text(f"body ended after {len(body)} of {length} bytes", 400)
        return body

    def _drain(self) -> None:
        """Read and drop a refused body (up to a limit), so that closing the connection does
        not reset it before the client has read the answer."""
        left, self._unread = min(self._unread, _DRAIN_LIMIT), 0
        self.close_connection = True
        try:
            while left > 0:
                chunk = self.rfile.read(min(left, 1 << 16))
                if not chunk:
                    break
                left -= len(chunk)
        except OSError:
            pass

    def _reply(self, response: Response) -> None:
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        for name, value in response.headers:
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: scrapes every second would flood the log."""


def _handler(routes: Routes) -> type[BaseHTTPRequestHandler]:
    """A handler class for ``routes``: a known path asked with another method gets 405 (with
    ``Allow``), an unknown path 404, a method http.server does not know 501."""

    class Handler(_RouteHandler):
        pass

    Handler.routes = routes
    for method in _METHODS:
        setattr(Handler, f"do_{method}", Handler.dispatch)
    return Handler
