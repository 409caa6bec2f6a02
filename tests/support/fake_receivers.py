"""Fake Slack and PagerDuty services: real HTTP servers on 127.0.0.1 that validate requests as
the real services do, record what they accepted, and fail on demand.

Faults, set at any time from any thread: ``script([...])`` queues the next replies, and
``fail_ratio(ratio, seed, faults)`` fails a seeded random share of the requests the script does
not answer. A fault is one of

- ``500`` (any status): that status with the service's error body for it;
- ``(429, 2)``: that status with ``Retry-After: 2``; ``(200, "not ok")``: that status and body;
- ``"drop"``: the request is read, then the connection closed without a reply;
- ``("slow", 3.0)``: the request is handled normally (accepted if valid: the real service
  posts a message even when the client gave up waiting) and answered 3 s later.

A request answered by any other fault is not accepted. Every request is recorded as an
``Exchange``: arrival time, reply status (noted before the reply is written, so a client that
has its reply finds it) and the time the reply was written (None for a drop, when writing
failed, or for a moment after the client has it).
Times are ``time.time()``."""

from __future__ import annotations

import contextlib
import json
import random
import re
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal, TypeVar

FaultSpec = int | str | tuple[Any, ...]
S = TypeVar("S", bound="FakeService")


@dataclass(frozen=True)
class Fault:
    kind: Literal["reply", "drop", "slow"]
    status: int = 0
    retry_after: int | None = None
    body: str | None = None
    delay_s: float = 0.0


def parse_fault(spec: FaultSpec) -> Fault:
    """A fault from its short form (see the module docstring); ValueError for anything else."""
    if spec == "drop":
        return Fault("drop")
    if isinstance(spec, int) and not isinstance(spec, bool):
        return Fault("reply", status=spec)
    if isinstance(spec, tuple) and len(spec) == 2:
        first, second = spec
        if first == "slow" and isinstance(second, int | float):
            return Fault("slow", delay_s=float(second))
        if isinstance(first, int) and isinstance(second, int) and not isinstance(second, bool):
            return Fault("reply", status=first, retry_after=second)
        if isinstance(first, int) and isinstance(second, str):
            return Fault("reply", status=first, body=second)
    raise ValueError(
        f"unknown fault {spec!r}: use a status, (status, retry_after_s), "
        '(status, body), "drop" or ("slow", seconds)'
    )


@dataclass
class Exchange:
    """One request and what it got."""

    method: str
    path: str
    body: bytes
    arrived_at: float
    fault: Fault | None
    status: int | None = None
    replied_at: float | None = None


@dataclass(frozen=True)
class Reply:
    status: int
    body: str
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


class FakeService:
    """A threaded HTTP/1.1 server (keep-alive, as the real services) on a free port; a
    subclass answers valid requests (``answer``) and names the body of an injected error
    (``error_reply``). ``close()`` also cuts open connections, so a closed fake refuses."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._script: deque[Fault] = deque()
        self._chaos: tuple[float, random.Random, list[Fault]] | None = None
        self._exchanges: list[Exchange] = []
        self._connections: set[socket.socket] = set()
        self._closing = threading.Event()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.fake = self
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def script(self, faults: Iterable[FaultSpec]) -> None:
        """Queue replies for the next requests, in order (after any still queued)."""
        parsed = [parse_fault(f) for f in faults]
        with self._lock:
            self._script.extend(parsed)

    def fail_ratio(self, ratio: float, seed: int, faults: Sequence[FaultSpec]) -> None:
        """From now on fail ``ratio`` of the unscripted requests with one of ``faults``, drawn
        from a generator seeded with ``seed``; ``ratio`` 0 stops it."""
        parsed = [parse_fault(f) for f in faults]
        if not 0 <= ratio <= 1 or (ratio and not parsed):
            raise ValueError(f"fail_ratio needs 0 <= ratio <= 1 and faults, got {ratio}")
        with self._lock:
            self._chaos = (ratio, random.Random(seed), parsed) if ratio else None

    def pending_script(self) -> int:
        with self._lock:
            return len(self._script)

    @property
    def exchanges(self) -> list[Exchange]:
        """Every request so far, in arrival order (copies)."""
        with self._lock:
            return [replace(e) for e in self._exchanges]

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()  # wakes slow replies, which then drop
        self._server.shutdown()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        self._server.server_close()
        self._thread.join()

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Subclasses answer these.
    def answer(self, path: str, body: bytes, arrived_at: float) -> Reply:
        raise NotImplementedError

    def error_reply(self, status: int) -> Reply:
        raise NotImplementedError

    # The handler's side.
    def _arrive(self, method: str, path: str, body: bytes) -> Exchange:
        with self._lock:
            fault = self._script.popleft() if self._script else None
            if fault is None and self._chaos is not None:
                ratio, rng, faults = self._chaos
                if rng.random() < ratio:
                    fault = rng.choice(faults)
            exchange = Exchange(method, path, body, time.time(), fault)
            self._exchanges.append(exchange)
        return exchange

    def _reply_for(self, exchange: Exchange) -> Reply | None:
        """The reply to write, or None to drop the connection."""
        fault = exchange.fault
        if fault is None or fault.kind == "slow":
            reply = self.answer(exchange.path, exchange.body, exchange.arrived_at)
            if fault is not None and self._closing.wait(fault.delay_s):
                return None
            return reply
        if fault.kind == "drop":
            return None
        reply = self.error_reply(fault.status)
        if fault.body is not None:
            reply = Reply(fault.status, fault.body, "text/plain")
        if fault.retry_after is not None:
            reply = replace(reply, headers={**reply.headers, "Retry-After": str(fault.retry_after)})
        return reply

    def _replying(self, exchange: Exchange, status: int) -> None:
        """Noted before the reply is written: a client that has its reply finds it recorded."""
        with self._lock:
            exchange.status = status

    def _replied(self, exchange: Exchange) -> None:
        with self._lock:
            exchange.replied_at = time.time()

    def _track(self, connection: socket.socket, open_: bool) -> None:
        with self._lock:
            if open_:
                self._connections.add(connection)
            else:
                self._connections.discard(connection)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fake: FakeService

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Connections cut by a client or by ``close()`` are normal here."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    wbufsize = -1  # buffered: a reply leaves in one segment (no delayed-ACK stall)
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.fake._track(self.connection, True)

    def finish(self) -> None:
        self.server.fake._track(self.connection, False)
        super().finish()

    def do_POST(self) -> None:
        fake = self.server.fake
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        exchange = fake._arrive(self.command, self.path, body)
        reply = fake._reply_for(exchange)
        if reply is None:
            self.close_connection = True
            return
        data = reply.body.encode()
        fake._replying(exchange, reply.status)
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(data)))
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except OSError:  # the client had gone
            self.close_connection = True
            return
        fake._replied(exchange)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests read ``exchanges`` instead."""


# Slack ------------------------------------------------------------------------------------

SLACK_ERRORS = {
    400: "invalid_payload",
    403: "action_prohibited",
    404: "channel_not_found",
    410: "channel_is_archived",
    429: "rate_limited",
    500: "rollup_error",
}
NOTIFICATION_ID = re.compile(r"lossguard notification #(\d+)")
BLOCK_TYPES = frozenset({"header", "section", "context", "divider", "actions", "image"})


@dataclass(frozen=True)
class SlackMessage:
    received_at: float  # equal to its Exchange's arrived_at
    body: dict[str, Any]
    notification_id: int | None  # from "lossguard notification #N" in the context line


class FakeSlack(FakeService):
    """An incoming webhook at ``webhook_url`` (``/services/T000/B000/<token>``): 200 ``ok`` for
    a valid message; 400 ``invalid_payload`` (not a JSON object), ``no_text`` (neither text
    nor blocks) or ``invalid_blocks`` (a Block Kit limit broken); 403 ``invalid_token`` for
    another token; 404 ``no_service`` for any other path."""

    PREFIX = "/services/T000/B000/"

    def __init__(self, token: str | None = None) -> None:
        self.token = token or secrets.token_hex(12)
        self._messages: list[SlackMessage] = []
        super().__init__()

    @property
    def webhook_url(self) -> str:
        return f"{self.base_url}{self.PREFIX}{self.token}"

    @property
    def messages(self) -> list[SlackMessage]:
        """Accepted messages in arrival order."""
        with self._lock:
            return list(self._messages)

    def accepted_ids(self) -> list[int | None]:
        """The notification id of each accepted message, in arrival order."""
        return [m.notification_id for m in self.messages]

    def answer(self, path: str, body: bytes, arrived_at: float) -> Reply:
        if not path.startswith(self.PREFIX):
            return _slack_error(404, "no_service")
        if path != self.PREFIX + self.token:
            return _slack_error(403, "invalid_token")
        try:
            message = json.loads(body)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            return _slack_error(400, "invalid_payload")
        problem = slack_problem(message)
        if problem:
            return _slack_error(400, problem)
        with self._lock:
            self._messages.append(SlackMessage(arrived_at, message, _notification_id(message)))
        return Reply(200, "ok", "text/html")

    def error_reply(self, status: int) -> Reply:
        return _slack_error(status, SLACK_ERRORS.get(status, "error"))


def slack_problem(message: dict[str, Any]) -> str | None:
    """Slack's error code for a message it would refuse, or None: text or blocks needed; at
    most 50 blocks; header plain_text up to 150 characters; section text up to 3000, at most
    10 fields of up to 2000; context 1 to 10 elements."""
    blocks = message.get("blocks")
    if not message.get("text") and not blocks:
        return "no_text"
    if blocks is None:
        return None
    if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
        return "invalid_blocks_format"
    if len(blocks) > 50 or not all(_block_ok(b) for b in blocks):
        return "invalid_blocks"
    return None


def _block_ok(block: dict[str, Any]) -> bool:
    kind = block.get("type")
    if kind == "header":
        text = block.get("text") or {}
        return text.get("type") == "plain_text" and 0 < len(text.get("text", "")) <= 150
    if kind == "section":
        text, fields = block.get("text"), block.get("fields")
        if text is None and not fields:
            return False
        text_ok = text is None or 0 < len(text.get("text", "")) <= 3000
        fields_ok = fields is None or (
            len(fields) <= 10 and all(0 < len(f.get("text", "")) <= 2000 for f in fields)
        )
        return text_ok and fields_ok
    if kind == "context":
        elements = block.get("elements") or []
        return 0 < len(elements) <= 10 and all(len(e.get("text", "")) <= 3000 for e in elements)
    return kind in BLOCK_TYPES


def _notification_id(message: dict[str, Any]) -> int | None:
    for block in message.get("blocks") or []:
        for element in block.get("elements") or [] if block.get("type") == "context" else []:
            found = NOTIFICATION_ID.search(element.get("text", ""))
            if found:
                return int(found[1])
    return None


def _slack_error(status: int, code: str) -> Reply:
    return Reply(status, code, "text/html")


# PagerDuty --------------------------------------------------------------------------------

PD_ACTIONS = ("trigger", "acknowledge", "resolve")
PD_SEVERITIES = ("critical", "error", "warning", "info")
PD_ERRORS = {
    429: ("throttle event", "Requests for this service are arriving too quickly."),
    500: ("error", "Internal server error"),
}


@dataclass(frozen=True)
class PagerDutyEvent:
    received_at: float  # equal to its Exchange's arrived_at
    body: dict[str, Any]


@dataclass
class Incident:
    """What PagerDuty makes of the events for one dedup_key of one service."""

    routing_key: str
    dedup_key: str
    summary: str  # the first trigger's: a trigger folded in is logged, it changes nothing
    severity: str
    opened_at: float
    triggers: int = 1  # trigger events folded into it, the first included
    acknowledged_at: float | None = None
    resolved_at: float | None = None
    log: list[str] = field(default_factory=list)  # each trigger's summary, in order

    @property
    def open(self) -> bool:
        return self.resolved_at is None


class FakePagerDuty(FakeService):
    """Events API v2 at ``enqueue_url``: 202 ``{"status": "success", "message": "Event
    processed", "dedup_key": ...}`` for a valid event, 400 ``{"status": "invalid event",
    "message": "Event object is invalid", "errors": [...]}`` otherwise. A trigger opens an
    incident for its dedup_key unless one is open (then it is folded in); acknowledge marks
    it; resolve closes it. Any 32-character routing key is a service."""

    def __init__(self) -> None:
        self.routing_key = secrets.token_hex(16)
        self._events: list[PagerDutyEvent] = []
        self._incidents: list[Incident] = []
        super().__init__()

    @property
    def enqueue_url(self) -> str:
        return f"{self.base_url}/v2/enqueue"

    @property
    def events(self) -> list[PagerDutyEvent]:
        """Accepted events in arrival order."""
        with self._lock:
            return list(self._events)

    @property
    def incidents(self) -> list[Incident]:
        """Every incident, in the order they were opened (copies)."""
        with self._lock:
            return [Incident(**{**vars(i), "log": list(i.log)}) for i in self._incidents]

    def open_incidents(self) -> list[Incident]:
        return [i for i in self.incidents if i.open]

    def answer(self, path: str, body: bytes, arrived_at: float) -> Reply:
        if path != "/v2/enqueue":
            return Reply(404, json.dumps({"status": "Not Found", "message": "Not Found"}))
        try:
            event = json.loads(body)
        except ValueError:
            event = None
        if not isinstance(event, dict):
            return _pd_reply(
                400,
                "Unrecognized object",
                "Event object format is unrecognized",
                ["JSON parse error"],
            )
        errors = pagerduty_problems(event)
        if errors:
            return _pd_reply(400, "invalid event", "Event object is invalid", errors)
        with self._lock:
            event.setdefault("dedup_key", secrets.token_hex(16))
            self._events.append(PagerDutyEvent(arrived_at, event))
            self._apply(event, arrived_at)
        reply = {"status": "success", "message": "Event processed", "dedup_key": event["dedup_key"]}
        return Reply(202, json.dumps(reply))

    def error_reply(self, status: int) -> Reply:
        if status == 400:
            return _pd_reply(400, "invalid event", "Event object is invalid", ["injected fault"])
        name, message = PD_ERRORS.get(status, ("error", f"HTTP {status}"))
        return _pd_reply(status, name, message)

    def _apply(self, event: dict[str, Any], at: float) -> None:
        key = (event["routing_key"], event["dedup_key"])
        current = next(
            (i for i in self._incidents if (i.routing_key, i.dedup_key) == key and i.open), None
        )
        action = event["event_action"]
        if action == "trigger" and current is not None:
            current.triggers += 1
            current.log.append(event["payload"]["summary"])
        elif action == "trigger":
            payload = event["payload"]
            self._incidents.append(
                Incident(
                    *key,
                    payload["summary"],
                    payload["severity"],
                    opened_at=at,
                    log=[payload["summary"]],
                )
            )
        elif current is not None and action == "acknowledge":
            current.acknowledged_at = at
        elif current is not None:
            current.resolved_at = at


def pagerduty_problems(event: dict[str, Any]) -> list[str]:
    """PagerDuty's error messages for an invalid event (empty when it is valid)."""
    errors = []
    key = event.get("routing_key")
    if not isinstance(key, str) or len(key) != 32:
        errors.append("Length of 'routing_key' is incorrect (should be 32 characters)")
    action = event.get("event_action")
    if action not in PD_ACTIONS:
        errors.append("'event_action' is invalid (must be one of: trigger, acknowledge, resolve)")
    dedup = event.get("dedup_key")
    if action in ("acknowledge", "resolve") and not dedup:
        errors.append("'dedup_key' is missing or blank")
    if dedup is not None and (not isinstance(dedup, str) or len(dedup) > 255):
        errors.append("'dedup_key' must be a string of at most 255 characters")
    if action == "trigger":
        errors += _payload_problems(event.get("payload"))
    return errors


def _payload_problems(payload: Any) -> list[str]:
    if not isinstance(payload, dict):
        return ["'payload' is missing or blank"]
    errors = [
        f"'payload.{name}' is missing or blank"
        for name in ("summary", "source", "severity")
        if not payload.get(name)
    ]
    if len(str(payload.get("summary", ""))) > 1024:
        errors.append("'payload.summary' is too long (at most 1024 characters)")
    if payload.get("severity") and payload["severity"] not in PD_SEVERITIES:
        errors.append(
            "'payload.severity' is invalid (must be one of: critical, error, warning, info)"
        )
    return errors


def _pd_reply(status: int, name: str, message: str, errors: list[str] | None = None) -> Reply:
    body: dict[str, Any] = {"status": name, "message": message}
    if errors is not None:
        body["errors"] = errors
    return Reply(status, json.dumps(body))
