"""A client for the agent's control protocol v1 (torch-free), over the Unix socket or TCP.

The agent replies once a command has been applied at a step boundary, so ``timeout`` bounds the
wait for each reply (connecting, sending and reading it), not the client's lifetime.
"""

from __future__ import annotations

import json
import math
import socket
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

from lossguard.common.control.address import join_address
from lossguard.common.control.protocol import MAX_LINE_BYTES, ErrorCode, encode, make_request

MAX_REPLY_BYTES = 16 * MAX_LINE_BYTES
_RECV_BYTES = 64 * 1024


class ControlError(Exception):
    """The agent answered ``ok: false``, or sent a reply that cannot be read (``bad_reply``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ControlUnavailable(Exception):
    """The agent cannot be reached, or closed the connection before replying."""


class ControlTimeout(Exception):
    """No complete reply came within the timeout; the command may still be applied."""


def _bad_reply(message: str) -> ControlError:
    return ControlError("bad_reply", message)


def _check_reply(line: bytes, request_id: str) -> dict[str, Any]:
    """The decoded reply to ``request_id``, or an error the agent could not tie to a request
    (``id: null``, e.g. busy); any other reply is a ``bad_reply``."""
    try:
        reply = json.loads(line)
    except ValueError as exc:
        raise _bad_reply(f"reply is not valid JSON: {exc}") from None
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise _bad_reply("reply is not a JSON object with a boolean 'ok'")
    reply_id = reply.get("id")
    if reply_id != request_id and not (reply_id is None and not reply["ok"]):
        raise _bad_reply(f"reply id {reply_id!r} does not match request id {request_id!r}")
    return reply


def _result(reply: dict[str, Any]) -> dict[str, Any]:
    """The result of an ok reply; raises the error of a failed one."""
    if reply["ok"]:
        result = reply.get("result")
        if not isinstance(result, dict):
            raise _bad_reply("ok reply without a 'result' object")
        return result
    error = reply.get("error")
    if not isinstance(error, dict):
        raise _bad_reply("error reply without an 'error' object")
    code, message = error.get("code"), error.get("message")
    if not isinstance(code, str) or not isinstance(message, str):
        raise _bad_reply("error reply without a string 'code' and 'message'")
    raise ControlError(code, message)


class ControlClient:
    """Sends commands to one agent over one connection, opened on first use."""

    def __init__(
        self,
        *,
        socket_path: Path | None = None,
        tcp: tuple[str, int] | None = None,
        token: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        self._endpoint: Path | tuple[str, int]
        if socket_path is not None and tcp is None:
            self._endpoint = socket_path
            self.address = str(socket_path)
        elif tcp is not None and socket_path is None:
            self._endpoint = tcp
            self.address = join_address(*tcp)
        else:
            raise ValueError("give exactly one of socket_path and tcp")
        if not (math.isfinite(timeout) and timeout > 0):
            raise ValueError("timeout must be a finite number > 0")
        self._token = token
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._buffer = bytearray()

    def request(
        self, cmd: str, args: dict[str, Any] | None = None, *, request_id: str | None = None
    ) -> dict[str, Any]:
        """Send one command and return its result once the agent has applied it."""
        if request_id is None:
            request_id = f"ctl-{uuid.uuid4().hex[:12]}"
        line = encode(make_request(cmd, args, request_id=request_id, token=self._token))
        if len(line) - 1 > MAX_LINE_BYTES:  # the agent's limit excludes the newline
            raise ControlError(ErrorCode.TOO_LARGE.value, f"request exceeds {MAX_LINE_BYTES} bytes")
        deadline = time.monotonic() + self.timeout
        try:
            reply = _check_reply(self._exchange(line, deadline), request_id)
        except BaseException:
            self.close()  # the stream's state is unknown: the next request reconnects
            raise
        if reply["id"] is None:
            self.close()  # the agent hangs up after an error it cannot tie to a request
        return _result(reply)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buffer.clear()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _remaining(self, deadline: float) -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise self._timeout()
        return remaining

    def _timeout(self) -> ControlTimeout:
        return ControlTimeout(
            f"no reply from the agent at {self.address} within {self.timeout:g} s "
            "(the command may still be applied)"
        )

    def _exchange(self, line: bytes, deadline: float) -> bytes:
        """Send a request line and read the reply line. A kept connection that the agent has
        closed meanwhile (it drops idle ones) is retried once on a new one: the agent answers a
        repeated request id from the first result, so nothing is applied twice."""
        reused = self._sock is not None
        try:
            return self._send_and_read(line, deadline)
        except ControlUnavailable:
            if not reused:
                raise
        self.close()
        return self._send_and_read(line, deadline)

    def _send_and_read(self, line: bytes, deadline: float) -> bytes:
        sock = self._connected(deadline)
        self._send(sock, line, deadline)
        return self._read_line(sock, deadline)

    def _connected(self, deadline: float) -> socket.socket:
        if self._sock is None:
            self._sock = self._connect(self._remaining(deadline))
        return self._sock

    def _connect(self, timeout: float) -> socket.socket:
        try:
            if isinstance(self._endpoint, tuple):
                return socket.create_connection(self._endpoint, timeout=timeout)
            return _connect_unix(self._endpoint, timeout)
        except OSError as exc:
            reason = exc.strerror or str(exc) or type(exc).__name__
            raise ControlUnavailable(
                f"cannot connect to the agent at {self.address}: {reason}"
            ) from None

    def _send(self, sock: socket.socket, line: bytes, deadline: float) -> None:
        try:
            sock.settimeout(self._remaining(deadline))
            sock.sendall(line)
        except TimeoutError:
            raise self._timeout() from None
        except OSError as exc:
            raise self._lost(exc) from None

    def _read_line(self, sock: socket.socket, deadline: float) -> bytes:
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                return line
            if len(self._buffer) > MAX_REPLY_BYTES:
                raise _bad_reply(f"reply exceeds {MAX_REPLY_BYTES} bytes")
            try:
                sock.settimeout(self._remaining(deadline))
                chunk = sock.recv(_RECV_BYTES)
            except TimeoutError:
                raise self._timeout() from None
            except OSError as exc:
                raise self._lost(exc) from None
            if not chunk:
                raise self._lost(None)
            self._buffer += chunk

    def _lost(self, exc: OSError | None) -> ControlUnavailable:
        reason = "" if exc is None else f" ({exc.strerror or exc})"
        return ControlUnavailable(
            f"the agent at {self.address} closed the connection without replying{reason}"
        )


def _connect_unix(path: Path, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(str(path))
    except BaseException:
        sock.close()
        raise
    return sock
