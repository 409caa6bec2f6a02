"""The monitor's HTTP server (standard library ``http.server``, one daemon thread): ``/metrics``,
``/healthz``, ``/api/status``, Alertmanager's webhook ``POST /api/v1/alertmanager`` and the
read API of :mod:`lossguard.monitor.http_api`. Each endpoint is one entry of a route table:
``(method, path)`` -> a function from :class:`Request` to :class:`Response`; a path may hold
``{name}`` segments, handed to the route as ``Request.params``.

Under ``/api/`` errors are JSON, shaped as Prometheus's HTTP API shapes them:
``{"status": "error", "errorType": ..., "error": "one line"}``; answers are
``{"status": "success", "data": ...}`` (:func:`api_data`)."""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
import logging
import re
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
from urllib.parse import parse_qs, unquote

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from lossguard.common.config import ConfigError
from lossguard.common.printable import escaped
from lossguard.common.protocol import encode
from lossguard.monitor.actions.engine import Refusal
from lossguard.monitor.actions.intake import IncomingAlert, IntakeError, parse_webhook
from lossguard.monitor.actions.policy import ACTION_LABEL

log = logging.getLogger("lossguard.monitor.api")

Health = Callable[[], tuple[bool, dict[str, object]]]
Status = Callable[[], dict[str, object]]
OnAlerts = Callable[[list[IncomingAlert]], "list[Refusal]"]

ALERTMANAGER_PATH = "/api/v1/alertmanager"
DEFAULT_TOKEN_ENV = "LOSSGUARD_MONITOR_TOKEN"
MAX_CONNECTIONS = 64  # open at once; Prometheus, Alertmanager and a few scripts need a handful
REQUEST_DEADLINE_S = 10.0  # for the request line, the headers and the body together
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
MAX_BODY_BYTES = 1 << 20  # a webhook of a few hundred alerts; Alertmanager's max_alerts caps it
_DRAIN_LIMIT = 16 << 20  # read (and drop) a too large body up to this, so the client hears 413
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
API_PREFIX = "/api/"
ERROR_TYPES = {
    400: "bad_data",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    411: "bad_data",
    413: "bad_data",
    415: "bad_data",
    422: "execution",
    500: "internal",
    503: "unavailable",
}
"""The ``errorType`` of each status of an API error (Prometheus's names where it has one)."""


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # without the query string
    headers: Mapping[str, str] = field(default_factory=dict)  # names in lower case
    body: bytes = b""
    query: Mapping[str, list[str]] = field(default_factory=dict)  # decoded, blanks kept
    params: Mapping[str, str] = field(default_factory=dict)  # the path's {name} segments
    client: str = ""  # the peer's address


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


def api_data(data: object) -> Response:
    """A successful API answer; non-finite numbers become null (JSON has none)."""
    return Response(200, "application/json", encode({"status": "success", "data": data}))


def api_error(
    status: int,
    message: str,
    *,
    error_type: str | None = None,
    data: object = None,
    headers: tuple[tuple[str, str], ...] = (),
) -> Response:
    """An API error: ``errorType`` from the status unless given, ``error`` one line."""
    payload: dict[str, object] = {
        "status": "error",
        "errorType": error_type or ERROR_TYPES.get(status, "internal"),
        "error": message,
    }
    if data is not None:
        payload["data"] = data
    return Response(status, "application/json", encode(payload), headers)


def error_for(
    path: str, status: int, message: str, headers: tuple[tuple[str, str], ...] = ()
) -> Response:
    """An error in the form the path's clients read: JSON under ``/api/``, else text."""
    if path.startswith(API_PREFIX):
        return api_error(status, message, headers=headers)
    return Response.text(message, status, headers)


def bearer_refusal(
    headers: Mapping[str, str], expected: str
) -> tuple[int, str, tuple[tuple[str, str], ...]] | None:
    """Why a request without ``Authorization: Bearer <expected>`` is refused: ``(status,
    message, headers)``, 401 without a bearer token and 403 with a wrong one; None: it has it."""
    scheme, _, given = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        challenge = (("WWW-Authenticate", 'Bearer realm="lossguard-monitor"'),)
        return 401, "unauthorized: send Authorization: Bearer <token>", challenge
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        return 403, "forbidden: wrong token", ()
    return None


def token_refusal(
    headers: Mapping[str, str], token: str | None, token_env: str, what: str
) -> tuple[int, str, tuple[tuple[str, str], ...]] | None:
    """Why a request to ``what`` (an endpoint that can make the monitor act) is refused:
    403 while no token is set (saying how to set one), else as :func:`bearer_refusal`."""
    if token is None:
        return (
            403,
            f"forbidden: {what} is off; set ${token_env} (listen.token_env) to a secret token, "
            "restart the monitor and send Authorization: Bearer <token>",
            (),
        )
    return bearer_refusal(headers, token)


def monitor_routes(
    registry: CollectorRegistry,
    health: Health,
    status: Status,
    *,
    on_alerts: OnAlerts | None = None,
    token: str | None = None,
    token_env: str = DEFAULT_TOKEN_ENV,
    extra: Routes | None = None,
) -> Routes:
    """The monitor's endpoints, and ``extra``; ``status`` is what ``lossguard-monitor status``
    shows of the running daemon. With ``on_alerts``, ``POST /api/v1/alertmanager`` takes
    Alertmanager's webhook (payload v4) with ``Authorization: Bearer <token>`` and hands its
    alerts to it; without a ``token`` the webhook is off (``$token_env`` names where to set
    one)."""

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
        routes[("POST", ALERTMANAGER_PATH)] = alertmanager_route(on_alerts, token, token_env)
    routes.update(extra or {})
    return routes


def alertmanager_route(on_alerts: OnAlerts, token: str | None, token_env: str) -> Route:
    """``POST /api/v1/alertmanager``: 403 while no token is set, 401/403 without the right
    bearer token, 415 unless JSON, 400 naming what is wrong with the payload, else 200 with
    ``{"received": alerts, "actionable": firing alerts taken for an action, "refused":
    [{"alertname", "run_id", "reason"}, ...]}`` (a refused alert is answered 200 too:
    Alertmanager would only send it again)."""

    def alertmanager(request: Request) -> Response:
        refusal = token_refusal(request.headers, token, token_env, "the Alertmanager webhook")
        if refusal is not None:
            status, message, headers = refusal
            log.warning(
                "alertmanager webhook: refused a request from %s: %s", request.client, message
            )
            return Response.text(message, status, headers)
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
        log.info(
            "alertmanager webhook: %d alerts: %s",
            len(alerts),
            ", ".join(f"{escaped(a.labels.get('alertname', '?'))} {a.status}" for a in alerts[:5])
            + (", ..." if len(alerts) > 5 else ""),
        )
        try:
            refused = on_alerts(alerts)
        except Exception:  # Alertmanager retries a 5xx
            log.exception("alertmanager webhook: taking the alerts failed")
            return Response.text("internal error: the alerts were not taken", 500)
        asking = sum(1 for a in alerts if a.status == "firing" and ACTION_LABEL in a.labels)
        return Response.json(
            {
                "received": len(alerts),
                "actionable": asking - len(refused),
                "refused": [dataclasses.asdict(r) for r in refused],
            }
        )

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
        token_env: str = DEFAULT_TOKEN_ENV,
        extra: Routes | None = None,
    ) -> None:
        handler = _handler(
            monitor_routes(
                registry,
                health,
                status,
                on_alerts=on_alerts,
                token=token,
                token_env=token_env,
                extra=extra,
            )
        )
        try:
            self._server = _CappedServer((host, port), handler)
        except OSError as exc:
            raise ConfigError(
                f"listen.port: cannot serve on {host}:{port} ({exc.strerror}); "
                "is another monitor running? set listen.port=0 for any free port"
            ) from None
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


class _CappedServer(ThreadingHTTPServer):
    """A thread per connection, at most MAX_CONNECTIONS at once: one more is answered 503 and
    closed at once, so that clients holding connections open cannot pile up threads."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.sendall(_BUSY)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


@dataclass(frozen=True)
class _Pattern:
    """A route's path as a regular expression: ``{name}`` matches one non-empty segment."""

    method: str
    regex: re.Pattern[str]
    route: Route

    @classmethod
    def of(cls, method: str, template: str, route: Route) -> _Pattern:
        parts = re.split(r"\{(\w+)\}", template)  # literal, name, literal, ...
        regex = "".join(
            f"(?P<{part}>[^/]+)" if i % 2 else re.escape(part) for i, part in enumerate(parts)
        )
        return cls(method, re.compile(regex), route)


class _RouteHandler(BaseHTTPRequestHandler):
    patterns: ClassVar[tuple[_Pattern, ...]] = ()
    timeout = 30  # seconds a client may stay silent
    _unread = 0  # bytes of a refused body still to drain
    _deadline: threading.Timer | None = None

    def handle_one_request(self) -> None:
        """One request, whose request line, headers and body must all arrive within
        REQUEST_DEADLINE_S (a client dripping header lines is cut off); the route itself (a
        control command the agent applies) may take longer."""
        self._deadline = threading.Timer(REQUEST_DEADLINE_S, self._cut_off)
        self._deadline.daemon = True
        self._deadline.start()
        try:
            super().handle_one_request()
        finally:
            self._deadline.cancel()

    def _cut_off(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def dispatch(self) -> None:
        path, _, query = self.path.partition("?")
        found = [(p, m) for p in self.patterns if (m := p.regex.fullmatch(path))]
        chosen = next(((p, m) for p, m in found if p.method == self.command), None)
        if chosen is None:
            allowed = sorted({p.method for p, _ in found})
            if not allowed:
                self._reply(
                    error_for(path, 404, f"not found: {path}; try /metrics, /healthz, /api/v1/runs")
                )
            else:
                self._reply(
                    error_for(
                        path,
                        405,
                        f"method {self.command} not allowed on {path}: use {', '.join(allowed)}",
                        (("Allow", ", ".join(allowed)),),
                    )
                )
            return
        body = b""
        if self.command in _BODY_METHODS:
            read = self._read_body(path)
            if isinstance(read, Response):
                self._reply(read)
                self._drain()
                return
            body = read
        if self._deadline is not None:
            self._deadline.cancel()  # all of the request is here
        pattern, match = chosen
        request = Request(
            self.command,
            path,
            {name.lower(): value for name, value in self.headers.items()},
            body,
            parse_qs(query, keep_blank_values=True),
            {name: unquote(value) for name, value in match.groupdict().items()},
            str(self.client_address[0]),
        )
        self._reply(pattern.route(request))

    def _read_body(self, path: str) -> bytes | Response:
        """The request body, or why not: 411 without a length, 413 beyond MAX_BODY_BYTES."""
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            self.close_connection = True
            return error_for(path, 411, "length required: send Content-Length")
        try:
            length = int(length_header)
            if length < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            return error_for(path, 400, f"bad Content-Length {length_header!r}")
        if length > MAX_BODY_BYTES:
            self._unread = length
            return error_for(
                path, 413, f"payload too large: {length} bytes, at most {MAX_BODY_BYTES}"
            )
        body = self.rfile.read(length)
        if len(body) < length:
            self.close_connection = True
            return error_for(path, 400, f"body ended after {len(body)} of {length} bytes")
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

    Handler.patterns = tuple(_Pattern.of(m, path, route) for (m, path), route in routes.items())
    for method in _METHODS:
        setattr(Handler, f"do_{method}", Handler.dispatch)
    return Handler
