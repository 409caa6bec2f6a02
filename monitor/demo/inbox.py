"""The demo's local inbox: an HTTP server on 127.0.0.1 that answers as Slack's incoming webhook
(``/slack``: 200 ``ok``) and PagerDuty's Events API v2 (``/v2/enqueue``: 202) do, and appends
every request body, as sent, to a JSON-lines file: exactly what the monitor would have sent to
the real services."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal

from lossguard.common.serving import serve_in_background

Service = Literal["slack", "pagerduty"]
SLACK_PATH = "/slack"
PAGERDUTY_PATH = "/v2/enqueue"


@dataclass(frozen=True)
class Message:
    """One request the inbox took: its body as JSON (or, if it is none, as text)."""

    received_at: float
    service: Service
    body: Any

    def to_json(self) -> dict[str, Any]:
        return {"received_at": self.received_at, "service": self.service, "body": self.body}


class Inbox:
    """Serves until :meth:`close`; ``url`` is its base (``http://127.0.0.1:PORT``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._messages: list[Message] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.inbox = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = serve_in_background(self._server, "demo-inbox")

    def messages(self) -> list[Message]:
        """Every message so far, in arrival order."""
        with self._lock:
            return list(self._messages)

    def take(self, service: Service, raw: bytes) -> Message:
        try:
            body: Any = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            body = raw.decode("utf-8", "replace")
        message = Message(time.time(), service, body)
        with self._lock:
            self._messages.append(message)
            with self.path.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(message.to_json()) + "\n")
        return message

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        inbox: Inbox = self.server.inbox  # type: ignore[attr-defined]
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.startswith(SLACK_PATH):
            inbox.take("slack", body)
            self._reply(200, "text/html", b"ok")
        elif self.path == PAGERDUTY_PATH:
            event = inbox.take("pagerduty", body).body
            dedup_key = event.get("dedup_key") if isinstance(event, dict) else None
            reply = {"status": "success", "message": "Event processed", "dedup_key": dedup_key}
            self._reply(202, "application/json", json.dumps(reply).encode())
        else:
            self._reply(404, "text/plain", b"no_service")

    def _reply(self, status: int, content_type: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the demo's view tells what arrived."""
