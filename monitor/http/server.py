"""The monitor's HTTP server (standard library ``http.server``, one daemon thread): ``/metrics``,
``/healthz``, ``/api/status``, Alertmanager's webhook ``POST /api/v1/alertmanager`` and the
read API of :mod:`lossguard.monitor.http.read_api`. Each endpoint is one entry of a table:
``(method, path)`` -> a function from :class:`Request` to :class:`Response`; a path may hold
``{name}`` segments, handed to the route as ``Request.params``.

Under ``/api/`` errors are JSON, shaped as Prometheus's HTTP API shapes them:
``{"status": "error", "errorType": ..., "error": "one line"}``; answers are
``{"status": "success", "data": ...}`` (:func:`api_data`)."""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
from urllib.parse import parse_qs, unquote

from prometheus_client import CollectorRegistry

from lossguard.common.config import ConfigError
from lossguard.common.serving import serve_in_background
from lossguard.monitor.http.messages import Request, Response, Route, Routes, error_for
from lossguard.monitor.http.ops import DEFAULT_TOKEN_ENV, Health, OnAlerts, Status, monitor_routes

log = logging.getLogger("lossguard.monitor.http")


MAX_CONNECTIONS = 64  # open at once; Prometheus, Alertmanager and a few scripts need a handful
REQUEST_DEADLINE_S = 10.0  # for the request line, the headers and the body together
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
MAX_BODY_BYTES = 1 << 20  # a webhook of a few hundred alerts; Alertmanager's max_alerts caps it
_DRAIN_LIMIT = 16 << 20  # read (and drop) a too large body up to this, so the client hears 413
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


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
        self._thread = serve_in_background(self._server, "monitor-http")

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
