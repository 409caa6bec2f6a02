"""The agent's ``/metrics`` endpoint: an HTTP server for one registry, in a daemon thread."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from lossguard.common.config import ConfigError


@dataclass
class Exporter:
    """An HTTP server for ``/metrics`` in a daemon thread."""

    host: str
    port: int
    _server: Any

    @classmethod
    def start(cls, registry: CollectorRegistry, host: str, port: int) -> Exporter:
        try:
            server, _ = start_http_server(port, addr=host, registry=registry)
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
