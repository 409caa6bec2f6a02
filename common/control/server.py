"""Control server: reads protocol lines on a Unix socket (and optionally TCP), validates them and
queues commands for the training loop, which applies them at a step boundary and answers.

The server threads never touch training state: they parse, check, queue and wait for the reply.
Bad input gets an error reply or a closed connection, never an exception in the training loop.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import os
import socket
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from lossguard.common.control.address import join_address
from lossguard.common.control.gate import PeerGate
from lossguard.common.control.protocol import (
    COMMAND_ARGS,
    MAX_LINE_BYTES,
    MIN_TOKEN_LENGTH,
    CommandArgs,
    ErrorCode,
    ProtocolError,
    Request,
    encode,
    error_reply,
    ok_reply,
    parse_request,
)
from lossguard.common.jsondepth import load_bounded
from lossguard.common.rundir.events import COMMAND

log = logging.getLogger("lossguard.common.control")

MAX_CONNECTIONS = 32  # authenticated TCP peers and Unix socket clients
REMEMBERED_IDS = 4096
AUTH_DEADLINE_S = 5.0  # a TCP peer's first line, with the token, must arrive within this
IDLE_TIMEOUT_S = 60.0
SEND_TIMEOUT_S = 10.0
UNIX_PATH_MAX = 107
UNAUTHORIZED_MESSAGE = "a valid token is required over TCP"


class PendingCommand:
    """A validated request waiting for the training loop; its reply is set once applied."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self._done = threading.Event()
        self._reply: dict[str, Any] | None = None

    @classmethod
    def answered(cls, request: Request, reply: dict[str, Any]) -> PendingCommand:
        """A command applied earlier (by a previous process of this run): its reply is known."""
        pending = cls(request)
        pending.resolve(reply)
        return pending

    def resolve(self, reply: dict[str, Any]) -> None:
        if not self._done.is_set():
            self._reply = reply
            self._done.set()

    def wait(self, stopping: threading.Event) -> dict[str, Any]:
        while not self._done.wait(0.2):
            if stopping.is_set():
                self.cancel()
        assert self._reply is not None
        return self._reply

    def cancel(self) -> None:
        """Answer that training ended before the command could be applied."""
        message = "training ended before the command was applied"
        self.resolve(error_reply(self.request.id, ErrorCode.SHUTTING_DOWN, message))

    @property
    def done(self) -> bool:
        return self._done.is_set()


class ListenError(OSError):
    """The control server cannot listen; ``endpoint`` is "socket" or "tcp"."""

    def __init__(self, endpoint: str, message: str) -> None:
        super().__init__(message)
        self.endpoint = endpoint


RejectHook = Callable[[str | None, ErrorCode, str], None]
RefusedHook = Callable[[str], None]
"""Told of each connection or request refused before authentication, with the reason
(``CONTROL_REFUSALS``): counted, never an audit line each."""


class ControlServer:
    """Serves protocol v1; ``take()`` hands queued commands to the training loop."""

    def __init__(
        self,
        *,
        socket_path: Path | None,
        tcp: tuple[str, int] | None = None,
        token: str | None = None,
        on_reject: RejectHook | None = None,
        on_refused: RefusedHook | None = None,
        answered: Iterable[PendingCommand] = (),
        commands: Mapping[str, type[CommandArgs]] = COMMAND_ARGS,
    ) -> None:
        """``answered``: commands applied before this server started, whose ids are answered
        from their results and never applied again; ``commands``: what this server accepts
        (the agent's commands by default; the supervisor serves its own). Over TCP a peer's
        first line must carry the token within AUTH_DEADLINE_S (:class:`PeerGate` limits the
        peers still to show it and spaces out their attempts after failures)."""
        if tcp is not None and (not token or len(token) < MIN_TOKEN_LENGTH):
            raise ValueError(
                f"a TCP control listener needs a token of at least {MIN_TOKEN_LENGTH} characters"
            )
        self.socket_path = socket_path
        self._token = token
        self._commands = commands
        self._on_reject = on_reject
        self._on_refused = on_refused
        self._gate = PeerGate()
        self._listeners: list[tuple[socket.socket, bool]] = []  # (socket, needs_token)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._queued: list[PendingCommand] = []
        self._queued_signal = threading.Condition(self._lock)
        self._by_id: OrderedDict[str, PendingCommand] = OrderedDict(
            (pending.request.id, pending) for pending in answered
        )
        self._forget_oldest()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        if socket_path is not None:
            self._listeners.append((_bind_unix(socket_path), False))
        if tcp is not None:
            try:
                family = socket.AF_INET6 if ":" in tcp[0] else socket.AF_INET
                self._listeners.append((socket.create_server(tcp, family=family), True))
            except OSError as exc:
                self.close()
                message = f"cannot listen on {join_address(*tcp)} ({exc.strerror})"
                raise ListenError("tcp", message) from None

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        for sock, needs_token in self._listeners:
            if needs_token:
                host, port = sock.getsockname()[:2]
                return str(host), int(port)
        return None

    def start(self) -> None:
        for sock, needs_token in self._listeners:
            accept = threading.Thread(target=self._accept_loop, args=(sock, needs_token))
            accept.daemon = True
            accept.start()

    def take(self, timeout: float = 0.0) -> list[PendingCommand]:
        """Queued commands in arrival order; waits up to ``timeout`` seconds for the first."""
        with self._queued_signal:
            if not self._queued and timeout > 0:
                self._queued_signal.wait(timeout)
            taken, self._queued = self._queued, []
        return taken

    def waiting(self, cmd: str) -> bool:
        """Whether a ``cmd`` command is queued, not yet taken by the training loop."""
        with self._lock:
            return any(pending.request.cmd == cmd for pending in self._queued)

    def close(self) -> None:
        """Stop listening; anything still queued is answered ``shutting_down``."""
        self._stopping.set()
        for sock, _ in self._listeners:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            sock.close()
        for pending in self.take():
            pending.cancel()
        if self.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()

    def _accept_loop(self, listener: socket.socket, needs_token: bool) -> None:
        while not self._stopping.is_set():
            try:
                conn, address = listener.accept()
            except OSError:
                return  # closed
            if needs_token:
                peer = str(address[0])
                if not self._gate.enter(conn, functools.partial(_cut_off, conn)):
                    self._refuse(conn, "busy", "too many connections waiting to authenticate")
                    continue
                target: Callable[..., None] = self._authenticate
                args: tuple[Any, ...] = (conn, peer)
            elif not self._slots.acquire(blocking=False):
                self._refuse(conn, "busy", "too many connections")
                continue
            else:
                target, args = self._serve_connection, (conn, False)
            threading.Thread(target=target, args=args, daemon=True).start()

    def _authenticate(self, conn: socket.socket, peer: str) -> None:
        """A TCP peer's first line: served on (in an authenticated slot) when it carries the
        token, else refused and closed; judged at the peer's next turn (``PeerGate.turn``)."""
        try:
            first, rest = _first_line(conn, AUTH_DEADLINE_S)
            if first is None:
                self._refused("timeout")
                conn.close()
                return
            if not self._gate.shown(conn, peer):  # cut off meanwhile, or too many of its lines
                self._refuse(conn, "busy", "too many connections waiting to authenticate")
                return
            if self._stopping.wait(self._gate.turn(peer)):
                conn.close()
                return
            if not _token_matches(_token_of(first), self._token):
                self._gate.failed(peer)
                self._refuse(conn, "unauthorized", UNAUTHORIZED_MESSAGE)
                return
            self._gate.succeeded(peer)
        except OSError:
            conn.close()
            return
        finally:
            self._gate.leave(conn)
        if not self._slots.acquire(blocking=False):
            self._refuse(conn, "busy", "too many connections")
            return
        self._serve_connection(conn, True, first + b"\n" + rest)

    def _refuse(self, conn: socket.socket, reason: str, message: str) -> None:
        """Answer and close a connection refused before it was served."""
        self._refused(reason)
        code = ErrorCode.BUSY if reason == "busy" else ErrorCode.UNAUTHORIZED
        _send_quietly(conn, error_reply(None, code, message))
        conn.close()

    def _refused(self, reason: str) -> None:
        if self._on_refused is not None:
            self._on_refused(reason)

    def _serve_connection(self, conn: socket.socket, needs_token: bool, read: bytes = b"") -> None:
        """Serve request lines (``read``: received already) until the peer closes."""
        try:
            conn.settimeout(IDLE_TIMEOUT_S)
            for line in _read_lines(conn, read):
                if line is None:
                    reply = error_reply(
                        None, ErrorCode.TOO_LARGE, f"request exceeds {MAX_LINE_BYTES} bytes"
                    )
                    _send_quietly(conn, reply)
                    return
                if not line.strip():
                    continue
                reply = self._handle_line(line, needs_token)
                conn.settimeout(SEND_TIMEOUT_S)
                conn.sendall(encode(reply))
                conn.settimeout(IDLE_TIMEOUT_S)
        except OSError:
            pass  # slow, vanished or reset peer: drop the connection
        except Exception:  # a bug must cost one connection, never the server
            log.exception("control connection failed")
        finally:
            conn.close()
            self._slots.release()

    def _handle_line(self, line: bytes, needs_token: bool) -> dict[str, Any]:
        try:
            request = parse_request(line, self._commands)
            if needs_token and not _token_matches(request.token, self._token):
                self._refused("unauthorized")
                return error_reply(request.id, ErrorCode.UNAUTHORIZED, UNAUTHORIZED_MESSAGE)
            pending = self._enqueue(request)
        except ProtocolError as exc:
            if self._on_reject is not None:
                self._on_reject(exc.request_id, exc.code, exc.message)
            return error_reply(exc.request_id, exc.code, exc.message)
        return pending.wait(self._stopping)

    def _enqueue(self, request: Request) -> PendingCommand:
        with self._queued_signal:
            known = self._by_id.get(request.id)
            if known is not None:
                return known  # a repeated id is answered from the first result
            if self._stopping.is_set():
                raise ProtocolError(
                    ErrorCode.SHUTTING_DOWN, "training is shutting down", request.id
                )
            pending = PendingCommand(request)
            self._by_id[request.id] = pending
            self._forget_oldest()
            self._queued.append(pending)
            self._queued_signal.notify_all()
            return pending

    def _forget_oldest(self) -> None:
        while len(self._by_id) > REMEMBERED_IDS:
            self._by_id.popitem(last=False)


def _token_matches(given: str | None, expected: str | None) -> bool:
    if given is None or expected is None:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def _token_of(line: bytes) -> str | None:
    """The ``token`` of a request line, whatever else is wrong with it (None: it has none)."""
    try:
        message = load_bounded(line)
    except (ValueError, UnicodeDecodeError):
        return None
    token = message.get("token") if isinstance(message, dict) else None
    return token if isinstance(token, str) else None


def _first_line(conn: socket.socket, within_s: float) -> tuple[bytes | None, bytes]:
    """The first request line and what came after it, read within ``within_s`` seconds
    (however slowly the peer sends); None: no whole line in time, or one over the limit. A
    line the peer ended by half-closing counts."""
    deadline = time.monotonic() + within_s
    buffer = b""
    while b"\n" not in buffer:
        left = deadline - time.monotonic()
        if left <= 0 or len(buffer) > MAX_LINE_BYTES:
            return None, b""
        conn.settimeout(left)
        try:
            chunk = conn.recv(MAX_LINE_BYTES)
        except TimeoutError:
            return None, b""
        if not chunk:
            return (buffer or None) if len(buffer) <= MAX_LINE_BYTES else None, b""
        buffer += chunk
    line, rest = buffer.split(b"\n", 1)
    return (line if len(line) <= MAX_LINE_BYTES else None), rest


def _read_lines(conn: socket.socket, buffer: bytes = b"") -> Iterator[bytes | None]:
    """Yield request lines (``buffer``: received already); ``None`` for a line over the
    limit. A final line without a newline (the peer half-closed after writing) still counts."""
    while True:
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield line if len(line) <= MAX_LINE_BYTES else None
        chunk = conn.recv(MAX_LINE_BYTES)
        if not chunk:
            if buffer:
                yield buffer if len(buffer) <= MAX_LINE_BYTES else None
            return
        buffer += chunk
        if b"\n" not in buffer and len(buffer) > MAX_LINE_BYTES:
            yield None
            return


def _cut_off(conn: socket.socket) -> None:
    """End a connection from another thread (its reader sees the end and closes it)."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


def _send_quietly(conn: socket.socket, reply: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        conn.settimeout(SEND_TIMEOUT_S)
        conn.sendall(encode(reply))


def _bind_unix(path: Path) -> socket.socket:
    """Bind an owner-only (0600) Unix socket, replacing a stale one from a dead agent."""
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise ListenError(
            "socket",
            f"path {path} is longer than {UNIX_PATH_MAX} bytes; "
            "use a shorter run.dir or set control.socket: false",
        )
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ListenError("socket", f"{path} exists and is not a socket")
        if socket_is_live(path):
            raise ListenError("socket", f"another agent is serving {path}")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise ListenError("socket", f"cannot bind {path} ({exc.strerror})") from None
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(MAX_CONNECTIONS)
    return sock


def socket_is_live(path: Path) -> bool:
    """Whether an agent is serving the control socket at ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def answered_before(events: Iterable[Mapping[str, Any]]) -> list[PendingCommand]:
    """The commands that earlier processes of this run applied, from their ``command`` audit
    events (written by ``CommandRunner.apply``), with the replies they got: a client that
    repeats one of their ids after a restart gets that reply, and nothing is applied twice."""
    answered = []
    for event in events:
        if event.get("event") != COMMAND or "cmd" not in event:
            continue  # requests refused before they were queued are not remembered
        request = Request(str(event["id"]), event["cmd"], event.get("args") or {})
        if event["ok"]:
            reply = ok_reply(request.id, event["result"])
        else:
            reply = {"id": request.id, "ok": False, "error": event["error"]}  # as it was sent
        answered.append(PendingCommand.answered(request, reply))
    return answered[-REMEMBERED_IDS:]
