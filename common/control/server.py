"""Control server: reads protocol lines on a Unix socket (and optionally TCP), validates them and
queues commands for the training loop, which applies them at a step boundary and answers.

The server threads never touch training state: they parse, check, queue and wait for the reply.
Bad input gets an error reply or a closed connection, never an exception in the training loop.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from lossguard.common.control.protocol import (
    COMMAND_ARGS,
    MAX_LINE_BYTES,
    CommandArgs,
    ErrorCode,
    ProtocolError,
    Request,
    encode,
    error_reply,
    ok_reply,
    parse_request,
)
from lossguard.common.rundir.events import COMMAND

log = logging.getLogger("lossguard.agent.control")

MAX_CONNECTIONS = 32
REMEMBERED_IDS = 4096
IDLE_TIMEOUT_S = 60.0
SEND_TIMEOUT_S = 10.0
UNIX_PATH_MAX = 107


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


class ControlServer:
    """Serves protocol v1; ``take()`` hands queued commands to the training loop."""

    def __init__(
        self,
        *,
        socket_path: Path | None,
        tcp: tuple[str, int] | None = None,
        token: str | None = None,
        on_reject: RejectHook | None = None,
        answered: Iterable[PendingCommand] = (),
        commands: Mapping[str, type[CommandArgs]] = COMMAND_ARGS,
    ) -> None:
        """``answered``: commands applied before this server started, whose ids are answered
        from their results and never applied again; ``commands``: what this server accepts
        (the agent's commands by default; the supervisor serves its own)."""
        if tcp is not None and not token:
            raise ValueError("a TCP control listener needs a token")
        self.socket_path = socket_path
        self._token = token
        self._commands = commands
        self._on_reject = on_reject
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
                self._listeners.append((socket.create_server(tcp), True))
            except OSError as exc:
                self.close()
                message = f"cannot listen on {tcp[0]}:{tcp[1]} ({exc.strerror})"
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
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                _send_quietly(conn, error_reply(None, ErrorCode.BUSY, "too many connections"))
                conn.close()
                continue
            threading.Thread(
                target=self._serve_connection, args=(conn, needs_token), daemon=True
            ).start()

    def _serve_connection(self, conn: socket.socket, needs_token: bool) -> None:
        try:
            conn.settimeout(IDLE_TIMEOUT_S)
            for line in _read_lines(conn):
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
                raise ProtocolError(
                    ErrorCode.UNAUTHORIZED, "a valid token is required over TCP", request.id
                )
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


def _read_lines(conn: socket.socket) -> Iterator[bytes | None]:
    """Yield request lines; ``None`` for a line over the limit. A final line without a newline
    (the peer half-closed after writing) still counts."""
    buffer = b""
    while True:
        chunk = conn.recv(MAX_LINE_BYTES)
        if not chunk:
            if buffer:
                yield buffer if len(buffer) <= MAX_LINE_BYTES else None
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield line if len(line) <= MAX_LINE_BYTES else None
        if len(buffer) > MAX_LINE_BYTES:
            yield None
            return


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
