"""The monitor's HTTP server (standard library ``http.server``, one daemon thread): ``/metrics``,
``/healthz`` and ``/api/status``. Each endpoint is one entry of the route table that
:func:`monitor_routes` builds: ``(method, path)`` -> a function from :class:`Request` to
:class:`Response`."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from lossguard.common.config import ConfigError

Health = Callable[[], tuple[bool, dict[str, object]]]
Status = Callable[[], dict[str, object]]


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # without the query string


@dataclass(frozen=True)
class Response:
    status: int
    content_type: str
    body: bytes

    @classmethod
    def json(cls, payload: object, status: int = 200) -> Response:
        return cls(status, "application/json", json.dumps(payload).encode() + b"\n")

    @classmethod
    def text(cls, message: str, status: int) -> Response:
        return cls(status, "text/plain", f"{message}\n".encode())


Route = Callable[[Request], Response]
Routes = Mapping[tuple[str, str], Route]
NOT_FOUND = Response.text("not found: try /metrics or /healthz", 404)


def monitor_routes(registry: CollectorRegistry, health: Health, status: Status) -> Routes:
    """The monitor's endpoints; ``status`` is what ``lossguard-monitor status`` shows of the
    running daemon."""

    def metrics(request: Request) -> Response:
        return Response(200, CONTENT_TYPE_LATEST, generate_latest(registry))

    def healthz(request: Request) -> Response:
        healthy, detail = health()
        return Response.json({"healthy": healthy, **detail}, 200 if healthy else 503)

    def api_status(request: Request) -> Response:
        return Response.json(status())

    return {
        ("GET", "/metrics"): metrics,
        ("GET", "/healthz"): healthz,
        ("GET", "/api/status"): api_status,
    }


class MonitorServer:
    """The monitor's routes served on ``host:port`` (0: any free port) by a daemon thread."""

    def __init__(
        self, registry: CollectorRegistry, health: Health, status: Status, host: str, port: int
    ) -> None:
        handler = _handler(monitor_routes(registry, health, status))
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

    def dispatch(self) -> None:
        path = self.path.partition("?")[0]
        route = self.routes.get((self.command, path))
        self._reply(NOT_FOUND if route is None else route(Request(self.command, path)))

    def _reply(self, response: Response) -> None:
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        self.wfile.write(response.body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: scrapes every second would flood the log."""


def _handler(routes: Routes) -> type[BaseHTTPRequestHandler]:
    """A handler class for ``routes``: a method no route uses gets http.server's 501."""

    class Handler(_RouteHandler):
        pass

    Handler.routes = routes
    for method in {method for method, _ in routes}:
        setattr(Handler, f"do_{method}", Handler.dispatch)
    return Handler
