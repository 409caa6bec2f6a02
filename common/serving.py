"""Serving a ``socketserver`` server (HTTP) from a daemon thread that stops promptly."""

from __future__ import annotations

import socketserver
import threading

STOP_POLL_S = 0.05
"""How often the serving thread looks for ``shutdown()``, which waits up to this long: the
standard library's default (0.5 s, which prometheus_client's ``start_http_server`` keeps) added
that much to every agent's and monitor's exit."""


def serve_in_background(server: socketserver.BaseServer, name: str) -> threading.Thread:
    """Serve ``server`` from a started daemon thread; ``server.shutdown()`` stops it within
    ``STOP_POLL_S``."""
    thread = threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": STOP_POLL_S},
        name=name,
        daemon=True,
    )
    thread.start()
    return thread
