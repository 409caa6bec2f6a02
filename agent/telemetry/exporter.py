"""The agent's ``/metrics`` endpoint: an HTTP server for one registry, in a daemon thread."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from lossguard.common.config import ConfigError
from lossguard.common.serving import serve_in_background


class _QuietHandler(WSGIRequestHandler):
    """No log line per scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _serve(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    """prometheus_client's ``start_http_server`` with a short stop poll: its WSGI app on its
    threading server, for IPv4 or IPv6 as ``host`` resolves."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
    server: WSGIServer = make_server(
        host, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler
    )
    serve_in_background(server, "metrics")
    return server


@dataclass
class Exporter:
    """An HTTP server for ``/metrics`` in a daemon thread."""

    host: str
    port: int
    _server: WSGIServer

    @classmethod
    def start(cls, registry: CollectorRegistry, host: str, port: int) -> Exporter:
        try:
            server = _serve(registry, host, port)
        except socket.gaierror as exc:
            raise ConfigError(f"telemetry.host: cannot resolve {host!r} ({exc.strerror})") from None
        except OSError as exc:
            raise ConfigError(
                f"telemetry.port: cannot serve metrics on {host}:{port} ({exc.strerror}); "
                "another agent may hold it: set telemetry.port=0 for any free port"
            ) from None
        return cls(host, int(server.server_address[1]), server)

    def url(self, public_host: str) -> str:
        return f"http://{public_host}:{self.port}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
